"""Streaming eviction (--kv-eviction streaming, runtime/core/streaming.py): attention sinks + a recent
window, context shifts at max_model_len.

Covers: the scheduler over the real KV manager (exact block ids released, the compacted tables and
gaps the runner gets, the context shift's dropped tokens and its sink-block prefix hit, which blocks
are published to the prefix cache, preemption); the engine on tiny random llama builds (onnx and
plugin attention): a window covering everything equals no eviction, and with a real window the
tokens equal a float64 transformers reference of sink + window attention at the scheme's positions;
blocks in use stay bounded; the settings' errors naming the options; the request parser's max_tokens
past max_model_len; and `kvexport generate --kv-eviction streaming` past the context (CLI)."""

from __future__ import annotations

import pytest

from testkit.streaming import streaming_reference

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.core.block_pool import BlockPool
from kvexport.runtime.core.kv_cache_manager import KVCacheManager
from kvexport.runtime.core.outputs import ModelRunnerOutput, SampledToken
from kvexport.runtime.core.scheduler import Scheduler, SchedulerConfig, Status
from kvexport.runtime.core.streaming import check_model, compact, streaming_window
from kvexport.runtime.sampling_params import SamplerState, SamplingParams

PAD = io.PAD_BLOCK_ID


def _scheduler(num_blocks=64, bs=4, sinks=4, recent=8, max_model_len=32, budget=64, caching=True):
    pool = BlockPool(num_blocks, bs, enable_prefix_caching=caching)
    kv = KVCacheManager(pool)
    w = streaming_window(sink_tokens=sinks, recent_tokens=recent, block_size=bs, max_model_len=max_model_len,
                         pool_tokens=(num_blocks - 1) * bs, max_num_batched_tokens=budget)
    return Scheduler(SchedulerConfig(4, budget, max_model_len, streaming=w), kv), kv, pool


def _add(sched, rid, prompt, max_tokens):
    p = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return sched.new_request(rid, prompt, p, SamplerState.create(p, 0, prompt))


def _step(sched, token=lambda s: 100 + s.start_pos):
    out = sched.schedule()
    sampled = {s.request_id: SampledToken(token(s), None, None) for s in out.scheduled if s.samples}
    sched.update_from_output(out, ModelRunnerOutput(sampled, {}))
    return out


def test_blocks_released_exactly_and_tables_compacted():
    sched, kv, pool = _scheduler()
    req = _add(sched, "a", list(range(1, 11)), 200)
    out = _step(sched)  # the prompt: positions 0..9, blocks 1, 2, 3
    assert kv.block_table("a") == [1, 2, 3] and out.scheduled[0].kv_gap == 0
    tables = {}
    while sched.eviction.num_kv_tokens(req) <= 32 and req.status is Status.RUNNING:
        out = _step(sched)
        s = out.scheduled[0]
        tables[s.start_pos] = (s.block_table, s.kv_gap, s.slot_mapping)
        if req.status is Status.RUNNING:
            c, t = req.num_computed_tokens, kv.block_table("a")
            # the next token (position c) keeps the sink block and the blocks of positions >= c - 8
            first = (c - 8) // 4
            assert t[0] == 1 and all(b == PAD for b in t[1:first]) and all(b != PAD for b in t[max(first, 1):])
    # position 16 is computed with blocks 2 (positions 4..7) released after position 15 (16 - 8 = 8 -> block 2)
    assert tables[16] == ((1, 3, 4, 5), 4, (5 * 4 + 0,))
    assert tables[20] == ((1, 4, 5, 6), 8, (6 * 4 + 0,))
    # freed blocks went back to the pool: one sequence holds at most sink + 3 recent blocks
    assert pool.num_used_blocks <= 4 + 1


def test_context_shift_drops_the_middle_and_hits_the_sink_block():
    sched, kv, pool = _scheduler()
    req = _add(sched, "a", list(range(1, 11)), 200)
    while sched.eviction.state(req).num_shifts == 0:
        _step(sched)
    # after position 31 (the 32nd KV token) the sampled token would sit at position 32 = max_model_len
    state = sched.eviction.state(req)
    assert req.status is Status.WAITING and req.num_tokens == 33 and state.num_dropped == 33 - (4 + 8)
    assert sched.eviction.kv_token_ids(req) == req.token_ids[:4] + req.token_ids[25:33]
    hits_before = pool.stats.hits
    out = _step(sched)
    s = out.scheduled[0]
    # re-admitted: the sink block (positions 0..3) is a prefix-cache hit, the 8 recent tokens are recomputed
    assert pool.stats.hits == hits_before + 1
    assert (s.start_pos, s.token_ids, s.samples) == (4, tuple(req.token_ids[25:33]), True)
    assert s.block_table[0] == kv.block_table("a")[0] and sched.num_context_shifts == 1
    # output goes on past max_model_len and shifts again
    while sched.eviction.state(req).num_shifts < 3:
        _step(sched)
    assert req.num_tokens > 3 * 32 // 2 and req.num_output_tokens == req.num_tokens - 10
    # the next token is the 8th recent one
    assert req.status is Status.WAITING and sched.eviction.num_kv_tokens(req) == 4 + 8


