"""Importance eviction (--kv-eviction snapkv / h2o, runtime/core/importance.py) in the engine on a
tiny random llama build with the native CPU PagedAttention op returning attention scores: with a
budget that never binds, the greedy tokens equal the full cache's (the scoring path changes nothing);
a sequence alone gives the same tokens as in a batch of 32 while evicting (scores, budgets and
releases are per sequence); h2o holds each sequence's blocks to its budget while decoding; a prompt
that is mostly a prefix-cache hit still computes (and observes) its last w tokens; int8 and int4 KV
builds evict too; blocks released and then evicted from the pool are reported removed (the Dynamo
KV events) and kept by the host tier; and a build without scores is refused, saying how to rebuild."""

from __future__ import annotations

import pytest

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.llm import LLM
from kvexport.runtime.sampling_params import SamplingParams
from testkit.parity import random_prompts

BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, hf_folder, cpu_op):
    src = hf_folder("llama", num_key_value_heads=2)
    out, _ = build(str(src), tmp_path_factory.mktemp("imp") / "llama",
                   BuildOptions(block_size=BS, max_seq_len=128, validate=False, attention=io.Attention.PLUGIN))
    return out


def _llm(build_dir, **kw):
    return LLM(build_dir, **(dict(kv_cache_memory="4MiB", max_num_batched_tokens=64, max_num_seqs=32) | kw))


def _tokens(llm, prompts, n):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))]


def test_budget_that_never_binds_equals_the_full_cache(tiny):
    prompts = random_prompts(6, 128, 30, 70, seed=2)
    full = _tokens(_llm(tiny), prompts, 12)
    # h2o observes every step (the prompt's last 8 tokens, then each new token): scores flow, nothing is released
    llm = _llm(tiny, kv_eviction="h2o", kv_budget_tokens=128, kv_observation_tokens=8, kv_recent_tokens=8)
    assert llm.engine.manifest.kv.attention_scores
    assert _tokens(llm, prompts, 12) == full
    assert llm.engine.pool.num_used_blocks == 0


def test_alone_equals_in_a_batch_of_32_while_evicting(tiny):
    prompts = random_prompts(32, 128, 40, 90, seed=5)
    kw = dict(kv_eviction="snapkv", kv_budget_tokens=32, kv_observation_tokens=8, kv_recent_tokens=8)
    batch = _llm(tiny, **kw)
    got = _tokens(batch, prompts, 8)
    assert batch.engine.scheduler.num_preemptions == 0  # each sequence computed once: same observation window
    alone = _llm(tiny, **kw)
    for i in (0, 13, 31):
        assert _tokens(alone, [prompts[i]], 8)[0] == got[i]
    full = _tokens(_llm(tiny), prompts, 8)
    assert got != full  # the budget binds: eviction changed some continuations


