"""runtime/core/stats.py: the engine's typed statistics, made by `Scheduler.stats()` — the pool's
figures, the tiers' and checkpoints' passed in, speculation's (drafts accepted per position, the
one acceptance rate) from its policy; all 0 (speculation None) when a part is off."""

from types import SimpleNamespace

from kvexport.runtime.core.block_pool import BlockPool, PrefixCacheStats
from kvexport.runtime.core.kv_cache_manager import KVCacheManager
from kvexport.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvexport.runtime.core.speculation import SpeculativeDecoding
from kvexport.runtime.core.stats import (NO_SPEC_DECODING, KVTierStats, SchedulerStats, SpecDecodingStats,
                                         StateCheckpointStats)
from kvexport.runtime.sampling_params import SamplerState, SamplingParams

BS = 4


def _sched(speculation=None) -> Scheduler:
    return Scheduler(SchedulerConfig(4, 64, 64), KVCacheManager(BlockPool(9, BS, enable_prefix_caching=True)),
                     speculation=speculation)


def _add(sched, rid, prompt):
    p = SamplingParams(ignore_eos=True, max_tokens=8)
    return sched.new_request(rid, list(prompt), p, SamplerState.create(p))


def test_defaults_are_zero():
    st = SchedulerStats()
    assert (st.num_running, st.kv_blocks_used, st.kv_cache_usage, st.num_preemptions) == (0, 0, 0.0, 0)
    assert st.prefix_cache == PrefixCacheStats(0, 0, 0) and st.prefix_cache.hit_rate == 0.0
    assert st.tiers == KVTierStats() and st.tiers.load_seconds_per_block is None and st.tiers.disk_on is False
    assert st.state == StateCheckpointStats() and st.spec_decoding is None
    assert st.spec_decoding_or_zero is NO_SPEC_DECODING and NO_SPEC_DECODING.acceptance_rate == 0.0
    assert KVTierStats(load_seconds=0.5, loads=4).load_seconds_per_block == 0.125


def test_spec_decoding_ratios():
    st = SpecDecodingStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=3,
                           num_accepted_tokens_per_pos=(2, 1, 0))
    assert st.acceptance_rate == 0.25 and st.mean_accepted_length == 1.75
    assert st.to_json() == {"num_drafts": 4, "draft_tokens": 12, "accepted_tokens": 3, "acceptance_rate": 0.25,
                            "mean_accepted_length": 1.75}


def test_scheduler_stats_read_the_pool_and_take_the_tiers():
    sched = _sched()
    _add(sched, "a", range(1, 10))  # 9 tokens: 3 blocks once scheduled; b: 1
    _add(sched, "b", range(1, 5))
    sched.schedule()
    tiers, state = KVTierStats(host_blocks=2, host_hits=1), StateCheckpointStats(saved=3)
    st = sched.stats(tiers=tiers, state=state)
    assert (st.num_running, st.num_waiting) == (2, 0)
    assert (st.kv_blocks_used, st.kv_blocks_total, st.kv_cache_usage) == (4, 8, 0.5)
    assert st.running_computed_tokens == (("a", 0), ("b", 0))  # scheduled, not yet stored
    assert st.prefix_cache == PrefixCacheStats(2, 0, 0)  # a: 2 full blocks before its last token, missed; b: none
    assert st.tiers is tiers and st.state is state and st.spec_decoding is None


def test_accepted_tokens_are_counted_per_draft_position():
    spec = SpeculativeDecoding(3, cost_model=False)
    sched = _sched(spec)
    req = _add(sched, "a", [1, 2])
    for k, accepted in ((3, 2), (3, 0), (2, 2), (3, 3)):
        scheduled = SimpleNamespace(num_draft_tokens=k)
        result = SimpleNamespace(sampled={"a": None}, accepted={"a": (None,) * accepted})
        assert spec.verify(req, scheduled, result) == k - accepted
    st = sched.stats().spec_decoding
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (4, 11, 7)
    assert st.num_accepted_tokens_per_pos == (3, 3, 1) and sum(st.num_accepted_tokens_per_pos) == 7
    assert st.acceptance_rate == 7 / 11 and (st.step_seconds, st.row_seconds) == (0.0, 0.0)
