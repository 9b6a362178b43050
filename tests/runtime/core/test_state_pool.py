"""The state pool of hybrid builds (runtime/core/state_pool.py, through the KV cache coordinator's
recurrent-state spec: core/state_manager.py, core/kv_cache_coordinator.py): running slots and checkpoint slots
by exact number, admission that needs a state slot, prefix hits cut back to the nearest checkpoint,
prompt chunks cut at checkpoint boundaries, checkpoints offered only once their step completed, and the
runtime's state store copying slots (runtime/execution/state_store.py). Real BlockPool and
KVCacheManager; no model (the end-to-end checks are tests/exporter/test_qwen3_5.py)."""

from types import SimpleNamespace

import numpy as np
import pytest

from kvexport import io
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.core.block_hash import hash_full_blocks
from kvexport.runtime.core.block_pool import BlockPool
from kvexport.runtime.core.kv_cache_manager import KVCacheManager
from kvexport.runtime.core.kv_tiers import DISK, HOST, STAGED, TierEvents, TierIndex
from kvexport.runtime.core.kv_cache_coordinator import coordinator_for
from kvexport.runtime.core.state_pool import StatePool, StateStep, refusal
from kvexport.runtime.execution.state_store import StateStore, restore_checkpoints, save_checkpoints


def _settings(slots, checkpoints, every):
    """The engine settings coordinator_for reads (EngineConfig's names)."""
    return SimpleNamespace(max_num_seqs=slots, state_checkpoints=checkpoints, state_checkpoint_blocks=every,
                           enable_prefix_caching=True, kv_eviction="none", speculative="none")


HYBRID = {"linear_attn": {}}  # a manifest model spec with linear-attention layers


def manager(blocks=32, slots=2, checkpoints=2, every=2):
    return coordinator_for(KVCacheManager(BlockPool(blocks, 4, enable_prefix_caching=True)), HYBRID,
                           _settings(slots, checkpoints, every))


def test_slots_are_handed_out_and_returned():
    pool = StatePool(2, 3)
    assert pool.total_slots == 5
    assert (pool.allocate("a"), pool.allocate("b"), pool.allocate("c")) == (0, 1, None)
    assert pool.allocate("a") == 0  # the same slot while running
    pool.free("a")
    assert pool.allocate("c") == 0 and "a" not in pool
    with pytest.raises(Exception, match="running slot"):
        StatePool(0)


def test_admission_needs_a_state_slot():
    kv = manager(slots=1)
    assert kv.allocate_slots("a", 5, kv.get_computed_blocks(list(range(5)))) is not None
    # a second sequence: blocks free, but no state slot -> None (the scheduler waits), nothing held
    assert kv.allocate_slots("b", 5, kv.get_computed_blocks(list(range(5)))) is None
    assert "b" not in kv and kv.pool.num_used_blocks == 2
    kv.free("a")
    assert kv.allocate_slots("b", 5, kv.get_computed_blocks(list(range(5)))) is not None
    assert kv.state_step("b", 0, 5, list(range(5)), 5) == StateStep(0)


def test_chunks_end_on_checkpoint_boundaries_inside_the_prompt():
    kv = manager(every=2)  # 8 tokens
    assert kv.clip_chunk(0, 20, 30) == 8 and kv.clip_chunk(8, 20, 30) == 8 and kv.clip_chunk(3, 4, 30) == 4
    assert kv.clip_chunk(24, 20, 30) == 4  # the prompt's last block boundary (28) is a checkpoint too
    assert kv.clip_chunk(28, 20, 30) == 20 and kv.clip_chunk(28, 20, 32) == 20  # no boundary before the prompt's end
    # a prompt of whole blocks (32): also the last boundary its own lookup can hit (28: it leaves a token)
    assert kv.clip_chunk(24, 20, 32) == 4
    assert kv.clip_chunk(30, 1, 30) == 1  # decoding
    assert KVCacheManager(BlockPool(8, 4)).clip_chunk(0, 20, 30) == 20  # not a hybrid


