"""The KV hand-off of disaggregated serving (runtime/serving/dynamo_disagg.py, kv_transfer.py)
between two real engines in one process, without Dynamo: a "prefill" engine runs the prompt with
max_tokens 1 and its blocks are copied out as the request finishes (`KVConnector.export_blocks`); the
bytes move through NIXL (two UCX agents in this process: the READ, the notification that frees
the offer, an offer nobody pulls freed by its timeout); a "decode" engine writes the blocks it
lacks into its pool (`KVConnector.import_blocks`) and generates: greedy tokens equal an aggregated engine's,
and the prompt's full blocks are prefix-cache hits there. Builds: fp32 (`onnx` attention), int8
KV, int4 KV (codes and in-row scales), and a hybrid gemma2 build (both KV cache groups). Plus:
a decode engine that already holds part of the prefix pulls only the rest; an offer of another
build is not taken (the identities differ); bad --kv-transfer settings name the option. The
workers' handlers without Dynamo (issue 36 §4): a refused request is one log line (a failed
future, no traceback); a decode worker given another build's offer serves the request itself and
says once that it is misconfigured (not ready)."""

import asyncio
import time

import numpy as np
import pytest

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.engine import LLMEngine
from kvexport.runtime.sampling_params import SamplingParams
from kvexport.runtime.serving import dynamo_disagg as dd

CFG = dict(kv_cache_memory="64KiB", max_num_batched_tokens=64, max_num_seqs=2)
PROMPT = [3 + (i * 7) % 120 for i in range(23)]  # 5 full blocks of 4 (+3 tokens) handed over
GEN = SamplingParams(max_tokens=6, ignore_eos=True)


