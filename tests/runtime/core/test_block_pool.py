"""BlockPool: allocation order, ref counts, the prefix cache and its LRU eviction, and
misuse. Block ids are exact: a fresh pool hands out 1, 2, 3, ... (0 is the pad block)."""

import hashlib
from array import array

import pytest

from kvexport.errors import ConfigError, KvExportError
from kvexport.io import PAD_BLOCK_ID
from kvexport.runtime.core.block_hash import hash_block_tokens, hash_full_blocks
from kvexport.runtime.core.block_pool import BlockPool, PrefixCacheStats
from kvexport.runtime.core.errors import KVCacheError


def pool(num_blocks=5, block_size=4, caching=True) -> BlockPool:
    return BlockPool(num_blocks, block_size, enable_prefix_caching=caching)


def keys(n: int, salt=None):
    """Keys of n distinct chained blocks (block_size 4)."""
    return hash_full_blocks(list(range(4 * n)), 4, salt)


def cached_pool(n_cached: int, num_blocks=5):
    """A pool whose blocks 1..n_cached are held and cached under keys(n_cached)."""
    p = pool(num_blocks)
    ids = p.get_new_blocks(n_cached)
    assert p.cache_full_blocks(ids, keys(n_cached)) == n_cached
    return p, ids, keys(n_cached)


# ---- hashing --------------------------------------------------------------------
def test_block_hash_is_sha256_of_a_fixed_encoding():
    root = hashlib.sha256(b"kvexport.prefix-cache.root").digest()
    expected = hashlib.sha256(root + b"\x00" + array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert hash_block_tokens(None, [1, 2, 3, 4]) == expected
    assert len(expected) == 32


def test_block_hash_depends_on_parent_tokens_and_salt():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, (1, 2, 3, 4)) == h  # tuple or list alike
    assert hash_block_tokens(h, [1, 2, 3, 4]) != h
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h
    assert hash_block_tokens(None, [1, 2, 3, 4], salt="") != h  # "" is a salt, None is none
    assert hash_block_tokens(None, [1, 2, 3, 4], salt="a") != hash_block_tokens(None, [1, 2, 3, 4], salt="b")


def test_hash_full_blocks_skips_partial_block_and_continues_a_chain():
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    assert hash_full_blocks(list(range(12)), 4, parent_hashes=hashes)[:2] == hashes
    assert hash_full_blocks(list(range(12)), 4, parent_hashes=hashes) == hash_full_blocks(list(range(12)), 4)


# ---- allocation -------------------------------------------------------------------
def test_fresh_pool_counts_and_allocation_order():
    p = pool(num_blocks=5)
    assert (p.num_usable_blocks, p.num_free_blocks, p.num_used_blocks, p.usage) == (4, 4, 0, 0.0)
    assert p.get_new_blocks(2) == [1, 2]
    assert (p.ref_count(1), p.ref_count(2), p.ref_count(3)) == (1, 1, 0)
    assert (p.num_free_blocks, p.num_used_blocks, p.usage) == (2, 2, 0.5)
    assert p.get_new_blocks(0) == []
    assert p.get_new_blocks(2) == [3, 4]
    assert p.usage == 1.0


def test_not_enough_blocks_returns_none_and_changes_nothing():
    p = pool(num_blocks=5)
    p.get_new_blocks(3)
    assert p.get_new_blocks(2) is None
    assert p.num_free_blocks == 1
    assert p.get_new_blocks(1) == [4]
    assert p.get_new_blocks(1) is None


def test_pad_block_is_never_handed_out():
    p = pool(num_blocks=3)
    assert p.get_new_blocks(2) == [1, 2]
    assert p.get_new_blocks(1) is None  # block 0 exists but is never handed out
    p.free_blocks([2, 1])
    assert p.get_new_blocks(2) == [2, 1]


def test_freed_plain_blocks_are_reused_fifo_after_never_used_ones():
    p = pool(num_blocks=6)
    assert p.get_new_blocks(3) == [1, 2, 3]
    p.free_blocks([3, 1])
    assert p.get_new_blocks(4) == [4, 5, 3, 1]


def test_ref_counts_go_down_one_per_free():
    p, ids, h = cached_pool(1)
    p.touch(ids)
    assert p.ref_count(1) == 2
    p.free_blocks([1])
    assert (p.ref_count(1), p.num_free_blocks, p.num_evictable_blocks) == (1, 3, 0)
    p.free_blocks([1])
    assert (p.ref_count(1), p.num_free_blocks, p.num_evictable_blocks) == (0, 4, 1)


# ---- prefix cache -------------------------------------------------------------------
def test_cache_and_lookup_longest_prefix_with_stats():
    p, ids, h = cached_pool(2)
    assert ids == [1, 2]
    assert p.block_hash(1) == h[0] and p.block_hash(2) == h[1]
    assert p.get_cached_block(h[1]) == 2
    assert p.lookup(h) == [1, 2]
    other = hash_block_tokens(None, [9, 9, 9, 9])
    assert p.lookup([h[0], other, h[1]]) == [1]  # stops at the first miss
    assert p.lookup([other]) == []
    assert p.stats == PrefixCacheStats(queries=6, hits=3, evictions=0)
    assert p.stats.hit_rate == 0.5
    p.reset_stats()
    assert p.stats == PrefixCacheStats(0, 0, 0) and p.stats.hit_rate == 0.0