def test_a_prefix_resumes_from_the_nearest_published_checkpoint():
    kv = manager(every=2)
    prompt = list(range(10, 40))  # 30 tokens
    assert kv.get_computed_blocks(prompt).num_computed_tokens == 0
    kv.allocate_slots("a", 8, kv.get_computed_blocks(prompt))
    first = kv.state_step("a", 0, 8, prompt, 30)
    assert first.slot == 0 and first.restore_from is None and first.save_to == 2  # checkpoints after the 2 running
    # not yet completed: not offered
    kv.cache_blocks("a", prompt, 0)
    assert kv.state.lookup(hash_full_blocks(prompt[:8], 4)[-1]) is None
    kv.cache_blocks("a", prompt, 8)
    kv.allocate_slots("a", 8)
    assert kv.state_step("a", 8, 8, prompt, 30).save_to == 3
    kv.cache_blocks("a", prompt, 16)
    assert kv.state.saved == 2
    # another prompt sharing 18 tokens: KV hits 4 blocks (16 tokens), the checkpoint at 16 is there
    other = prompt[:18] + [99] * 6
    hit = kv.get_computed_blocks(other)
    assert hit.num_computed_tokens == 16 and len(hit.block_ids) == 4
    kv.allocate_slots("b", 8, hit)
    # its chunk ends on the boundary at 24: a checkpoint for it, evicting the least recently used (at 8)
    assert kv.state_step("b", 16, 8, other, 24) == StateStep(1, restore_from=3, save_to=2)
    assert kv.state.hits == 1
    # a third sequence finds no running slot left; "a" finishing frees one
    assert kv.allocate_slots("c", 4, kv.get_computed_blocks(other)) is None
    kv.free("a")
    assert kv.allocate_slots("c", 4, kv.get_computed_blocks(other)) is not None
    kv.free("b")  # its pending checkpoint (never completed) goes back to the free list
    assert kv.state._ckpt_free == [2]


def test_decode_keeps_one_moving_checkpoint_that_the_next_turn_resumes_from():
    """Decode saves at each block boundary it crosses, replacing the sequence's previous decode checkpoint;
    the last one outlives the sequence, so a follow-up prompt (this prompt + its answer + more) resumes at
    the answer's last full block, where an attention model's KV hit would end too."""
    kv = manager(slots=1, checkpoints=4, every=4)  # 16-token interval: the 10-token prompt has none inside
    prompt = list(range(50, 60))
    kv.allocate_slots("a", 10, kv.get_computed_blocks(prompt))
    assert kv.clip_chunk(0, 10, 10) == 8 and kv.state_step("a", 0, 8, prompt, 10).save_to == 1  # the prompt's last boundary
    kv.cache_blocks("a", prompt, 8)
    kv.allocate_slots("a", 2)
    assert kv.state_step("a", 8, 2, prompt, 10).save_to is None
    kv.cache_blocks("a", prompt, 10)
    tokens = list(prompt)
    saves = []
    for t in range(10, 21):  # decode: tokens 10..20 computed one at a time
        tokens.append(100 + t)
        kv.allocate_slots("a", 1)
        saves.append(kv.state_step("a", t, 1, tokens, 10).save_to)
        kv.cache_blocks("a", tokens, t + 1)
    assert saves == [None, 2, None, None, None, 2, None, None, None, 2, None]  # at 12, 16, 20: one slot, reused
    assert sorted(kv.state._ckpt.values()) == [1, 2] and kv.state.saved == 4
    kv.free("a")
    follow = tokens + [7] * 9  # the next turn: history (20 tokens computed) + a new message
    hit = kv.get_computed_blocks(follow)
    assert hit.num_computed_tokens == 20
    kv.allocate_slots("b", 9, hit)
    assert kv.state_step("b", 20, 8, follow, 29).restore_from == 2


def test_a_kv_hit_past_the_checkpoint_saves_one_where_it_ends():
    """A second prompt sharing 12 tokens (3 blocks) with a cached one finds no checkpoint there (interval 16
    tokens): it recomputes from 0, its chunk is cut where the KV hit ended and saves a checkpoint there, so a
    third prompt with that prefix resumes at 12 tokens."""
    kv = manager(slots=2, checkpoints=4, every=4)
    shared = list(range(60, 72))
    a = shared + [1, 2, 3, 4, 5, 6]
    kv.allocate_slots("a", 18, kv.get_computed_blocks(a))
    assert kv.state_step("a", 0, 16, a, 18).save_to is not None  # the interval (16), also a's last block boundary
    kv.cache_blocks("a", a, 18)
    kv.free("a")
    b = shared + [9, 9, 9, 9, 9]
    hit = kv.get_computed_blocks(b)
    assert hit.num_computed_tokens == 0  # no checkpoint at 12: no hit
    assert kv.clip_chunk(0, 17, 17, "b") == 12
    kv.allocate_slots("b", 12, hit)
    assert kv.state_step("b", 0, 12, b, 17).save_to is not None
    kv.cache_blocks("b", b, 12)
    c = shared + [8, 8, 8, 8, 8]
    assert kv.get_computed_blocks(c).num_computed_tokens == 12