def _builds(hf_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("disagg")
    onnx = dict(block_size=4, max_seq_len=64, validate=False, attention=io.Attention.ONNX)
    llama = str(hf_folder("llama", num_key_value_heads=2))
    return {
        "fp32": lambda: build(llama, root / "fp32", BuildOptions(**onnx))[0],
        "int8": lambda: build(llama, root / "int8", BuildOptions(**onnx, kv_dtype=io.DType.INT8))[0],
        "int4": lambda: build(str(hf_folder("llama", num_key_value_heads=2, hidden_size=128, num_attention_heads=4)),
                              root / "int4", BuildOptions(**onnx, kv_dtype=io.DType.INT4))[0],
        "gemma2": lambda: build(str(hf_folder("gemma2")), root / "g2", BuildOptions(**onnx))[0],
        "qwen3_5": lambda: build(str(hf_folder("qwen3_5_text")), root / "q35", BuildOptions(**onnx))[0],
    }


@pytest.fixture(scope="module")
def builds(hf_folder, tmp_path_factory):
    made, makers = {}, _builds(hf_folder, tmp_path_factory)

    def get(name):
        if name not in made:
            made[name] = makers[name]()
        return made[name]

    return get


def _run(engine: LLMEngine, prompt, params):
    rid = engine.add_request(list(prompt), params)
    while engine.has_unfinished():
        engine.step()
    return engine.pop_output(rid)


def _prefill(engine: LLMEngine, prompt):
    """The prefill worker's part: the prompt and one token, then the blocks copied out."""
    _run(engine, prompt, SamplingParams(max_tokens=1))
    kv = engine.kv_connector
    return dd.offer_blocks(kv, kv.prompt_blocks(prompt, None))


def _decode(engine: LLMEngine, prompt, entries, fetch):
    """The decode worker's part: the blocks it lacks fetched (fetch(ranges) -> bytes), written,
    held until the request's first step; returns (output, blocks pulled)."""
    kv = engine.kv_connector
    want = dd.wanted(kv.prompt_blocks(prompt, None), entries)
    held = kv.held([(g, h) for g, _, h, _ in want])
    missing = [w for w in want if (w[0], w[2]) not in held]
    data = fetch([(off, kv.block_bytes[g]) for g, _, _, off in missing])
    holds = kv.import_blocks(dd.to_load(missing, want, prompt, kv.block_size, kv.block_bytes), data)
    pulled = sum(len(ids) for _, ids in holds)
    rid = engine.add_request(list(prompt), GEN)
    engine.step()
    kv.release(holds)  # admitted: the request holds its own references now
    while engine.has_unfinished():
        engine.step()
    return engine.pop_output(rid), pulled


def _local(payload):
    return lambda ranges: (np.concatenate([payload[o:o + n] for o, n in ranges]) if ranges
                           else np.empty(0, np.uint8))


@pytest.mark.parametrize("name", ["fp32", "int8", "int4", "gemma2", "qwen3_5"])
def test_decode_engine_continues_with_the_prefill_engines_blocks(builds, name):
    """qwen3_5: a gated DeltaNet hybrid; its recurrent state after the handed-over blocks travels with
    them (io.STATE_GROUP), so the decode engine resumes there instead of recomputing the prompt."""
    out = builds(name)
    agg = _run(LLMEngine(out, EngineConfig(**CFG)), PROMPT, GEN)
    prefill = LLMEngine(out, EngineConfig(**CFG))
    entries, payload = _prefill(prefill, PROMPT)
    groups = {g for g, *_ in entries}
    assert groups == {"gemma2": {io.FULL_GROUP, io.LOCAL_GROUP}, "qwen3_5": {io.FULL_GROUP, io.STATE_GROUP}}.get(
        name, {io.FULL_GROUP})
    full = [e for e in entries if e[0] == io.FULL_GROUP]
    assert [e[1] for e in full] == [0, 1, 2, 3, 4]  # (23 - 1) // 4 blocks
    if name == "qwen3_5":  # the state after block 4, where the decode engine's lookup ends
        assert [e[1] for e in entries if e[0] == io.STATE_GROUP] == [4]
    decode = LLMEngine(out, EngineConfig(**CFG))
    got, pulled = _decode(decode, PROMPT, entries, _local(payload))
    assert got.token_ids == agg.token_ids
    assert pulled == len(entries)
    assert got.num_cached_prompt_tokens == 20  # the handed-over blocks were prefix-cache hits
    assert decode.pool.num_used_blocks == 0  # nothing left held


def test_blocks_the_decode_engine_holds_are_not_pulled(builds):
    out = builds("fp32")
    prefill = LLMEngine(out, EngineConfig(**CFG))
    entries, payload = _prefill(prefill, PROMPT)
    decode = LLMEngine(out, EngineConfig(**CFG))
    _run(decode, PROMPT[:9], SamplingParams(max_tokens=1))  # its first 2 blocks are cached here
    asked = []

    def fetch(ranges):
        asked.extend(ranges)
        return _local(payload)(ranges)

    got, pulled = _decode(decode, PROMPT, entries, fetch)
    assert pulled == 3 and [o for o, _ in asked] == [e[3] for e in entries[2:]]
    assert got.token_ids == _run(LLMEngine(out, EngineConfig(**CFG)), PROMPT, GEN).token_ids


def test_an_offer_of_another_build_is_not_taken(builds):
    a, b = LLMEngine(builds("fp32"), EngineConfig(**CFG)).kv_connector, \
        LLMEngine(builds("int8"), EngineConfig(**CFG)).kv_connector
    assert a.identity != b.identity  # DecodeWorker refuses the offer before reading anything


def test_nixl_moves_the_blocks_and_frees_the_offer(builds):
    kv_transfer = pytest.importorskip("kvexport.runtime.serving.kv_transfer")
    try:
        kv_transfer.import_nixl()
    except ConfigError as e:
        pytest.skip(str(e))
    out = builds("int8")
    entries, payload = _prefill(LLMEngine(out, EngineConfig(**CFG)), PROMPT)
    src, dst = kv_transfer.NixlTransfer("prefill", timeout_s=30), kv_transfer.NixlTransfer("decode")
    offer = src.offer("room-1", payload)

    def fetch(ranges):
        return dst.pull(offer, dd._merge(ranges))

    got, pulled = _decode(LLMEngine(out, EngineConfig(**CFG)), PROMPT, entries, fetch)
    assert got.token_ids == _run(LLMEngine(out, EngineConfig(**CFG)), PROMPT, GEN).token_ids
    assert pulled == 5 and dst.pulled_bytes == payload.nbytes
    deadline = time.monotonic() + 10
    while src.rooms and time.monotonic() < deadline:  # the READ's notification frees the offer
        src.poll()
        time.sleep(0.01)
    assert src.rooms == 0 and src.expired == 0
    # an offer nobody pulls is freed by its timeout
    src.timeout_s = 0.05
    src.offer("room-2", payload.copy())
    time.sleep(0.1)
    src.poll()
    assert src.rooms == 0 and src.expired == 1


@pytest.mark.parametrize("kw,match", [
    (dict(kv_transfer="rdma"), "kv_transfer must be one of nixl, request-plane"),
    (dict(kv_transfer_timeout_s=0), "kv_transfer_timeout_s must be seconds"),
    (dict(mode="decode", engine=EngineConfig(enable_prefix_caching=False)), "turn prefix caching on"),
])
def test_bad_disaggregation_settings_name_the_option(kw, match):
    from kvexport.runtime.serving.dynamo_worker import DynamoWorkerOptions

    with pytest.raises(ConfigError, match=match):
        DynamoWorkerOptions(**kw)


def test_the_prefill_workers_component_defaults_to_prefill():
    from kvexport.runtime.serving.dynamo_worker import DynamoWorkerOptions

    assert DynamoWorkerOptions(mode="prefill").path == "kvexport.prefill.generate"
    assert DynamoWorkerOptions(mode="decode").path == "kvexport.backend.generate"


# ---- the workers' handlers, without Dynamo (issue 36 §4) ----------------------------------------
class _Errors:
    """Dynamo's exception types, as dynamo.llm.exceptions names them."""

    InvalidArgument = type("InvalidArgument", (Exception,), {})
    Unknown = type("Unknown", (Exception,), {})
    EngineShutdown = type("EngineShutdown", (Exception,), {})


class _Context:
    async def async_killed_or_stopped(self):
        await asyncio.Event().wait()  # the client stays


def _disagg_request(prompt, offer=None, **stop):
    req = {"token_ids": list(prompt), "stop_conditions": {"max_tokens": 6, "ignore_eos": True, **stop}}
    if offer is not None:
        req["prefill_result"] = {"disaggregated_params": {"kv_transfer_params": {dd.PARAMS_KEY: offer}}}
    return req


@pytest.mark.parametrize("cls", [dd.PrefillWorker, dd.DecodeWorker])
def test_a_refused_request_is_one_line_without_a_traceback(builds, cls):
    async def main():
        worker = cls(LLMEngine(builds("fp32"), EngineConfig(**CFG)), _Errors, transport="request-plane")
        out = []
        for bad in ({**_disagg_request(PROMPT), "sampling_options": {"n": 2}}, _disagg_request([5] * 80)):
            stream = await asyncio.to_thread(worker.generate, bad, _Context())  # as Dynamo calls it
            step = type(stream).__anext__(stream)  # what Dynamo's binding awaits: a future that failed
            assert isinstance(step, asyncio.Future) and step.done()
            out.append(step.exception())
        return out

    errors = asyncio.run(main())
    assert [type(e) for e in errors] == [_Errors.InvalidArgument] * 2
    assert all(e.__traceback__ is None for e in errors)  # the log gets "InvalidArgument: <message>" only
    assert str(errors[0]).startswith("sampling_options.n=2: ") and "context holds 64" in str(errors[1])


def test_an_offer_of_another_build_is_served_here_and_the_worker_says_it_is_misconfigured(builds, caplog):
    out = builds("fp32")
    want = _run(LLMEngine(out, EngineConfig(**CFG)), PROMPT, GEN).token_ids
    offer = {"format": dd.FORMAT, "identity": "another build", "block_size": 4, "blocks": [], "inline": ""}
    health: list[bool] = []

    async def main():
        worker = dd.DecodeWorker(LLMEngine(out, EngineConfig(**CFG)), _Errors, transport="request-plane")
        worker.set_health = health.append
        worker.thread.start()
        try:
            got = []
            for _ in range(2):
                stream = await asyncio.to_thread(worker.generate, _disagg_request(PROMPT, offer), _Context())
                got.append([t for c in [c async for c in stream] for t in c["token_ids"]])
            return worker, got
        finally:
            worker.thread.stop()

    with caplog.at_level("ERROR", logger=dd.__name__):
        worker, got = asyncio.run(main())
    assert got == [want, want]  # served (the prompt computed here), not a 400 per request
    assert health == [False] and "serves another build" in worker.not_ready_reason
    assert [r.levelname for r in caplog.records] == ["ERROR"]  # said once, not per request
    assert worker.stats.mismatched == 2 and worker.stats.pulled == 0
    text = worker.prometheus_text()
    assert "kvexport_disagg_misconfigured 1" in text and "kvexport_disagg_mismatched_total 2" in text
