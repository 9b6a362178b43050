"""KVCacheManager: block tables, slot mappings, prefix hits, fork, sliding window, None
when full (with nothing changed) and misuse. block_size is 4 throughout; a fresh pool
hands out blocks 1, 2, 3, ..."""

import pytest

from kvexport.io import PAD_BLOCK_ID
from kvexport.runtime.core.block_pool import BlockPool
from kvexport.runtime.core.errors import KVCacheError
from kvexport.runtime.core.kv_cache_manager import ComputedBlocks, KVCacheManager

BS = 4


def manager(num_blocks=9, caching=True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, BS, enable_prefix_caching=caching))


def run_prompt(m: KVCacheManager, rid: str, tokens, salt=None):
    """Start a request, 'compute' its prompt and publish its full blocks; returns
    (computed, new block ids)."""
    computed = m.get_computed_blocks(tokens, salt)
    new = m.allocate_slots(rid, len(tokens) - computed.num_computed_tokens, computed_blocks=computed)
    if new is not None:
        m.cache_blocks(rid, tokens, len(tokens))
    return computed, new


def state(m: KVCacheManager):
    p = m.pool
    return (
        p.num_free_blocks,
        p.num_evictable_blocks,
        [p.ref_count(b) for b in range(1, p.num_blocks)],
        [p.block_hash(b) for b in range(1, p.num_blocks)],
        {rid: (req.block_ids[:], req.num_slots) for rid, req in m._reqs.items()},
    )


PROMPT = list(range(100, 110))  # 10 tokens: blocks of 4, 4 and 2


def test_new_request_table_slots_and_appends():
    m = manager()
    computed, new = run_prompt(m, "a", PROMPT)
    assert computed == ComputedBlocks((), 0, computed.block_hashes, None) and len(computed.block_hashes) == 2
    assert new == [1, 2, 3]
    assert m.block_table("a") == [1, 2, 3] and m.num_slots("a") == 10 and "a" in m
    assert m.slot_mapping("a", 0, 10) == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert m.allocate_slots("a", 1) == []  # position 10 fits in block 3
    assert m.slot_mapping("a", 10, 1) == [14]
    assert m.allocate_slots("a", 1) == []
    assert m.allocate_slots("a", 1) == [4]  # position 12 opens block 4
    assert m.slot_mapping("a", 11, 2) == [15, 16]
    assert m.block_table("a") == [1, 2, 3, 4] and m.num_slots("a") == 13
    assert m.usage == 0.5


def test_block_table_is_a_copy():
    m = manager()
    run_prompt(m, "a", PROMPT)
    m.block_table("a").append(7)
    assert m.block_table("a") == [1, 2, 3]