def test_checkpoints_evict_least_recently_used():
    pool = StatePool(1, 2)
    keys = [hash_full_blocks([i] * 4, 4)[-1] for i in range(3)]
    pool.allocate("a")
    assert [pool.reserve_checkpoint("a", 4 * (i + 1), k) for i, k in enumerate(keys[:2])] == [1, 2]
    pool.publish("a", 8)
    assert pool.lookup(keys[0]) == 1  # now the most recently used
    assert pool.reserve_checkpoint("a", 12, keys[2]) == 2  # evicts keys[1]
    pool.publish("a", 12)
    assert pool.lookup(keys[1]) is None and pool.lookup(keys[2]) == 2
    assert pool.reserve_checkpoint("a", 12, keys[2]) is None  # held already


def test_state_store_copies_slots_and_grows():
    dims = io.StateDims(conv_width=3, conv_dim=5, num_v_heads=2, k_head_dim=3, v_head_dim=4)
    store = StateStore(2, dims, num_slots=2)
    assert [p.shape for p in store.pools] == [(2, 3, 5), (2, 2, 3, 4)] * 2
    assert store.bytes_per_slot == io.state_bytes_per_sequence(2, dims) == 2 * (15 + 24) * 4
    feeds = store.feeds(np.array([0, 3], np.int64))  # slot 3: the arrays grow
    assert store.num_slots >= 4 and list(feeds) == [io.STATE_SLOTS] + io.state_names(2)
    store.store(np.array([0, 3], np.int64), [np.full((2, *p.shape[1:]), float(i + 1), np.float32)
                                             for i, p in enumerate(store.pools)])
    chunk = type("C", (), {"request_id": "r", "state": StateStep(3, restore_from=None, save_to=1)})()
    save_checkpoints(store, [chunk], failed={})
    assert all((p[1] == i + 1).all() for i, p in enumerate(store.pools))
    save_checkpoints(store, [chunk], failed={"r": "boom"})  # a failed chunk saves nothing
    back = type("C", (), {"request_id": "s", "state": StateStep(2, restore_from=1)})()
    restore_checkpoints(store, [back])
    assert all((p[2] == i + 1).all() for i, p in enumerate(store.pools))


def test_engine_features_a_hybrid_cannot_carry_are_named():
    assert refusal(EngineConfig()) is None
    assert "kv_eviction 'snapkv'" in refusal(EngineConfig(kv_eviction="snapkv", kv_budget_tokens=64))
    assert "speculative 'ngram'" in refusal(EngineConfig(speculative="ngram"))
    # the KV tiers carry state checkpoints (tests/runtime/test_hybrid_tiers.py)
    assert refusal(EngineConfig(kv_offload_memory="1MiB", kv_offload_dir="/tmp/x")) is None


def tiered(blocks=32, slots=1, checkpoints=1, every=1, host=1 << 20, disk=0):
    """A hybrid's manager with KV tiers below it (checkpoints are io.STATE_GROUP "blocks" of 100 bytes)."""
    tiers = TierIndex({io.FULL_GROUP: 10, io.STATE_GROUP: 100}, host, disk)
    return coordinator_for(KVCacheManager(BlockPool(blocks, 4, enable_prefix_caching=True), tiers), HYBRID,
                           _settings(slots, checkpoints, every)), tiers


def _prompt_done(kv, rid, prompt):
    """Admit `prompt`, run it in chunks as the scheduler would (saving its checkpoints), and finish it."""
    start = kv.get_computed_blocks(prompt).num_computed_tokens
    kv.allocate_slots(rid, kv.clip_chunk(start, len(prompt), len(prompt), rid), kv.get_computed_blocks(prompt))
    while start < len(prompt):
        n = kv.clip_chunk(start, len(prompt) - start, len(prompt), rid)
        if kv.num_slots(rid) < start + n:
            kv.allocate_slots(rid, start + n - kv.num_slots(rid))
        kv.state_step(rid, start, n, prompt, len(prompt))
        start += n
        kv.cache_blocks(rid, prompt, start)
    kv.free(rid)