def test_freed_cached_blocks_stay_hittable_and_touch_revives_them():
    p, ids, h = cached_pool(2)
    p.free_blocks([2, 1])
    assert (p.num_free_blocks, p.num_evictable_blocks, p.num_used_blocks) == (4, 2, 0)
    assert p.lookup(h) == [1, 2]
    p.touch([1, 2])
    assert (p.ref_count(1), p.ref_count(2)) == (1, 1)
    assert (p.num_free_blocks, p.num_evictable_blocks, p.num_used_blocks) == (2, 0, 2)


def test_uncached_free_blocks_go_before_any_eviction_then_lru():
    p, ids, h = cached_pool(3)  # blocks 1, 2, 3 cached; block 4 never used
    p.free_blocks([3, 1, 2])  # release order 3, 1, 2: 3 is least recently released
    assert p.get_new_blocks(1) == [4]
    assert p.lookup(h) == [1, 2, 3] and p.stats.evictions == 0
    assert p.get_new_blocks(2) == [3, 1]
    assert (p.block_hash(3), p.block_hash(1)) == (None, None)
    assert p.get_cached_block(h[0]) is None and p.get_cached_block(h[2]) is None
    assert p.get_cached_block(h[1]) == 2
    assert p.stats.evictions == 2
    assert p.lookup(h) == []  # first block gone: the chain misses at once


def test_touch_moves_a_block_to_the_back_of_the_eviction_queue():
    p, ids, h = cached_pool(3)
    p.free_blocks([1, 2, 3])
    p.touch([1])
    p.free_blocks([1])
    assert p.get_new_blocks(4) == [4, 2, 3, 1]


def test_duplicate_key_keeps_the_first_block_cached():
    p, ids, h = cached_pool(1)
    (dup,) = p.get_new_blocks(1)
    assert p.cache_full_blocks([dup], [h[0]]) == 0
    assert p.block_hash(dup) is None and p.get_cached_block(h[0]) == 1
    assert p.cache_full_blocks([1], [h[0]]) == 0  # same block, same key: no-op
    p.free_blocks([dup])
    assert p.num_evictable_blocks == 0  # the uncached duplicate is plain free


def test_disabled_prefix_caching_stores_nothing_and_counts_nothing():
    p = pool(caching=False)
    ids = p.get_new_blocks(2)
    assert p.cache_full_blocks(ids, keys(2)) == 0
    assert p.block_hash(1) is None
    assert p.lookup(keys(2)) == []
    assert p.stats == PrefixCacheStats(0, 0, 0)
    p.free_blocks(ids)
    assert p.num_evictable_blocks == 0


def test_reset_prefix_cache_only_when_nothing_is_held():
    p, ids, h = cached_pool(2)
    assert p.reset_prefix_cache() is False
    p.free_blocks([2, 1])
    assert p.reset_prefix_cache() is True
    assert p.lookup(h) == [] and p.num_evictable_blocks == 0 and p.num_free_blocks == 4


# ---- misuse ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_blocks,block_size", [(1, 4), (0, 4), (4, 0), (4, -1), (4.0, 4)])
def test_bad_pool_config_raises(num_blocks, block_size):
    with pytest.raises(ConfigError):
        BlockPool(num_blocks, block_size)


def test_double_free_raises_and_changes_nothing():
    p = pool()
    p.get_new_blocks(2)
    p.free_blocks([1])
    with pytest.raises(KVCacheError, match="block 1"):
        p.free_blocks([1])
    with pytest.raises(KVCacheError, match="block 2"):
        p.free_blocks([2, 2])
    assert p.ref_count(2) == 1  # the valid first half was not applied
    with pytest.raises(KVCacheError):
        p.free_blocks([2, 1])
    assert p.ref_count(2) == 1


@pytest.mark.parametrize("bad", [PAD_BLOCK_ID, -1, 5, 99])
def test_bad_block_ids_raise(bad):
    p = pool(num_blocks=5)
    p.get_new_blocks(4)
    for call in (lambda: p.free_blocks([bad]), lambda: p.touch([bad]), lambda: p.ref_count(bad)):
        with pytest.raises(KVCacheError):
            call()


def test_touching_a_plain_free_block_raises():
    p = pool()
    with pytest.raises(KVCacheError, match="block 1"):
        p.touch([1])
    assert p.ref_count(1) == 0


def test_cache_full_blocks_misuse_raises():
    p = pool()
    h = keys(2)
    with pytest.raises(KVCacheError, match="not held"):
        p.cache_full_blocks([1], [h[0]])
    p.get_new_blocks(1)
    p.cache_full_blocks([1], [h[0]])
    with pytest.raises(KVCacheError, match="another key"):
        p.cache_full_blocks([1], [h[1]])
    with pytest.raises(KVCacheError):
        p.cache_full_blocks([1], [])
    with pytest.raises(KVCacheError):
        p.get_new_blocks(-1)


def test_errors_are_kvexport_errors():
    assert issubclass(KVCacheError, KvExportError)