def test_prefix_hit_shares_full_blocks_and_counts_stats():
    m = manager()
    run_prompt(m, "a", PROMPT)
    computed, new = run_prompt(m, "b", PROMPT[:8] + [7, 7])
    assert computed.block_ids == (1, 2) and computed.num_computed_tokens == 8
    assert new == [4]
    assert m.block_table("b") == [1, 2, 4] and m.num_slots("b") == 10
    assert [m.pool.ref_count(b) for b in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert (m.pool.stats.queries, m.pool.stats.hits) == (4, 2)  # a: 2 misses, b: 2 hits


def test_hit_never_covers_the_whole_prompt():
    m = manager()
    run_prompt(m, "a", PROMPT[:8])  # two full blocks, both published
    assert m.pool.num_evictable_blocks == 0 and m.pool.block_hash(2) is not None
    assert m.get_computed_blocks(PROMPT[:8]).block_ids == (1,)  # last token must be computed
    assert m.get_computed_blocks(PROMPT[:9]).block_ids == (1, 2)
    assert m.get_computed_blocks(PROMPT[:4]).block_ids == ()
    assert m.get_computed_blocks([]).block_ids == ()


def test_salt_separates_requests():
    m = manager()
    run_prompt(m, "a", PROMPT, salt="alice")
    assert m.get_computed_blocks(PROMPT).block_ids == ()
    assert m.get_computed_blocks(PROMPT, salt="bob").block_ids == ()
    assert m.get_computed_blocks(PROMPT, salt="alice").block_ids == (1, 2)


def test_decoded_blocks_are_published_too():
    m = manager()
    tokens = PROMPT[:6]
    run_prompt(m, "a", tokens)
    assert m.pool.block_hash(1) is not None and m.pool.block_hash(2) is None
    for t in (50, 51):
        assert m.allocate_slots("a", 1) == []
        tokens.append(t)
        m.cache_blocks("a", tokens, len(tokens))
    assert m.pool.block_hash(2) is not None
    assert m.get_computed_blocks(tokens + [52]).block_ids == (1, 2)


def test_full_pool_returns_none_and_changes_nothing():
    m = manager(num_blocks=5)  # 4 usable
    run_prompt(m, "a", PROMPT)  # 3 blocks
    before = state(m)
    assert m.allocate_slots("b", 5, computed_blocks=m.get_computed_blocks([1] * 5)) is None
    assert "b" not in m
    assert m.allocate_slots("a", 7) is None  # 17 slots need 5 blocks
    assert state(m) == before
    assert m.allocate_slots("a", 6) == [4]  # 16 slots fit in 4


def test_evictable_hits_do_not_pay_for_new_blocks():
    m = manager(num_blocks=5)  # 4 usable
    run_prompt(m, "a", PROMPT[:9])  # blocks 1, 2 cached; 3 holds the 9th token
    m.free("a")
    assert (m.pool.num_free_blocks, m.pool.num_evictable_blocks) == (4, 2)
    long = PROMPT[:8] + list(range(9))  # 17 tokens: hits 1, 2; needs 3 more blocks
    computed = m.get_computed_blocks(long)
    assert computed.block_ids == (1, 2)
    before = state(m)
    assert m.allocate_slots("b", 9, computed_blocks=computed) is None  # only 2 free besides the hits
    assert state(m) == before
    assert m.get_computed_blocks(long).block_ids == (1, 2)  # still cached
    _, new = run_prompt(m, "c", PROMPT[:8] + list(range(5)))  # 13 tokens: 2 new blocks
    assert new == [4, 3] and m.block_table("c") == [1, 2, 4, 3]


def test_free_is_tail_first_and_eviction_follows():
    m = manager()  # 8 usable
    run_prompt(m, "a", list(range(13)))  # blocks 1..4, 1..3 cached
    m.free("a")
    assert (m.pool.num_free_blocks, m.pool.num_evictable_blocks) == (8, 3)
    _, new = run_prompt(m, "c", [9] * 32)
    assert new == [5, 6, 7, 8, 4, 3, 2, 1]  # never used, plain freed, then evict 3, 2, 1
    assert m.pool.stats.evictions == 3


def test_readmission_after_preemption_hits_its_own_blocks():
    m = manager()
    tokens = PROMPT + [50]
    run_prompt(m, "a", tokens)
    m.free("a")  # preempted
    computed, new = run_prompt(m, "a", tokens)
    assert computed.block_ids == (1, 2) and new == [4]  # never-used blocks go before freed block 3
    assert m.block_table("a") == [1, 2, 4]


def test_two_requests_computing_the_same_prefix_at_once():
    m = manager()
    ca, cb = m.get_computed_blocks(PROMPT), m.get_computed_blocks(PROMPT)
    assert m.allocate_slots("a", 10, computed_blocks=ca) == [1, 2, 3]
    assert m.allocate_slots("b", 10, computed_blocks=cb) == [4, 5, 6]
    m.cache_blocks("a", PROMPT, 10)
    m.cache_blocks("b", PROMPT, 10)  # keys already held by a's blocks: b's stay uncached
    assert m.pool.block_hash(4) is None
    m.free("a")
    m.free("b")
    assert m.pool.num_evictable_blocks == 2
    assert m.get_computed_blocks(PROMPT).block_ids == (1, 2)


def test_fork_shares_full_blocks_only():
    m = manager()
    run_prompt(m, "p", PROMPT)
    assert m.fork("p", "c") == 8
    assert m.block_table("c") == [1, 2] and m.num_slots("c") == 8
    assert [m.pool.ref_count(b) for b in (1, 2, 3)] == [2, 2, 1]
    assert m.allocate_slots("c", 3) == [4]  # recompute tokens 8, 9 and one more
    m.free("p")
    assert [m.pool.ref_count(b) for b in (1, 2, 3, 4)] == [1, 1, 0, 1]
    m.free("c")
    assert m.pool.num_used_blocks == 0
    run_prompt(m, "p2", PROMPT)
    assert m.fork("p2", "c2", num_tokens=7) == 4
    assert m.block_table("c2") == [1]


def test_fork_without_caching_shares_refs():
    m = manager(caching=False)
    run_prompt(m, "p", PROMPT)
    assert m.fork("p", "c") == 8
    assert [m.pool.ref_count(b) for b in (1, 2, 3)] == [2, 2, 1]
    m.free("c")
    m.free("p")
    assert m.pool.num_free_blocks == 8 and m.pool.num_evictable_blocks == 0


def test_sliding_window_releases_whole_blocks_behind_it():
    m = manager()
    tokens = list(range(20))
    run_prompt(m, "a", tokens)  # blocks 1..5, all published
    # next position 20 attends to 15..20: blocks 0-2 (positions 0..11) are behind it
    assert m.free_outside_window("a", 20, 6) == [1, 2, 3]
    assert m.block_table("a") == [PAD_BLOCK_ID] * 3 + [4, 5]
    assert m.num_slots("a") == 20
    assert [m.pool.ref_count(b) for b in (1, 2, 3, 4)] == [0, 0, 0, 1]
    assert m.pool.num_evictable_blocks == 3
    assert m.slot_mapping("a", 15, 5) == [19, 20, 21, 22, 23]
    with pytest.raises(KVCacheError, match="sliding window"):
        m.slot_mapping("a", 11, 1)
    assert m.free_outside_window("a", 20, 6) == []
    assert m.free_outside_window("a", 20, 5) == [4]  # 16..20: table entry 3 (12..15) is behind too
    # released blocks stay cached: a new request with the same prompt hits all of them
    assert m.get_computed_blocks(tokens + [1]).block_ids == (1, 2, 3, 4, 5)
    m.free("a")
    assert m.pool.num_used_blocks == 0


def test_sliding_window_keeps_blocks_within_reach():
    m = manager()
    run_prompt(m, "a", list(range(8)))
    assert m.free_outside_window("a", 8, 6) == []  # 3..8 still needs block 1 (0..3)
    assert m.free_outside_window("a", 8, 5) == [1]  # 4..8
    assert m.free_outside_window("a", 8, 100) == []


def test_disabled_caching_manager():
    m = manager(caching=False)
    run_prompt(m, "a", PROMPT)
    m.free("a")
    computed = m.get_computed_blocks(PROMPT)
    assert computed == ComputedBlocks.empty()
    assert m.pool.stats.queries == 0 and m.pool.num_evictable_blocks == 0


# ---- misuse ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.block_table("x"),
        lambda m: m.num_slots("x"),
        lambda m: m.free("x"),
        lambda m: m.allocate_slots("x", 1),
        lambda m: m.slot_mapping("x", 0, 1),
        lambda m: m.cache_blocks("x", [1], 1),
        lambda m: m.fork("x", "y"),
        lambda m: m.free_outside_window("x", 0, 4),
    ],
)
def test_unknown_request_raises(call):
    with pytest.raises(KVCacheError, match="'x'"):
        call(manager())