def test_an_evicted_checkpoint_goes_to_the_host_tier_and_resumes_from_there():
    kv, tiers = tiered(checkpoints=1)
    a, b = list(range(10, 19)), list(range(40, 49))  # 9 tokens: checkpoints at 4 and 8 (every block)
    _prompt_done(kv, "a", a)
    ops = tiers.take_ops()  # a's checkpoint at 4 was evicted for its checkpoint at 8 (one slot): saved first
    assert [(type(o).__name__, o.group, o.block_id) for o in ops] == [("SaveBlock", io.STATE_GROUP, 1)]
    _prompt_done(kv, "b", b)  # b's checkpoints push a's last one out too
    tiers.take_ops()
    assert not kv.state.has(hash_full_blocks(a[:8], 4)[-1])
    hit = kv.get_computed_blocks(a)
    assert hit.num_computed_tokens == 8  # KV in the pool, the state after it in the host tier
    kv.allocate_slots("a2", 1, hit)
    load = [o for o in tiers.take_ops() if type(o).__name__ == "LoadBlock"]
    # loaded straight into the request's running slot (no restore from a checkpoint slot)
    assert [(o.group, o.block_id, o.tier) for o in load] == [(io.STATE_GROUP, 0, HOST)]
    assert kv.state_step("a2", 8, 1, a, 9) == StateStep(0) and kv.state.tier_hits == 1


def test_a_checkpoint_on_disk_is_read_before_the_request_is_admitted():
    kv, tiers = tiered(checkpoints=1, host=0, disk=1 << 20)
    a = list(range(10, 19))
    _prompt_done(kv, "a", a)
    _prompt_done(kv, "b", list(range(40, 49)))
    tiers.take_ops()
    key = (io.STATE_GROUP, hash_full_blocks(a[:8], 4)[-1])
    hit = kv.get_computed_blocks(a)
    assert hit.num_computed_tokens == 8 and tiers.where(key) == DISK
    assert kv.prefetch_tier_hits(hit) is True  # waits: the checkpoint is read off the step
    assert [type(o).__name__ for o in tiers.take_ops()] == ["Prefetch"]
    tiers.apply(TierEvents(prefetched=(key,)))
    hit = kv.get_computed_blocks(a)
    assert kv.prefetch_tier_hits(hit) is False and kv.allocate_slots("a2", 1, hit) is not None
    assert [(type(o).__name__, o.tier) for o in tiers.take_ops()] == [("LoadBlock", STAGED)]
    # a read that failed: that checkpoint is forgotten, so the hit is cut back to the one before it
    kv.free("a2")
    _prompt_done(kv, "c", list(range(70, 79)))
    _prompt_done(kv, "d", list(range(80, 89)))
    tiers.apply(TierEvents(failed=((io.STATE_GROUP, hash_full_blocks(list(range(70, 78)), 4)[-1]),)))
    assert kv.get_computed_blocks(list(range(70, 79))).num_computed_tokens == 4  # the earlier one, at 4, on disk


def test_checkpoints_handed_over_are_pinned_until_released():
    """The connector's view (CheckpointPool): slots taken, written, published and pinned; a pinned
    checkpoint is never evicted for a new one; released, it is evictable again."""
    kv = manager(slots=1, checkpoints=2)
    pool = kv.checkpoints
    assert pool.num_free_blocks == 2
    slots = pool.get_new_blocks(2)
    assert sorted(slots) == [1, 2] and pool.get_new_blocks(1) is None
    keys = [b"k1" * 16, b"k2" * 16]
    assert pool.cache_full_blocks(slots, keys) == 2 and pool.get_cached_block(keys[0]) == slots[0]
    assert pool.num_free_blocks == 0 and kv.state.take_slot() is None  # both pinned: nothing to evict
    pool.free_blocks(slots[:1])
    assert pool.num_free_blocks == 1 and kv.state.take_slot() == slots[0]  # the released one goes first
    unused = pool.get_new_blocks(1)  # (none free now: the pinned one stays)
    assert unused is None
    pool.free_blocks(slots[1:])
    assert pool.cached_blocks() == [(slots[1], keys[1])]




def test_a_checkpoint_whose_blocks_are_gone_is_not_copied_to_a_tier():
    """A checkpoint is copied to a tier only while the block it ends is held somewhere (the pool, a tier):
    without it the checkpoint is no hit, and the copy would be wasted."""
    kv, tiers = tiered(checkpoints=1)

    def saved():
        return [o.block_hash for o in tiers.take_ops() if o.group == io.STATE_GROUP and type(o).__name__ == "SaveBlock"]

    a, b = list(range(10, 19)), list(range(40, 49))
    _prompt_done(kv, "a", a)
    assert saved() == [hash_full_blocks(a[:4], 4)[-1]]  # evicted for a's next one, its block still cached
    assert kv.pool.reset_prefix_cache()  # a's KV gone from the pool, never offered to the tier
    _prompt_done(kv, "b", b)  # b's first checkpoint evicts a's last one: not copied
    assert saved() == [hash_full_blocks(b[:4], 4)[-1]]