def test_h2o_holds_blocks_to_the_budget(tiny):
    llm = _llm(tiny, kv_eviction="h2o", kv_budget_tokens=32, kv_observation_tokens=8, kv_recent_tokens=8)
    eng = llm.engine
    prompts = random_prompts(3, 128, 50, 60, seed=7)
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
    peak = 0
    while eng.has_unfinished():
        eng.step()
        peak = max(peak, eng.pool.num_used_blocks)
    # each sequence: its 32-token budget in blocks (8) + the block being written; a prompt step may hold
    # the whole prompt until its end is scored (15 blocks) while the others hold their budgets
    assert peak <= 15 + 2 * (32 // BS + 1)
    assert eng.pool.num_used_blocks == 0


def _scores_of(llm):
    """Every attention_scores entry the runner returns, by request id (the runner's real output)."""
    got, run = {}, llm.engine.runner.execute

    def execute(out):
        result = run(out)
        got.update(result.attention_scores)
        return result

    llm.engine.runner.execute = execute
    return got


def test_onnx_form_scores_equal_the_ops(tiny, hf_folder, tmp_path_factory):
    src = hf_folder("llama", num_key_value_heads=2)
    onnx_build, _ = build(str(src), tmp_path_factory.mktemp("imp") / "onnx",
                          BuildOptions(block_size=BS, max_seq_len=128, validate=False, attention=io.Attention.ONNX))
    prompts = random_prompts(5, 128, 30, 70, seed=3)
    kw = dict(kv_eviction="snapkv", kv_budget_tokens=32, kv_observation_tokens=8, kv_recent_tokens=8)
    a, b = _llm(onnx_build, **kw), _llm(tiny, **kw)
    assert a.engine.backend.attention_impl == "onnx"
    sa, sb = _scores_of(a), _scores_of(b)
    assert _tokens(a, prompts, 8) == _tokens(b, prompts, 8)
    assert sorted(sa) == sorted(sb) and len(sa) == 5
    for rid in sa:
        assert sa[rid].shape == sb[rid].shape and float(abs(sa[rid] - sb[rid]).max()) < 1e-5


def test_build_without_scores_is_refused(tiny):
    """A build made before attention scores (its manifest has no kv.attention_scores: the real manifest of
    the tiny build with that field cleared, as such a build's reads) is refused, saying how to rebuild."""
    import dataclasses

    from kvexport import manifest as mf
    from kvexport.runtime.config import EngineConfig
    from kvexport.runtime.core.importance import importance_policy

    m = mf.load(tiny)
    old = dataclasses.replace(m, kv=dataclasses.replace(m.kv, attention_scores=None))
    config = EngineConfig(kv_eviction="snapkv", kv_budget_tokens=64)
    with pytest.raises(ConfigError, match="does not return attention scores.*rebuild it with"):
        importance_policy(tiny, old, config, 128)
    assert importance_policy(tiny, m, config, 128) is not None


def test_request_budget(tiny):
    """A request may ask for a smaller budget (SamplingParams.kv_budget_tokens); out of range it is refused
    naming the field, and so on an engine without importance eviction."""
    from kvexport.runtime.request_checks import RequestError

    llm = _llm(tiny, kv_eviction="snapkv", kv_budget_tokens=64, kv_observation_tokens=8, kv_recent_tokens=8)
    eng = llm.engine
    prompt = random_prompts(1, 128, 90, 91, seed=9)[0]
    used = {}
    for budget in (None, 24):
        rid = eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True, kv_budget_tokens=budget))
        eng.step()  # the prompt: scored, evicted to the budget
        used[budget] = eng.pool.num_used_blocks
        while eng.has_unfinished():
            eng.step()
        eng.pop_output(rid)
    # blocks held after the prompt step: 64 tokens = 16 blocks (+ the decode's), 24 tokens = 6 blocks (+ 1)
    assert used[None] <= 64 // BS + 1 and used[24] <= 24 // BS + 1 < used[None]
    with pytest.raises(RequestError, match=r"kv_budget_tokens must be an integer in \[16, 128\]"):
        eng.add_request(prompt, SamplingParams(max_tokens=2, kv_budget_tokens=8))
    with pytest.raises(RequestError, match="runs without importance eviction"):
        _llm(tiny).engine.add_request(prompt, SamplingParams(max_tokens=2, kv_budget_tokens=64))


def _scheduled_of(llm):
    """(request id, chunk tokens, observation_len) of every scheduled chunk (the scheduler's real output)."""
    seen, run = [], llm.engine.runner.execute

    def execute(out):
        seen.extend((s.request_id, len(s.token_ids), s.observation_len) for s in out.scheduled)
        return run(out)

    llm.engine.runner.execute = execute
    return seen


