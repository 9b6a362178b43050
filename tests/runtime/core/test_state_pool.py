"""The state pool of hybrid builds (runtime/core/state_pool.py): running slots and checkpoint slots
by exact number, admission that needs a state slot, prefix hits cut back to the nearest checkpoint,
prompt chunks cut at checkpoint boundaries, checkpoints offered only once their step completed, and the
runtime's state store copying slots (runtime/execution/state_store.py). Real BlockPool and
KVCacheManager; no model (the end-to-end checks are tests/exporter/test_qwen3_5.py)."""

import numpy as np
import pytest

from kvexport import io
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.core.block_hash import hash_full_blocks
from kvexport.runtime.core.block_pool import BlockPool
from kvexport.runtime.core.kv_cache_manager import KVCacheManager
from kvexport.runtime.core.state_pool import StatefulKVCacheManager, StatePool, StateStep, clip_chunk, refusal
from kvexport.runtime.execution.state_store import StateStore, restore_checkpoints, save_checkpoints


def manager(blocks=32, slots=2, checkpoints=2, every=2):
    return StatefulKVCacheManager(KVCacheManager(BlockPool(blocks, 4, enable_prefix_caching=True)),
                                  StatePool(slots, checkpoints), every)


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
    assert kv.step("b", 0, 5, list(range(5)), 5) == StateStep(0)


def test_chunks_end_on_checkpoint_boundaries_inside_the_prompt():
    kv = manager(every=2)  # 8 tokens
    assert kv.clip(0, 20, 30) == 8 and kv.clip(8, 20, 30) == 8 and kv.clip(3, 4, 30) == 4
    assert kv.clip(24, 20, 30) == 20  # no boundary before the prompt's end
    assert kv.clip(30, 1, 30) == 1  # decoding
    assert clip_chunk(KVCacheManager(BlockPool(8, 4)), 0, 20, 30) == 20  # not a hybrid


def test_a_prefix_resumes_from_the_nearest_published_checkpoint():
    kv = manager(every=2)
    prompt = list(range(10, 40))  # 30 tokens
    assert kv.get_computed_blocks(prompt).num_computed_tokens == 0
    kv.allocate_slots("a", 8, kv.get_computed_blocks(prompt))
    first = kv.step("a", 0, 8, prompt, 30)
    assert first.slot == 0 and first.restore_from is None and first.save_to == 2  # checkpoints after the 2 running
    # not yet completed: not offered
    kv.cache_blocks("a", prompt, 0)
    assert kv.state.lookup(hash_full_blocks(prompt[:8], 4)[-1]) is None
    kv.cache_blocks("a", prompt, 8)
    kv.allocate_slots("a", 8)
    assert kv.step("a", 8, 8, prompt, 30).save_to == 3
    kv.cache_blocks("a", prompt, 16)
    assert kv.state.saved == 2
    # another prompt sharing 18 tokens: KV hits 4 blocks (16 tokens), the checkpoint at 16 is there
    other = prompt[:18] + [99] * 6
    hit = kv.get_computed_blocks(other)
    assert hit.num_computed_tokens == 16 and len(hit.block_ids) == 4
    kv.allocate_slots("b", 8, hit)
    # its chunk ends on the boundary at 24: a checkpoint for it, evicting the least recently used (at 8)
    assert kv.step("b", 16, 8, other, 24) == StateStep(1, restore_from=3, save_to=2)
    assert kv.state.hits == 1
    # a third sequence finds no running slot left; "a" finishing frees one
    assert kv.allocate_slots("c", 4, kv.get_computed_blocks(other)) is None
    kv.free("a")
    assert kv.allocate_slots("c", 4, kv.get_computed_blocks(other)) is not None
    kv.free("b")  # its pending checkpoint (never completed) goes back to the free list
    assert kv.state._ckpt_free == [2]


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
