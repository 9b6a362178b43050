"""The KV tiers below the pool (runtime/core/kv_tiers.py, runtime/execution/kv_offload.py,
runtime/execution/kv_disk.py) on real engines over tiny random builds (onnxruntime, `onnx`
attention, and a hybrid gemma2 build with two KV cache groups):

- host tier: turn 2 of a conversation whose blocks were evicted from the pool is served from
  host memory (cached tokens > 0, host hits counted) with tokens identical to an engine without
  offload; also on the native PagedAttention op (pools bound in place);
- disk tier + restart: a new engine on the same kv_offload_dir gets warm hits from the files the
  first wrote (blocks evicted to disk and the pool's blocks written at `close()`), identical tokens;
- a flipped byte / a truncated file / another build's file in the folder: the block is refused
  (counted, file removed) and recomputed, tokens identical to a clean run;
- disk full: simulated by a monkeypatched write raising ENOSPC (no real full disk here): the disk
  tier turns off with a warning and serving goes on, tokens identical;
- bad input: a folder with other files, one of another build, a file as folder, sizes out of range,
  all refused at start naming the option, nothing deleted.
"""

import errno
import logging

import pytest

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.engine import LLMEngine
from kvexport.runtime.execution import kv_disk
from kvexport.runtime.sampling_params import SamplingParams

POOL = "40KiB"  # tiny llama: 2 KiB per 4-token block -> 19 usable blocks: a conversation or two
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
SYSTEM = list(range(3, 43))  # 40 tokens = 10 full blocks


@pytest.fixture(scope="module")
def tiny(hf_folder, tmp_path_factory):
    out, _ = build(str(hf_folder("llama", num_key_value_heads=2)), tmp_path_factory.mktemp("tiers") / "b",
                   BuildOptions(block_size=4, max_seq_len=128, validate=False, attention=io.Attention.ONNX))
    return out


def _run(engine: LLMEngine, prompt: list[int]):
    rid = engine.add_request(prompt, PARAMS)
    while engine.has_unfinished():
        engine.step()
    return engine.pop_output(rid)


def _conversation(engine: LLMEngine, flood: bool = True) -> tuple[list, list[int]]:
    """Turn 1, other prompts that evict its blocks from the pool, turn 2 (turn 1 + its answer +
    a new message). Returns the outputs and the pool's cached-token counts of each turn."""
    first = _run(engine, SYSTEM)
    if flood:
        for k in range(3):  # 3 x 40 tokens: more than the pool holds
            _run(engine, [100 + k] + list(range(50, 89)))
    second = _run(engine, SYSTEM + list(first.token_ids) + [7, 8, 9, 10, 11])
    return [first, second], [first.num_cached_prompt_tokens, second.num_cached_prompt_tokens]


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(kv_cache_memory=POOL, max_num_batched_tokens=64, **kw)


@pytest.fixture(scope="module")
def clean(tiny):
    outs, cached = _conversation(LLMEngine(tiny, _cfg()))
    assert cached[1] == 0, "without offload, the flood evicted turn 1's blocks"
    return [o.token_ids for o in outs]


def test_host_tier_serves_an_evicted_turn(tiny, clean):
    eng = LLMEngine(tiny, _cfg(kv_offload_memory="1MiB"))
    outs, cached = _conversation(eng)
    assert [o.token_ids for o in outs] == clean
    # turn 1 stored the KV of 40 prompt + 3 output tokens: 10 full blocks, all from host memory
    assert cached[1] == 40
    st = eng.stats().tiers
    assert st.host_hits == 10 and st.host_write_bytes > 0 and st.loads == 10
    assert st.host_read_bytes == 10 * 2048


def test_host_tier_on_the_native_plugin_op(hf_folder, tmp_path, cpu_op):
    """The native PagedAttention op reads the pools bound by address: blocks loaded into them in
    place are what it attends to (tokens identical to no offload)."""
    out, _ = build(str(hf_folder("llama", num_key_value_heads=2)), tmp_path / "p",
                   BuildOptions(block_size=4, max_seq_len=128, validate=False, attention=io.Attention.PLUGIN))
    want, _ = _conversation(LLMEngine(out, _cfg()))
    eng = LLMEngine(out, _cfg(kv_offload_memory="1MiB"))
    assert "native" in eng.backend.attention_impl
    got, cached = _conversation(eng)
    assert [o.token_ids for o in got] == [o.token_ids for o in want] and cached[1] == 40