def test_a_prefix_cache_hit_leaves_the_observation_window_to_compute(tiny):
    """The prompt's blocks are in the prefix cache (the same prompt served before with the full cache): a
    request that will be scored still computes its last w tokens, observes all w of them, and continues
    as the same request computed from scratch does."""
    kw = dict(kv_eviction="snapkv", kv_budget_tokens=128, kv_observation_tokens=8, kv_recent_tokens=8)
    prompt = random_prompts(1, 128, 90, 91, seed=11)[0]  # 90 tokens: 22 full blocks, a hit could cover 88
    budgeted = SamplingParams(max_tokens=8, ignore_eos=True, kv_budget_tokens=24)
    cached = _llm(tiny, **kw)
    seen = _scheduled_of(cached)
    full = cached.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert cached.engine.stats().prefix_cache.hits == 0
    seen.clear()
    got = cached.generate([prompt], budgeted)[0]
    assert cached.engine.stats().prefix_cache.hits == 20
    first = seen[0]
    assert first[1] == 90 - 80 and first[2] == 8  # hit 20 blocks (80 tokens), not 22: all w observed
    fresh = _llm(tiny, enable_prefix_caching=False, **kw).generate([prompt], budgeted)[0]
    assert got.token_ids == fresh.token_ids
    # a sequence that fits its budget is never scored: its hit covers all it can
    seen.clear()
    cached.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    assert seen[0][1] == 90 - 88 and seen[0][2] == 0
    assert len(full.token_ids) == 8


