"""Importance eviction (--kv-eviction snapkv / h2o, runtime/core/importance.py) in the engine on a
tiny random llama build with the native CPU PagedAttention op returning attention scores: with a
budget that never binds, the greedy tokens equal the full cache's (the scoring path changes nothing);
a sequence alone gives the same tokens as in a batch of 32 while evicting (scores, budgets and
releases are per sequence); h2o holds each sequence's blocks to its budget while decoding; and a
build without scores is refused, saying how to rebuild."""

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
    return LLM(build_dir, kv_cache_memory="4MiB", max_num_batched_tokens=64, max_num_seqs=32, **kw)


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