def test_double_free_and_allocating_after_free_raise():
    m = manager()
    run_prompt(m, "a", PROMPT)
    m.free("a")
    before = state(m)
    with pytest.raises(KVCacheError, match="already"):
        m.free("a")
    with pytest.raises(KVCacheError):
        m.allocate_slots("a", 1)
    assert state(m) == before


def test_protocol_misuse_raises():
    m = manager()
    run_prompt(m, "a", PROMPT)
    with pytest.raises(KVCacheError, match="already holds"):
        m.allocate_slots("a", 1, computed_blocks=ComputedBlocks.empty())
    with pytest.raises(KVCacheError, match=">= 0"):
        m.allocate_slots("a", -1)
    with pytest.raises(KVCacheError):
        m.slot_mapping("a", 8, 3)  # only 10 slots
    with pytest.raises(KVCacheError):
        m.slot_mapping("a", -1, 1)
    with pytest.raises(KVCacheError):
        m.cache_blocks("a", PROMPT, 11)
    with pytest.raises(KVCacheError):
        m.cache_blocks("a", PROMPT[:5], 6)
    run_prompt(m, "b", [1, 2])
    with pytest.raises(KVCacheError, match="child"):
        m.fork("a", "b")
    with pytest.raises(KVCacheError):
        m.fork("a", "c", num_tokens=11)
    with pytest.raises(KVCacheError):
        m.free_outside_window("a", 11, 4)
    with pytest.raises(KVCacheError):
        m.free_outside_window("a", 10, 0)
    with pytest.raises(KVCacheError, match="claims"):
        m.allocate_slots("z", 1, computed_blocks=ComputedBlocks((), 4, (), None))


def test_stale_computed_blocks_raise():
    m = manager(num_blocks=4)  # 3 usable
    run_prompt(m, "a", PROMPT)  # blocks 1, 2 cached
    m.free("a")
    computed = m.get_computed_blocks(PROMPT)
    assert computed.block_ids == (1, 2)
    run_prompt(m, "b", [7] * 12)  # evicts 2, 1
    m.free("b")
    with pytest.raises(KVCacheError, match="evicted"):
        m.allocate_slots("c", 2, computed_blocks=computed)
    assert "c" not in m