@pytest.mark.parametrize("kv_dtype", [io.DType.INT8, io.DType.INT4])
def test_quantized_kv_builds_evict(hf_folder, tmp_path_factory, cpu_op, kv_dtype):
    """int8 / int4 KV pools (the native op scores over the dequantized keys): a budget that never binds
    gives the full cache's greedy tokens, a binding one holds the sequence to its budget's blocks."""
    hf = dict(hidden_size=128, num_attention_heads=4) if kv_dtype is io.DType.INT4 else {}  # int4: head_dim 32
    src = hf_folder("llama", num_key_value_heads=2, **hf)
    out, _ = build(str(src), tmp_path_factory.mktemp("imp-q") / "llama",
                   BuildOptions(block_size=BS, max_seq_len=128, validate=False, attention=io.Attention.PLUGIN,
                                kv_dtype=kv_dtype))
    prompts = random_prompts(4, 128, 60, 90, seed=13)
    kw = dict(kv_observation_tokens=8, kv_recent_tokens=8)
    llm = _llm(out, kv_eviction="snapkv", kv_budget_tokens=128, **kw)
    assert llm.engine.manifest.kv.attention_scores
    assert _tokens(llm, prompts, 8) == _tokens(_llm(out), prompts, 8)
    tight = _llm(out, kv_eviction="snapkv", kv_budget_tokens=24, **kw)
    eng = tight.engine
    rid = eng.add_request(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.scheduler.requests[rid].num_computed_tokens < len(prompts[0]):
        eng.step()
    assert eng.pool.num_used_blocks <= 24 // BS + 1  # scored and evicted to the budget
    while eng.has_unfinished():
        eng.step()
    assert len(eng.pop_output(rid).token_ids) == 4


def test_released_blocks_are_reported_removed_and_kept_by_the_host_tier(tiny):
    """A prompt's full blocks are published before the policy releases some; a released block stays a valid
    prefix-cache entry (it holds what its hash says) until the pool reuses it, and then it is evicted as
    any cached block: the pool's KV events (what runtime/serving/dynamo_worker.py publishes to the
    router, kv_event_batch) report it removed, and the host tier keeps a copy."""
    from kvexport.runtime.core.kv_tiers import HOST
    from kvexport.runtime.serving.dynamo_protocol import external_hash, kv_event_batch

    llm = _llm(tiny, kv_eviction="snapkv", kv_budget_tokens=24, kv_observation_tokens=8, kv_recent_tokens=8,
               kv_cache_memory="256KiB", kv_offload_memory="4MiB")
    eng = llm.engine
    assert eng.tiers is not None
    eng.pool.record_events()
    released, release = [], eng.kv.release_blocks

    def spy(request_id, indices):
        table = eng.kv.block_table(request_id)
        released.extend((table[i], eng.pool.block_hash(table[i])) for i in indices)
        return release(request_id, indices)

    eng.kv.release_blocks = spy
    prompt = random_prompts(1, 128, 90, 91, seed=17)[0]
    llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(released) >= 90 // BS - 24 // BS - 1 and all(h is not None for _, h in released)
    events, _ = kv_event_batch(eng.pool.pop_events(), BS)
    stored = {h for e in events if e["type"] == "stored" for h in e["block_hashes"]}
    assert {external_hash(h) for _, h in released} <= stored  # published before the release
    assert not [e for e in events if e["type"] == "removed"]  # released: still valid cached entries
    eng.kv.release_blocks = release  # (the other prompts evict too: their blocks stay cached)
    # other prompts fill the pool: the released blocks are evicted from it
    others = random_prompts(2 * eng.pool.num_usable_blocks * BS // 90 + 2, 128, 90, 91, seed=19)
    llm.generate(others, SamplingParams(max_tokens=2, ignore_eos=True))
    events, _ = kv_event_batch(eng.pool.pop_events(), BS)
    removed = {h for e in events if e["type"] == "removed" for h in e["block_hashes"]}
    assert {external_hash(h) for _, h in released} <= removed
    held = [eng.tiers.where((io.FULL_GROUP, h)) for _, h in released]
    assert held == [HOST] * len(released)  # the host tier (16x the pool) keeps them


def _triton_test_kit():
    """FakePb (the stand-in for triton_python_backend_utils, which exists only inside Triton's stub) and
    Request from tests/runtime/serving/test_triton_model.py."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / "serving" / "test_triton_model.py"
    spec = importlib.util.spec_from_file_location("_triton_model_kit", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FakePb, mod.Request


def test_the_triton_model_takes_a_request_budget(tiny, tmp_path, monkeypatch):
    """The Triton model's `kv_budget_tokens` input: with kv_eviction snapkv in config.pbtxt a request's
    smaller budget releases more of its prompt's blocks (the engine's real releases, counted); out of
    range, or on a model without importance eviction, the request gets an error naming the input."""
    import json
    import sys

    import numpy as np

    from kvexport.runtime.serving import triton_model

    fake_pb, request = _triton_test_kit()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb())
    prompt = np.array(random_prompts(1, 128, 90, 91, seed=23)[0], np.int64)

    def start(**extra):
        m = triton_model.TritonPythonModel()
        params = {"build_dir": str(tiny), "kv_cache_memory": "4MiB", "threads": "1", **extra}
        m.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}}),
                      "model_repository": str(tmp_path), "model_name": "tiny", "model_version": "1",
                      "model_instance_name": "tiny_0"})
        return m

    def send(m, **inputs):
        r = request(input_ids=prompt, max_tokens=np.array([3], np.int64), ignore_eos=np.array([True]), **inputs)
        m.execute([r])
        assert r.sender.final.wait(60)
        (resp, _), = r.sender.responses
        return resp

    m = start(kv_eviction="snapkv", kv_budget_tokens="64", kv_observation_tokens="8", kv_recent_tokens="8")
    try:
        released, release = [], m.engine.kv.release_blocks
        m.engine.kv.release_blocks = lambda rid, idx: released.append(len(idx)) or release(rid, idx)
        counts = {}
        for budget in (None, 24):
            released.clear()
            resp = send(m, **({} if budget is None else {"kv_budget_tokens": np.array([budget], np.int64)}))
            assert resp.error is None and len(resp.tensors["token_ids"]) == 3
            counts[budget] = sum(released)
        # 90 prompt tokens: to 64 -> cdiv(26, 4) = 7 blocks of 4 released, to 24 -> cdiv(66, 4) = 17
        assert counts[None] == -(-(90 - 64) // BS) and counts[24] == -(-(90 - 24) // BS)
        resp = send(m, kv_budget_tokens=np.array([8], np.int64))
        assert resp.error is not None and "kv_budget_tokens must be an integer in" in resp.error.message
    finally:
        m.finalize()
    m = start()
    try:
        resp = send(m, kv_budget_tokens=np.array([24], np.int64))
        assert resp.error is not None and "runs without importance eviction" in resp.error.message
    finally:
        m.finalize()
