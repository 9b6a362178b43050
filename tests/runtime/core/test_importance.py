"""Importance eviction's scheduler side (runtime/core/importance.py) over the real KV manager and
block pool: on constructed attention scores the policy keeps exactly the highest-scored blocks
(sinks and the recent window always), asks for scores only when a prompt completes (chunked
prefill), releases one block at a time while decoding (h2o), publishes nothing after releasing,
rescores after a preemption; and every bad setting's error names it.

NOTE: the attention scores here are constructed (ModelRunnerOutput.attention_scores), which is the
point: the exact blocks kept follow from them. The op that computes real ones is tested against its
float64 reference (tests/plugins/test_attention_scores.py), the engine end to end in
tests/runtime/test_importance_engine.py."""

from __future__ import annotations

import numpy as np
import pytest

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.core.block_pool import BlockPool
from kvexport.runtime.core.importance import (ImportanceEviction, block_scores, check_build, check_request_budget,
                                              choose_blocks, importance_budget)
from kvexport.runtime.core.kv_cache_manager import KVCacheManager
from kvexport.runtime.core.outputs import ModelRunnerOutput, SampledToken
from kvexport.runtime.core.scheduler import Scheduler, SchedulerConfig, Status
from kvexport.runtime.request_checks import RequestError
from kvexport.runtime.sampling_params import SamplerState, SamplingParams

PAD = io.PAD_BLOCK_ID
BS = 4


def _scheduler(policy="snapkv", budget=24, sinks=4, recent=8, obs=4, num_blocks=64, batched=64, caching=True):
    pool = BlockPool(num_blocks, BS, enable_prefix_caching=caching)
    kv = KVCacheManager(pool)
    b = importance_budget(policy=policy, budget_tokens=budget, budget_fraction=None, sink_tokens=sinks,
                          recent_tokens=recent, observation_tokens=obs, block_size=BS, max_model_len=256)
    ev = ImportanceEviction(b)
    return Scheduler(SchedulerConfig(4, batched, 256), kv, eviction=ev), kv, pool


def _add(sched, rid, prompt, max_tokens=4):
    p = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return sched.new_request(rid, prompt, p, SamplerState.create(p, 0, prompt))


def _step(sched, scores=None):
    """One step; `scores(s)` -> [kv_heads, seq_len] for each chunk that asked for scores."""
    out = sched.schedule()
    sampled = {s.request_id: SampledToken(7, None, None) for s in out.scheduled if s.samples}
    att = {}
    for s in out.scheduled:
        if s.observation_len:
            att[s.request_id] = scores(s)
    sched.update_from_output(out, ModelRunnerOutput(sampled, {}, attention_scores=att))
    return out


def _token_scores(hot_blocks, n, heads=2):
    """[heads, n]: small noise, and a spike in the middle of each of `hot_blocks` (table indices of a
    table without releases), on a different head each, so pooling over heads matters."""
    rng = np.random.default_rng(0)
    s = rng.uniform(0.0, 0.01, (heads, n)).astype(np.float32)
    for k, b in enumerate(hot_blocks):
        s[k % heads, b * BS + 1] = 1.0 + k
    return s