def test_disk_tier_survives_a_restart(tiny, clean, tmp_path):
    folder = tmp_path / "kv"
    eng = LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))  # no host tier: evicted blocks go to disk
    outs, cached = _conversation(eng)
    assert [o.token_ids for o in outs] == clean and cached[1] == 40
    assert eng.stats().tiers.disk_hits == 10
    eng.close()  # the pool's blocks too, then wait for the writes
    files = sorted((folder / kv_disk.BLOCKS).iterdir())
    assert files and (folder / kv_disk.MARKER).is_file()
    again = LLMEngine(tiny, _cfg(kv_offload_dir=str(folder), kv_offload_memory="1MiB"))
    assert again.stats().tiers.disk_blocks == len(files)
    outs, cached = _conversation(again, flood=False)
    assert [o.token_ids for o in outs] == clean
    # warm from disk: turn 1's first 9 blocks (its last token is computed), turn 2's 12 (the first engine's
    # turn 2 was in its pool at close()): 10 in the pool by then, 2 more read from disk
    assert cached == [36, 48]
    st = again.stats().tiers
    assert st.disk_hits == 11 and st.disk_read_bytes == 11 * 2048


def _warm_folder(tiny, folder):
    eng = LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))
    _run(eng, SYSTEM)
    eng.close()
    return sorted((folder / kv_disk.BLOCKS).iterdir())


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_block_file_is_recomputed(tiny, clean, tmp_path, damage, caplog):
    folder = tmp_path / "kv"
    files = _warm_folder(tiny, folder)
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-7] ^= 0x40  # one payload byte
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:  # another build's header (identity) on this name
        data[8:40] = bytes(32)
    victim.write_bytes(bytes(data))
    eng = LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))
    with caplog.at_level(logging.WARNING, "kvexport.runtime.execution.kv_offload"):
        outs, _ = _conversation(eng, flood=False)
    assert [o.token_ids for o in outs] == clean
    assert eng.stats().tiers.disk_errors == 1 and not victim.exists()
    assert "recomputed" in caplog.text
    assert 0 < outs[0].num_cached_prompt_tokens < 36  # the blocks before the damaged one were still served


def test_a_full_disk_turns_the_disk_tier_off_and_serving_goes_on(tiny, clean, tmp_path, monkeypatch, caplog):
    """Disk full is simulated: DiskTier's file write raises ENOSPC (OSError) as a full disk would."""
    def full(self, path, *parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    eng = LLMEngine(tiny, _cfg(kv_offload_dir=str(tmp_path / "kv"), kv_offload_memory="1MiB",
                               kv_offload_disk="4MiB"))
    monkeypatch.setattr(kv_disk.DiskTier, "_write_atomic", full)
    eng.tiers.host_bytes = 8 * 2048  # a host tier of 8 blocks: the flood pushes blocks on to the disk
    with caplog.at_level(logging.WARNING, "kvexport.runtime.execution.kv_offload"):
        outs, _ = _conversation(eng)
        for _ in range(3):
            _run(eng, [9, 9, 9])  # steps after the failure: its report reaches the index
    assert [o.token_ids for o in outs] == clean
    assert "the disk KV tier is off" in caplog.text and "ENOSPC" in caplog.text
    assert eng.stats().tiers.disk_on is False
    assert _run(eng, SYSTEM).token_ids == clean[0]


def test_the_hybrid_build_offloads_both_groups(hf_folder, tmp_path):
    out, _ = build(str(hf_folder("gemma2")), tmp_path / "g", BuildOptions(block_size=4, max_seq_len=128,
                                                                          validate=False,
                                                                          attention=io.Attention.ONNX))
    cfg = dict(kv_cache_memory="48KiB", max_num_seqs=2, max_num_batched_tokens=32)
    clean_outs, cached = _conversation(LLMEngine(out, EngineConfig(**cfg)))
    eng = LLMEngine(out, EngineConfig(**cfg, kv_offload_memory="1MiB"))
    outs, cached_t = _conversation(eng)
    assert [o.token_ids for o in outs] == [o.token_ids for o in clean_outs]
    assert cached_t[1] > cached[1]
    ops_groups = {k[0] for k in eng.tiers._host}
    assert ops_groups == {io.FULL_GROUP, io.LOCAL_GROUP}


@pytest.mark.parametrize("setup,kw,match", [
    ("other", {}, "is not empty and not a kvexport KV offload folder"),
    ("file", {}, "is not a folder"),
    ("stray", {}, "holds files kvexport did not write"),
    (None, {"kv_offload_disk": "1"}, "kv_offload_disk '1' must be between one KV block"),
    (None, {"kv_offload_memory": "100"}, "kv_offload_memory '100' holds no KV block"),
    (None, {"kv_offload_memory": "100TiB"}, "is more than this machine's memory"),
])
def test_bad_offload_settings_are_refused_naming_the_option(tiny, tmp_path, snapshot, setup, kw, match):
    folder = tmp_path / "kv"
    if setup == "other":
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    elif setup == "file":
        folder.write_text("a file")
    elif setup == "stray":
        _warm_folder(tiny, folder)
        (folder / kv_disk.BLOCKS / "photo.jpg").write_bytes(b"x")
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=match) as e:
        LLMEngine(tiny, _cfg(kv_offload_dir=str(folder), **kw))
    assert "kv_offload" in str(e.value)
    assert snapshot(tmp_path) == before  # nothing of the user's deleted or changed


