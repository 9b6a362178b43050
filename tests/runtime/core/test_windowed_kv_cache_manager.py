"""WindowedKVCacheManager: two KV cache groups (full-attention layers, windowed layers) with
exact block ids; the windowed group releases blocks behind the window while the full group
keeps them; allocation in both or neither; prefix hits across both; the budget split and the
bytes a long sequence holds. block_size 4, window 8 unless said; fresh pools hand out
blocks 1, 2, 3, ..."""

import pytest

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.io import PAD_BLOCK_ID as PAD
from kvexport.runtime.core.block_pool import BlockPool
from kvexport.runtime.core.windowed_kv_cache_manager import (WindowedKVCacheManager, windowed_manager, local_blocks_needed,
                                                      split_budget)

BS, W = 4, 8


def manager(full=17, local=9, caching=True) -> WindowedKVCacheManager:
    return WindowedKVCacheManager(BlockPool(full, BS, caching), BlockPool(local, BS, caching), W)


def step(m: WindowedKVCacheManager, rid: str, tokens: list[int], done: int, n: int) -> None:
    """What the scheduler does around one step of `n` tokens of a request with `done` stored."""
    if done == 0:
        computed = m.get_computed_blocks(tokens)
        assert m.allocate_slots(rid, n - computed.num_computed_tokens, computed) is not None
    else:
        assert m.allocate_slots(rid, done + n - m.num_slots(rid)) is not None
    m.cache_blocks(rid, tokens, done + n)
    m.free_outside_window(rid, done + n, W)


def test_windowed_group_releases_blocks_the_full_group_keeps():
    m = manager()
    tokens = list(range(100, 124))  # 24 tokens = 6 blocks
    step(m, "a", tokens, 0, 8)  # chunk 1: positions 0..7; the next token (8) sees 1..8: block 0 stays
    assert m.block_table("a") == [1, 2] and m.local.block_table("a") == [1, 2]
    step(m, "a", tokens, 8, 8)  # positions 8..15; the next token (16) sees 9..16: block 0 (0..3), 1 (4..7) go
    assert m.block_table("a") == [1, 2, 3, 4]
    assert m.local.block_table("a") == [PAD, PAD, 3, 4]
    assert m.local_pool.ref_count(3) == 1 and m.local_pool.num_used_blocks == 2  # 1 and 2 released
    assert [m.pool.ref_count(b) for b in (1, 2, 3, 4)] == [1, 1, 1, 1]  # the full group keeps them
    assert m.allocate_slots("a", 1) == [5]  # position 16 opens block 4 in both groups
    assert m.local.block_table("a") == [PAD, PAD, 3, 4, 5]
    assert m.extra_groups("a", 16, 1)[0].block_table == (PAD, PAD, 3, 4, 5)
    assert m.extra_groups("a", 16, 1)[0].slot_mapping == (5 * BS + 0,)
    assert m.slot_mapping("a", 16, 1) == [5 * BS + 0]
    assert m.pool.num_used_blocks == 5 and m.local_pool.num_used_blocks == 3
    m.cache_blocks("a", tokens, 17)
    m.free_outside_window("a", 17, W)  # the next token (17) sees 10..17: block 2 (8..11) stays
    assert m.local.block_table("a") == [PAD, PAD, 3, 4, 5]
    assert m.allocate_slots("a", 3) == []
    m.cache_blocks("a", tokens, 20)
    m.free_outside_window("a", 20, W)  # the next token (20) sees 13..20: block 2 goes
    assert m.local.block_table("a") == [PAD, PAD, PAD, 4, 5] and m.block_table("a") == [1, 2, 3, 4, 5]
    m.free("a")
    assert m.pool.num_used_blocks == 0 and m.local_pool.num_used_blocks == 0


def test_allocation_takes_both_groups_or_neither():
    m = manager(full=17, local=4)  # 3 usable local blocks: a sequence's window + next block
    step(m, "a", list(range(12)), 0, 12)  # 3 blocks; the next token (12) sees 5..12: block 0 goes
    assert m.local.block_table("a") == [PAD, 2, 3] and m.local_pool.num_free_blocks == 1
    full_before, local_before = m.pool.num_free_blocks, m.local_pool.num_free_blocks
    # a second request of 8 tokens needs 2 local blocks, 1 is free: None, and nothing changed
    assert m.allocate_slots("b", 8, m.get_computed_blocks(list(range(50, 58)))) is None
    assert "b" not in m and m.pool.num_free_blocks == full_before and m.local_pool.num_free_blocks == local_before
    assert m.allocate_slots("b", 4, m.get_computed_blocks(list(range(50, 54)))) == [4]
    assert m.local.block_table("b") == [1]
    assert m.allocate_slots("a", 1) is None  # position 12 needs a local block: none left
    assert m.block_table("a") == [1, 2, 3] and m.num_slots("a") == 12