def test_blocks_after_the_first_release_are_not_published():
    sched, kv, pool = _scheduler()
    req = _add(sched, "a", list(range(1, 11)), 200)
    while req.num_computed_tokens < 28:
        _step(sched)
    # the first release was after position 15: blocks 0..3 (16 tokens) were computed with their whole
    # prefix visible and are shareable; blocks 4.. saw the sinks and the window only
    assert kv.get_computed_blocks(req.token_ids[:29]).num_computed_tokens == 16


def test_preemption_recomputes_only_the_kept_tokens():
    # 7 usable blocks of 4: two streaming sequences (up to 4-5 blocks each) cannot both run
    sched, kv, pool = _scheduler(num_blocks=8, budget=8, max_model_len=28)
    a, b = _add(sched, "a", list(range(1, 9)), 60), _add(sched, "b", list(range(20, 28)), 60)
    for _ in range(400):
        if not sched.has_unfinished():
            break
        _step(sched)
    assert a.status is b.status is Status.FINISHED and a.finish_reason == b.finish_reason == "length"
    assert sched.num_preemptions > 0 and a.num_output_tokens == b.num_output_tokens == 60
    assert pool.num_used_blocks == 0


def test_compact_and_window_errors():
    assert compact((5, PAD, PAD, 7, 8), 16) == ((5, 7, 8), 32)
    kw = dict(sink_tokens=4, block_size=16, max_model_len=64, pool_tokens=1024, max_num_batched_tokens=32)
    assert streaming_window(recent_tokens=None, **kw).recent_tokens == 32
    with pytest.raises(ConfigError, match="--kv-recent-tokens 8 is smaller than one KV block"):
        streaming_window(recent_tokens=8, **kw)
    with pytest.raises(ConfigError, match="--kv-recent-tokens to <= 32"):
        streaming_window(recent_tokens=40, **kw)
    with pytest.raises(ConfigError, match="larger than the KV pool.*--kv-cache-memory"):
        streaming_window(recent_tokens=16, **{**kw, "pool_tokens": 64})
    with pytest.raises(ConfigError, match="sliding window of 8 tokens.*--kv-eviction none"):
        check_model(windows=(8, None), ropes=[], max_model_len=64)
    check_model(windows=(4096, None), ropes=[{"rope_type": "yarn"}], max_model_len=64)  # a window past the context
    with pytest.raises(ConfigError, match="longrope.*--max-model-len <= 32"):
        check_model(windows=(None,), ropes=[{"rope_type": "longrope", "original_max_positions": 32}], max_model_len=64)
    with pytest.raises(ConfigError, match="kv_eviction must be one of none, streaming"):
        EngineConfig(kv_eviction="sinks")
    cfg = EngineConfig(kv_eviction="streaming", kv_sink_tokens=0, kv_recent_tokens=64)
    assert EngineConfig.from_strings(cfg.to_strings()) == cfg  # the Triton repository parameters


def test_request_parser_takes_max_tokens_past_the_context():
    from kvexport.runtime.serving.requests import RequestError, RequestParser

    assert RequestParser(None, 50, 16, None, True).sampling_params({"max_tokens": 100}, 10).max_tokens == 100
    assert RequestParser(None, 50, 16).sampling_params({"max_tokens": 100}, 10).max_tokens == 6
    with pytest.raises(RequestError):
        RequestParser(None, 50, 16).sampling_params({"max_tokens": 100}, 10, strict_max_tokens=True)


# ---- the engine on tiny builds ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_builds(hf_folder, tmp_path_factory):
    from kvexport.exporter.build import BuildOptions, build

    folder = hf_folder("llama")
    out = {}
    for att in ("onnx", "plugin"):
        out[att], _ = build(str(folder), tmp_path_factory.mktemp("stream") / att,
                            BuildOptions(max_seq_len=64, validate=False, attention=io.Attention(att)))
    return folder, out