def test_a_folder_of_another_build_is_refused(tiny, hf_folder, tmp_path):
    other, _ = build(str(hf_folder("llama", num_key_value_heads=1)), tmp_path / "o",
                     BuildOptions(block_size=4, max_seq_len=128, validate=False, attention=io.Attention.ONNX))
    folder = tmp_path / "kv"
    _warm_folder(other, folder)
    with pytest.raises(ConfigError, match=r"kv_offload_dir \(--kv-offload-dir\) .* holds the KV blocks of another build"):
        LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))


def test_settings_are_checked_where_they_are_made():
    with pytest.raises(ConfigError, match="kv_offload_memory"):
        EngineConfig(kv_offload_memory="lots")
    with pytest.raises(ConfigError, match="need enable_prefix_caching|needs enable_prefix_caching|need"):
        EngineConfig(kv_offload_memory="1GiB", enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="kv_offload_disk is 0 bytes"):
        EngineConfig(kv_offload_dir="/tmp/x", kv_offload_disk="0")
    with pytest.raises(ConfigError, match="kv_offload_dtype int8 sets the precision of the KV tiers, and none is on"):
        EngineConfig(kv_offload_dtype="int8")
    with pytest.raises(ConfigError, match="kv_offload_dtype"):
        EngineConfig(kv_offload_memory="1GiB", kv_offload_dtype="int2")
    cfg = EngineConfig(kv_offload_memory="2GiB", kv_offload_dir="/tmp/kv")
    assert EngineConfig.from_strings(cfg.to_strings()) == cfg


def test_a_request_waits_for_its_disk_read_while_the_others_run(tiny, clean, tmp_path):
    folder = tmp_path / "kv"
    _warm_folder(tiny, folder)
    eng = LLMEngine(tiny, _cfg(kv_offload_dir=str(folder)))
    runner = eng.add_request([9, 8, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    eng.step()  # its prompt
    waiter = eng.add_request(SYSTEM, PARAMS)
    eng.step()  # the waiter's prefix is on disk: its read starts, it waits; the runner decodes on
    assert eng.scheduler.tiers_loading and eng.output(waiter).num_cached_prompt_tokens == 0
    assert len(eng.output(runner).token_ids) == 2 and waiter in [r.request_id for r in eng.scheduler.waiting]
    while eng.has_unfinished():
        eng.step()
    assert eng.pop_output(waiter).token_ids == clean[0] and eng.output(runner).finished
    assert eng.stats().tiers.disk_hits == 9


def test_the_server_reports_cached_tokens_of_a_tier_hit(tiny, clean):
    """The real app (create_app over a real engine, in-process): turn 2's usage carries
    prompt_tokens_details.cached_tokens from the host tier, and /metrics counts the hits."""
    from fastapi.testclient import TestClient

    from kvexport.runtime.serving.server import create_app

    with TestClient(create_app(tiny, _cfg(kv_offload_memory="1MiB"), served_model_name="tiny")) as c:
        def complete(prompt):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True,
                                                "temperature": 0})
            assert r.status_code == 200, r.json()
            return r.json()

        first = complete(SYSTEM)
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        for k in range(3):
            complete([100 + k] + list(range(50, 89)))
        second = complete(SYSTEM + clean[0] + [7, 8, 9, 10, 11])
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 40}
        assert second["usage"]["prompt_tokens"] == 49
        metrics = dict(line.split() for line in c.get("/metrics").text.splitlines() if not line.startswith("#"))
        assert metrics["kvexport_kv_offload_host_hits_total"] == "10"
        assert int(metrics["kvexport_kv_offload_host_read_bytes_total"]) == 10 * 2048