def test_prefix_hit_needs_the_windowed_groups_blocks_in_the_window():
    m = manager()
    prefix = list(range(200, 217))  # 17 tokens: 4 full blocks
    step(m, "a", prefix + [1], 0, 18)
    m.free("a")  # every block evictable, cached under its key in both groups
    hit = m.get_computed_blocks(prefix + [2, 3])
    assert hit.num_computed_tokens == 16
    assert hit.full.block_ids == (1, 2, 3, 4)
    # token 16 sees positions 9..16: local blocks 2 (8..11) and 3 (12..15); 0 and 1 stay released
    assert hit.local.block_ids == (PAD, PAD, 3, 4)
    assert m.allocate_slots("b", 3, hit) == [6]
    assert m.local.block_table("b") == [PAD, PAD, 3, 4, 6]
    assert m.pool.stats.hits == 4
    m.free("b")
    # the local block holding positions 12..15 is gone (evicted for other requests): no hit that far
    m.local_pool.get_new_blocks(m.local_pool.num_free_blocks)  # evicts every cached local block
    assert m.get_computed_blocks(prefix + [2]).num_computed_tokens == 0


def test_budget_split_by_need():
    # 2 full-attention and 6 windowed layers' bytes per token, window 8, 2 sequences, 8-token steps
    need = local_blocks_needed(W, BS, 2, 8)
    assert need == 1 + 2 * (2 + 1) + 2
    sizes = split_budget(100 * BS * 80, BS, 20, 60, W, 2, 8)
    assert sizes.local_blocks == need and sizes.full_blocks == (100 * BS * 80 - need * BS * 60) // (BS * 20)
    assert sizes.bytes <= 100 * BS * 80
    small = split_budget(12 * BS * 80, BS, 20, 60, W, 64, 8)  # less than the local group wants: even split
    assert small.full_blocks == small.local_blocks == 12
    with pytest.raises(ConfigError, match="raise kv_cache_memory"):
        split_budget(4 * BS * 80, BS, 20, 60, W, 64, 8)


def test_held_bytes_follow_global_context_plus_local_window():
    """A Gemma-3-1b-shaped model (26 layers: 22 windowed, 4 full; 1 KV head of 256, fp16 KV;
    window 1024) holding one 8192-token sequence: the bytes its blocks take are those of the 4
    full layers over 8192 tokens plus the 22 windowed layers over the window, rounded to whole
    blocks, not all 26 layers over 8192."""
    bs, window, ctx = 16, 1024, 8192
    groups = (io.LOCAL_GROUP,) * 5 + (io.FULL_GROUP,) + (io.LOCAL_GROUP,) * 5 + (io.FULL_GROUP,) + \
        (io.LOCAL_GROUP,) * 5 + (io.FULL_GROUP,) + (io.LOCAL_GROUP,) * 5 + (io.FULL_GROUP,) + (io.LOCAL_GROUP,) * 2
    per_token = io.kv_bytes_per_token_by_group(groups, 1, 256, io.DType.FP16)
    assert per_token == {io.LOCAL_GROUP: 2 * 22 * 256 * 2, io.FULL_GROUP: 2 * 4 * 256 * 2}
    m, sizes = windowed_manager(2 ** 30, bs, per_token[io.FULL_GROUP], per_token[io.LOCAL_GROUP], window,
                              max_num_seqs=8, max_num_batched_tokens=512)
    done = 0
    while done < ctx:  # 512-token prefill chunks, then the window's release after each
        n = min(512, ctx - done)
        assert m.allocate_slots("a", n, m.get_computed_blocks([]) if done == 0 else None) is not None
        done += n
        m.free_outside_window("a", done, window)
    held = m.held_bytes("a", sizes.full_bytes_per_block, sizes.local_bytes_per_block)
    # the next token (8192) sees 7169..8192: blocks 448..511 hold 7168..8191
    full_blocks, local_blocks = ctx // bs, ctx // bs - (ctx - window + 1) // bs
    assert (full_blocks, local_blocks) == (512, 64)
    assert held == full_blocks * sizes.full_bytes_per_block + local_blocks * sizes.local_bytes_per_block
    all_layers = ctx * (per_token[io.FULL_GROUP] + per_token[io.LOCAL_GROUP])
    assert held == ctx * per_token[io.FULL_GROUP] + window * per_token[io.LOCAL_GROUP]  # block-aligned here
    assert (held, all_layers) == (54 * 2 ** 20, 208 * 2 ** 20)
    assert m.allocate_slots("a", 1) is not None  # the next token's block: one more local block until released
    held_next = m.held_bytes("a", sizes.full_bytes_per_block, sizes.local_bytes_per_block)
    assert held_next == held + sizes.full_bytes_per_block + sizes.local_bytes_per_block