def _generate(build, max_tokens, prompt, **settings):
    from kvexport.runtime.engine import LLMEngine

    e = LLMEngine(build, EngineConfig(kv_cache_memory="1MiB", threads=1, max_num_batched_tokens=64, **settings))
    rid = e.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    used = []
    while e.has_unfinished():
        e.step()
        used.append(e.stats().kv_blocks_used)
    return e, e.output(rid), used


@pytest.mark.parametrize("attention", ["onnx", "plugin"])
def test_engine_streaming_equals_reference(tiny_builds, attention, request):
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    folder, builds = tiny_builds
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    # a window covering every token: the same tokens as no eviction
    _, full, _ = _generate(builds[attention], 40, prompt)
    _, wide, _ = _generate(builds[attention], 40, prompt, kv_eviction="streaming", kv_recent_tokens=32)
    assert wide.token_ids == full.token_ids and full.finish_reason == "length"
    # a real window: 4 sink tokens (one block of 16) + 16 recent, max_model_len 64: 120 tokens, 2 shifts (after outputs 56 and 89)
    e, got, used = _generate(builds[attention], 120, prompt, kv_eviction="streaming", kv_sink_tokens=4,
                             kv_recent_tokens=16)
    assert got.finish_reason == "length" and len(got.token_ids) == 120 and e.scheduler.num_context_shifts == 2
    assert max(used) <= 1 + 2 + 1 and e.stats().kv_blocks_used == 0  # sinks + the window's blocks
    # (without the sink block the reference differs from the 26th token on: the test sees the sinks)
    assert list(got.token_ids) == streaming_reference(folder, prompt, 120, 16, 16, 16, 64)


def test_engine_streaming_int8_kv(hf_folder, tmp_path):
    from kvexport.exporter.build import BuildOptions, build

    out, _ = build(str(hf_folder("llama")), tmp_path / "i8",
                   BuildOptions(kv_dtype=io.DType.INT8, max_seq_len=64, validate=False, attention=io.Attention.ONNX))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    _, full, _ = _generate(out, 50, prompt)
    e, got, used = _generate(out, 120, prompt, kv_eviction="streaming", kv_sink_tokens=4, kv_recent_tokens=16)
    assert len(got.token_ids) == 120 and e.scheduler.num_context_shifts == 2 and max(used) <= 4
    # nothing is released before position 48 (48 - 16 = block 2): the int8 codes read back are the same
    assert got.token_ids[:48 - len(prompt) + 1] == full.token_ids[:48 - len(prompt) + 1]


def test_streaming_refused_on_windowed_builds(hf_folder, tmp_path):
    from kvexport.exporter.build import BuildOptions, build
    from kvexport.runtime.engine import LLMEngine

    out, _ = build(str(hf_folder("mistral", sliding_window=8)), tmp_path / "m",
                   BuildOptions(max_seq_len=64, validate=False, attention=io.Attention.ONNX))
    with pytest.raises(ConfigError, match="--kv-eviction streaming: this build's layers attend through a sliding"):
        LLMEngine(out, EngineConfig(kv_cache_memory="1MiB", kv_eviction="streaming", kv_recent_tokens=16))


def test_cli_generate_past_the_context(chat_build):
    from click.testing import CliRunner

    from kvexport.cli import main

    r = CliRunner().invoke(main, ["generate", str(chat_build), "Hello there", "--max-tokens", "256",
                                  "--kv-eviction", "streaming", "--kv-recent-tokens", "16",
                                  "--kv-cache-memory", "4MiB", "--threads", "1", "--temperature", "0"])
    assert r.exit_code == 0, r.output
    assert "(256 tokens, finish: length)" in r.output
    r = CliRunner().invoke(main, ["generate", str(chat_build), "Hello", "--kv-eviction", "streaming",
                                  "--kv-recent-tokens", "8", "--kv-cache-memory", "4MiB"])
    assert r.exit_code != 0 and "--kv-recent-tokens 8 is smaller than one KV block (16 tokens)" in r.output


def test_serve_generates_past_the_context(chat_build, serve_process):
    import httpx

    server = serve_process(chat_build, "--kv-eviction", "streaming", "--kv-recent-tokens", "16",
                           "--kv-cache-memory", "4MiB")
    r = httpx.post(f"{server.base}/v1/completions", timeout=120,
                   json={"prompt": "Hello there", "max_tokens": 200, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    metrics = httpx.get(f"{server.base}/metrics", timeout=10).text
    shifts = next(line for line in metrics.splitlines() if line.startswith("kvexport_context_shifts_total"))
    assert int(float(shifts.split()[1])) >= 4  # context 64: a shift every 32 tokens