def test_the_chat_bench_runs_its_four_modes(tiny):
    """`kvexport bench --chat` (runtime/serving/chat_bench.py) on a tiny shape: every run's answers
    equal the run without offload, the tiers serve what the pool evicted, the restart reads disk."""
    from kvexport.runtime.serving.chat_bench import ChatShape, markdown, run_chat

    shape = ChatShape(conversations=4, turns=2, system_tokens=12, user_tokens=4, answer_tokens=3,
                      pool_conversations=1)
    result = run_chat(tiny, EngineConfig(max_num_batched_tokens=64), shape)
    runs = result["runs"]
    assert list(runs) == ["off", "host", "host+disk", "restart"]
    assert all(r["answers_equal_off"] for r in runs.values())
    assert runs["host"]["cached_prompt_tokens"] > runs["off"]["cached_prompt_tokens"]
    assert runs["host"]["tier_hits"]["host"] > 0 and runs["host+disk"]["tier_hits"]["disk"] > 0
    assert runs["restart"]["tier_hits"]["disk"] > 0
    assert runs["restart"]["cached_prompt_tokens"] > runs["host+disk"]["cached_prompt_tokens"]
    assert markdown(result).count("\n") == 6


def test_the_int8_tier_codec_rounds_each_vector_on_its_own_scale():
    """--kv-offload-dtype int8 (issue 46 §4; runtime/execution/kv_tier_codec.py): each head_dim vector of a float
    tensor is int8 codes x its absmax / 127, so an entry is off by at most half a step of its own vector; an
    all-zero vector stays zero; int8 pool codes and a hybrid's state checkpoints pass unchanged."""
    import numpy as np

    from kvexport.runtime.execution.kv_tier_codec import TierCodec

    rng = np.random.default_rng(5)
    lay = {"full": [("float32", (2, 4, 16)), ("float16", (2, 4, 16)), ("int8", (2, 4, 16))],
           io.STATE_GROUP: [("float32", (3, 8))]}
    codec = TierCodec(lay, 8)
    k = rng.standard_normal((2, 4, 16)).astype(np.float32) * np.float32(3.0)
    k[1, 2] = 0.0
    v = rng.standard_normal((2, 4, 16)).astype(np.float16)
    codes = rng.integers(-128, 128, (2, 4, 16), dtype=np.int8)
    payload = np.concatenate([a.reshape(-1).view(np.uint8) for a in (k, v, codes)])
    enc = codec.encode("full", payload)
    # 8 vectors of 16 per float tensor: 16 codes + a float32 scale each (fp32 512 -> 160 bytes: 3.2x; fp16 256 ->
    # 160: 1.6x; 64-wide heads: 3.76x / 1.88x), the int8 codes as they are
    assert enc.size == codec.encoded_bytes("full", payload.size) == 8 * (16 + 4) * 2 + 128
    back = codec.decode("full", enc)
    k2 = back[:512].view(np.float32).reshape(k.shape)
    v2 = back[512:768].view(np.float16).reshape(v.shape)
    step = np.abs(k).max(axis=-1, keepdims=True) / 127
    assert np.all(np.abs(k2 - k) <= step / 2 + 1e-6) and np.all(k2[1, 2] == 0)
    assert np.abs(v2.astype(np.float32) - v.astype(np.float32)).max() < 0.03
    assert np.array_equal(back[768:].view(np.int8).reshape(codes.shape), codes)
    state = rng.standard_normal((3, 8)).astype(np.float32).reshape(-1).view(np.uint8)
    assert np.array_equal(codec.encode(io.STATE_GROUP, state), state)