def test_keeps_exactly_the_highest_scored_blocks():
    sched, kv, pool = _scheduler(budget=24)  # 6 blocks: sink block 0, recent blocks, and the 3 hottest
    prompt = list(range(1, 41))  # 40 tokens = 10 blocks
    _add(sched, "a", prompt)
    hot = [6, 2, 4]
    out = _step(sched, lambda s: _token_scores(hot, s.start_pos + len(s.token_ids)))
    s = out.scheduled[0]
    assert s.observation_len == 4  # the prompt completes in this chunk: its last w tokens observe
    table = kv.block_table("a")
    # 40 tokens, budget 24: 16 tokens = 4 blocks go; candidates are blocks 1..7 (0 is the sink, 8 and 9
    # hold the recent 8 tokens): the hot 2, 4, 6 stay, 1, 3, 5, 7 go
    kept = [i for i, b in enumerate(table) if b != PAD]
    assert kept == [0, 2, 4, 6, 8, 9]
    assert pool.num_used_blocks == 6
    # the runner now gets the compacted table and the gap
    out = _step(sched, lambda s: _token_scores([], s.start_pos - s.kv_gap + 1))
    s = out.scheduled[0]
    new_block = kv.block_table("a")[10]  # position 40 opened block 10
    assert s.block_table == tuple(table[i] for i in kept) + (new_block,) and s.kv_gap == 16
    assert s.observation_len == 0  # snapkv scores the prompt only
    assert s.start_pos == 40  # positions stay the tokens' own


def test_budget_at_least_the_prompt_evicts_nothing_and_asks_no_scores():
    sched, kv, pool = _scheduler(budget=64)
    req = _add(sched, "a", list(range(1, 41)))
    out = _step(sched, lambda s: pytest.fail("no scores asked for"))
    assert out.scheduled[0].observation_len == 0 and PAD not in kv.block_table("a")
    while req.status is not Status.FINISHED:
        _step(sched, lambda s: pytest.fail("no scores asked for"))


def test_chunked_prefill_scores_when_the_prompt_completes():
    sched, kv, pool = _scheduler(budget=24, batched=16)  # 16-token chunks
    req = _add(sched, "a", list(range(1, 41)))
    asked = []
    for _ in range(3):
        out = _step(sched, lambda s: _token_scores([5], s.start_pos + len(s.token_ids)))
        asked.append(out.scheduled[0].observation_len)
    assert asked == [0, 0, 4] and req.num_computed_tokens == 40
    table = kv.block_table("a")
    kept = [i for i, b in enumerate(table) if b != PAD]
    assert len(kept) == 6 and kept[:2] == [0, 5] and kept[-2:] == [8, 9]  # the sink, the hot block, the recent


def test_h2o_stays_within_budget_while_decoding():
    sched, kv, pool = _scheduler(policy="h2o", budget=24)
    req = _add(sched, "a", list(range(1, 21)), max_tokens=40)  # prompt within the budget
    peak = 0
    while req.status is not Status.FINISHED:
        out = _step(sched, lambda s: _token_scores([2], s.start_pos - s.kv_gap + len(s.token_ids)))
        if req.status is Status.RUNNING:
            assert out.scheduled[0].observation_len == (4 if out.scheduled[0].start_pos == 0 else 1)
            kept = sum(b != PAD for b in kv.block_table("a"))
            peak = max(peak, kept)
            assert req.num_computed_tokens - (len(kv.block_table("a")) - kept) * BS <= 24
            assert kv.block_table("a")[2] != PAD and kv.block_table("a")[0] != PAD  # the hot block and the sink
    assert peak <= 24 // BS + 1  # whole blocks: the budget's 6 and the one being written


def test_nothing_published_after_a_release():
    sched, kv, pool = _scheduler(budget=24)
    prompt = list(range(1, 41))
    req = _add(sched, "a", prompt, max_tokens=12)
    while req.status is not Status.FINISHED:
        _step(sched, lambda s: _token_scores([6, 2, 4], s.start_pos - s.kv_gap + len(s.token_ids)))
    # the prompt's 10 full blocks were published before anything was released; none after
    assert kv.get_computed_blocks(prompt + [7] * 12).num_computed_tokens == 40