@pytest.mark.parametrize("dtype, smaller, close", [("int8", 3.0, 0.01), ("int4", 5.0, 0.1)])
def test_a_compressed_host_tier_holds_more_blocks_and_serves_the_evicted_turn(tiny, tmp_path, dtype, smaller, close):
    """The host tier at int8 / int4: the same budget holds 3.2x / 5.3x the blocks of this fp32 pool (16-wide heads)
    and turn 2 is served from it; its next token's top log-probabilities are within 0.01 / 0.1 of an engine without
    offload (0.003 / 0.046 measured) (the tiny
    random model's close logits can swap its greedy tokens, so the figures are compared, not the tokens); a disk
    folder written at the pool's precision is refused by an int8 engine, naming the option."""
    first_params = SamplingParams(max_tokens=4, ignore_eos=True)
    probe = SamplingParams(max_tokens=1, logprobs=5)

    def turn2(engine):
        first = _run(engine, SYSTEM)
        for k in range(3):  # more than the pool holds: turn 1's blocks leave it
            _run(engine, [100 + k] + list(range(50, 89)))
        rid = engine.add_request(SYSTEM + list(first.token_ids) + [7, 8, 9, 10, 11], probe)
        while engine.has_unfinished():
            engine.step()
        out = engine.pop_output(rid)
        return out.num_cached_prompt_tokens, dict(out.top_logprobs[0])

    assert first_params.max_tokens == PARAMS.max_tokens  # turn 1 as _conversation runs it
    cached0, want = turn2(LLMEngine(tiny, _cfg()))
    eng = LLMEngine(tiny, _cfg(kv_offload_memory="1MiB", kv_offload_dtype=dtype))
    cached, got = turn2(eng)
    assert cached0 == 0 and cached == 40
    common = set(want) & set(got)
    assert len(common) >= 4 and max(abs(want[t] - got[t]) for t in common) < close, (want, got)
    st = eng.stats().tiers
    per_block = eng.runner.offload.block_bytes[io.FULL_GROUP]
    assert st.host_hits == 10 and st.host_read_bytes == 10 * per_block and 2048 / per_block > smaller
    folder = tmp_path / "kv"
    _warm_folder(tiny, folder)
    with pytest.raises(ConfigError, match=rf"stored at --kv-offload-dtype auto, and this engine stores them at {dtype}"):
        LLMEngine(tiny, _cfg(kv_offload_dir=str(folder), kv_offload_dtype=dtype))


def test_the_int4_tier_codec_rotates_then_rounds_each_vector():
    """--kv-offload-dtype int4: a head_dim vector (a power of two) is rotated by the normalized Hadamard transform
    (its own inverse), rounded to [-7, 7] x its absmax / 7, two codes a byte. One outlier channel no longer sets the
    step of the rest: with the rotation the vectors' error is a fraction of what plain int4 gives them."""
    import numpy as np

    from kvexport.runtime.execution.kv_tier_codec import TierCodec, hadamard

    rng = np.random.default_rng(6)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    assert np.allclose(hadamard(hadamard(x)), x, atol=1e-5)  # orthonormal and symmetric
    x[:, 5] *= 20.0  # an outlier channel, as keys have
    lay = {"full": [("float32", (2, 4, 64))]}
    codec = TierCodec(lay, 4)
    payload = x.reshape(-1).view(np.uint8)
    enc = codec.encode("full", payload)
    assert enc.size == codec.encoded_bytes("full", payload.size) == 8 * (32 + 4)  # 2048 -> 288 bytes: 7.1x
    back = codec.decode("full", enc).view(np.float32).reshape(8, 64)
    rot = hadamard(x)
    bound = np.sqrt(64) * np.abs(rot).max(axis=1) / 7 / 2  # half a step per rotated entry, L2 over the vector
    err = np.linalg.norm(back - x, axis=1)
    assert np.all(err <= bound + 1e-4)
    plain = np.abs(x).max(axis=1, keepdims=True) / 7  # int4 without the rotation, for comparison
    plain_err = np.linalg.norm(np.clip(np.rint(x / plain), -7, 7) * plain - x, axis=1)
    assert err.mean() < 0.6 * plain_err.mean(), (err.mean(), plain_err.mean())
    assert np.array_equal(codec.decode("full", codec.encode("full", np.zeros(2048, np.uint8))), np.zeros(2048, np.uint8))