def test_preempted_sequence_is_scored_again():
    sched, kv, pool = _scheduler(budget=24)
    req = _add(sched, "a", list(range(1, 41)), max_tokens=8)
    _step(sched, lambda s: _token_scores([6, 2, 4], s.start_pos + len(s.token_ids)))
    assert sched.eviction.state(req).released_blocks == 4
    sched._preempt(req)
    assert sched.eviction.state(req).released_blocks == 0 and not sched.eviction.state(req).scored
    out = _step(sched, lambda s: _token_scores([3], s.start_pos + len(s.token_ids)))
    # re-admitted: the prompt's blocks (published before the release) are prefix-cache hits up to its last
    # w = 4 tokens (prefix_lookup), so the sequence is the full cache's again and the completing chunk
    # (block 9 + the output token) holds the whole observation window, which observes
    s = out.scheduled[0]
    assert (s.start_pos, len(s.token_ids), s.kv_gap, s.observation_len) == (36, 5, 0, 4)
    table = kv.block_table("a")
    kept = [i for i, b in enumerate(table) if b != PAD]
    # 41 tokens, budget 24: 5 blocks go (of candidates 1..7): the sink, the hot block 3 and the recent ones stay
    assert sched.eviction.state(req).released_blocks == 5 and len(kept) == 6
    assert kept[:2] == [0, 3] and kept[-3:] == [8, 9, 10]


def test_block_scores_and_choice():
    s = np.zeros((2, 10), np.float32)
    s[0, 5] = 3.0  # block 1 (positions 4..7) on head 0
    s[1, 0] = 1.0  # block 0 on head 1
    got = block_scores(s, 4)
    assert got.shape == (3,) and got.argmax() in (0, 1) and got[2] < got[1]
    assert choose_blocks({1: 0.5, 2: 0.1, 3: 0.1, 4: 0.9}, [1, 2, 3, 4], 2) == [2, 3]
    assert choose_blocks({1: 0.5}, [1], 0) == []


@pytest.mark.parametrize("kw,match", [
    (dict(budget_tokens=None, budget_fraction=None), "needs a per-sequence budget"),
    (dict(budget_tokens=8), "--kv-budget-tokens 8 is smaller than the sinks"),
    (dict(budget_tokens=4096), "larger than the context"),
    (dict(budget_fraction=1.5, budget_tokens=None), "--kv-budget-fraction 1.5 must be in"),
    (dict(recent_tokens=2), "--kv-recent-tokens 2 is smaller than --kv-observation-tokens"),
])
def test_bad_budgets_name_the_setting(kw, match):
    args = dict(policy="snapkv", budget_tokens=64, budget_fraction=None, sink_tokens=4, recent_tokens=8,
                observation_tokens=4, block_size=BS, max_model_len=256) | kw
    with pytest.raises(ConfigError, match=match):
        importance_budget(**args)


def test_bad_settings_and_builds():
    with pytest.raises(ConfigError, match="kv_budget_fraction must be a number in"):
        EngineConfig(kv_eviction="snapkv", kv_budget_fraction=0.0)
    with pytest.raises(ConfigError, match="budgets of --kv-eviction snapkv or h2o"):
        EngineConfig(kv_budget_tokens=64)
    assert EngineConfig.from_strings({"kv_eviction": "h2o", "kv_budget_fraction": "0.25"}).kv_budget_fraction == 0.25
    with pytest.raises(ConfigError, match="does not return attention scores.*--attention plugin --force"):
        check_build(scores=False, windowed_group=False, windows=(None,), max_model_len=64, build_dir="b", policy="snapkv")
    with pytest.raises(ConfigError, match="windowed-layer KV cache group"):
        check_build(scores=True, windowed_group=True, windows=(None, 8), max_model_len=64, build_dir="b", policy="snapkv")
    b = importance_budget(policy="snapkv", budget_tokens=64, budget_fraction=None, sink_tokens=4, recent_tokens=8,
                          observation_tokens=4, block_size=BS, max_model_len=256)
    with pytest.raises(RequestError, match=r"kv_budget_tokens must be an integer in \[16, 256\]"):
        check_request_budget(8, b, 256)
    with pytest.raises(RequestError, match="runs without importance eviction"):
        check_request_budget(64, None, 256)
    check_request_budget(32, b, 256)
