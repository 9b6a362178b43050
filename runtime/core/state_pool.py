"""The state pool of hybrid models (gated DeltaNet layers: kvexport/io.py "Recurrent state"), the
scheduler's side: numbers, never tensors. Beside the KV block pool it hands out fixed-size STATE
SLOTS: one per running sequence (its linear layers' conv and delta-rule state), plus CHECKPOINT slots
that hold a copy of a sequence's state at a block boundary, keyed by that block's prefix hash
(core/block_hash.py), so a later prompt with the same prefix resumes from the nearest checkpoint
instead of computing its whole prefix again (prefix caching that hits on hybrids).

    StatePool                 slot numbers: running slots by request, checkpoints by block hash (LRU)
    RecurrentStateManager     the recurrent state's spec manager (core/state_manager.py), beside the
                              attention groups' behind the KV cache coordinator (core/kv_cache_coordinator.py):
                              - admission takes a state slot too (none free: like no blocks, None)
                              - prefix hits are cut back to the nearest checkpoint (its state restored
                                into the request's slot before its first chunk)
                              - prompt chunks end at checkpoint boundaries, and a chunk that ends on one
                                saves the state there: every `checkpoint_blocks` blocks, the prompt's last
                                block boundary (and the last one its own lookup can hit), and where the
                                prompt's KV hit ended past its checkpoint (a branch point: a shared system
                                prompt's end); decode keeps one checkpoint per
                                sequence at the last block boundary it crossed (the next chat turn's resume
                                point), so a hybrid hits where an attention model's blocks would
                              - free releases the slot
    StateStep                 what a step's chunk says about state (ScheduledRequest.state): its slot,
                              the checkpoint to restore first, the checkpoint to save after
The model runner carries the copies out on its side (runtime/execution/state_store.py), restores
before the step's compute and saves after it succeeded; a checkpoint is offered to lookups only once
the step that saves it has completed (`cache_blocks`).

Checkpoints move like KV blocks, as the "blocks" of a group of their own (kvexport/io.py
STATE_GROUP; a block id is a checkpoint slot, its key the prefix-cache key of the block it ends):
    KV tiers        a checkpoint capacity evicts is offered to the host / disk tier (core/kv_tiers.py),
                    saved before the step's compute; a lookup takes the furthest block boundary whose
                    checkpoint is in the pool or a tier (with its KV in the pool or a tier), and a tier's
                    checkpoint is loaded straight into the request's running slot (a disk one is read
                    first, the request waiting as for disk KV); the disk tier keeps them across restarts
    the connector   `checkpoints` (CheckpointPool) is the connector's STATE_GROUP pool
                    (core/kv_connector.py): a disaggregated prefill worker offers the prompt's
                    checkpoint with its blocks, the decode worker imports it as a ready checkpoint,
                    pinned until its request is admitted (runtime/serving/dynamo_disagg.py)

NOTE: a checkpoint is reachable only while the KV blocks of its prefix are (pool or tier: the lookup
walks the KV first), so checkpoints go with their blocks; capacity evicts the least recently used.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from kvexport.errors import KvExportError

from .block_hash import BlockHash
from .stats import StateCheckpointStats


@dataclass(frozen=True, slots=True)
class StateStep:
    """One chunk's recurrent state, for the runner (ScheduledRequest.state)."""

    slot: int  # the request's running slot: its linear layers read it and the step's new state goes there
    restore_from: int | None = None  # copy this checkpoint slot into `slot` before the chunk runs
    save_to: int | None = None  # copy `slot` into this checkpoint slot after the chunk ran


class StatePool:
    """Slots 0..num_slots-1 for running sequences, then num_checkpoints checkpoint slots."""

    def __init__(self, num_slots: int, num_checkpoints: int = 0):
        if num_slots < 1 or num_checkpoints < 0:
            raise KvExportError(f"a state pool needs >= 1 running slot and >= 0 checkpoints, got {num_slots} and "
                                f"{num_checkpoints}")
        self.num_slots, self.num_checkpoints = num_slots, num_checkpoints
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest first
        self._by_request: dict[str, int] = {}
        self._ckpt_free = list(range(num_slots + num_checkpoints - 1, num_slots - 1, -1))
        self._ckpt: OrderedDict[BlockHash, int] = OrderedDict()  # ready checkpoints, least recently used first
        self._pending: dict[str, list[tuple[int, BlockHash, int]]] = {}  # request -> (tokens, key, slot) to publish
        self._moving: dict[str, BlockHash] = {}  # request -> its decode checkpoint (replaced at each block boundary)
        self._pinned: set[BlockHash] = set()  # ready checkpoints never evicted until unpinned (a hand-off's)
        self._evicted: list[tuple[int, BlockHash]] | None = None  # (slot, key) evicted, for the KV tiers
        self.hits = self.saved = 0  # checkpoints restored, checkpoints saved (stats)
        self.tier_hits = 0  # checkpoints loaded from a KV tier (host, disk) into a running slot

    def stats(self) -> StateCheckpointStats:
        return StateCheckpointStats(saved=self.saved, hits=self.hits, tier_hits=self.tier_hits)

    @property
    def total_slots(self) -> int:
        """Rows the state arrays need: running and checkpoint slots."""
        return self.num_slots + self.num_checkpoints

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_request

    def allocate(self, request_id: str) -> int | None:
        """The request's running slot (a new one on first call); None when all are taken."""
        if request_id in self._by_request:
            return self._by_request[request_id]
        if not self._free:
            return None
        slot = self._by_request[request_id] = self._free.pop()
        return slot

    def slot(self, request_id: str) -> int:
        return self._by_request[request_id]

    def free(self, request_id: str) -> None:
        """Release the request's slot; its checkpoints not yet published are dropped (its published
        decode checkpoint stays: the next chat turn resumes from it)."""
        slot = self._by_request.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        for _, _, ck in self._pending.pop(request_id, ()):
            self._ckpt_free.append(ck)
        self._moving.pop(request_id, None)

    # ---- checkpoints --------------------------------------------------------------------
    def has(self, key: BlockHash) -> bool:
        """A ready checkpoint exists for the block hash (no LRU touch)."""
        return key in self._ckpt

    def peek(self, key: BlockHash) -> int | None:
        """The ready checkpoint slot of a block hash (no LRU touch), or None."""
        return self._ckpt.get(key)

    @property
    def num_takeable(self) -> int:
        """Checkpoint slots `take_slot` can hand out now: free, or ready and not pinned."""
        return len(self._ckpt_free) + sum(1 for k in self._ckpt if k not in self._pinned)

    def lookup(self, key: BlockHash) -> int | None:
        """The ready checkpoint slot of a block hash (marked recently used), or None."""
        slot = self._ckpt.get(key)
        if slot is not None:
            self._ckpt.move_to_end(key)
        return slot

    def reserve_checkpoint(self, request_id: str, num_tokens: int, key: BlockHash, moving: bool = False) -> int | None:
        """A checkpoint slot for the request's state after `num_tokens` tokens (block hash `key`),
        published by `publish` once those tokens are computed; None: already held, or no slot
        (the least recently used ready checkpoint is evicted for it when none is free). `moving`: the
        request's decode checkpoint, which replaces its previous one (only the furthest is worth keeping).
        NOTE: a slot freed here may be restored from in this very step: restores run before the
        step's compute, saves after it (execution/state_store.py), so the copy still reads the old state."""
        if key in self._ckpt or any(k == key for _, k, _ in self._pending.get(request_id, ())):
            return None
        if moving:
            self._drop(request_id, self._moving.pop(request_id, None))
        slot = self.take_slot()
        if slot is None:
            return None
        self._pending.setdefault(request_id, []).append((num_tokens, key, slot))
        if moving:
            self._moving[request_id] = key
        return slot

    def take_slot(self) -> int | None:
        """A checkpoint slot: a free one, else the least recently used ready checkpoint's that is not
        pinned (evicted: recorded for the KV tiers when `record_evictions` is on); None when there is none."""
        if not self._ckpt_free:
            key = next((k for k in self._ckpt if k not in self._pinned), None)
            if key is None:
                return None
            slot = self._ckpt.pop(key)
            if self._evicted is not None:
                self._evicted.append((slot, key))
            self._ckpt_free.append(slot)
        return self._ckpt_free.pop()

    def give_back(self, slot: int) -> None:
        """A slot `take_slot` handed out and never published returns to the free ones."""
        self._ckpt_free.append(slot)

    def put(self, key: BlockHash, slot: int) -> bool:
        """Offer a slot `take_slot` handed out (now holding the state after `key`'s block, written from
        outside: a disaggregated hand-off) to lookups; False (the slot given back) when the key is
        held already."""
        if key in self._ckpt:
            self.give_back(slot)
            return False
        self._ckpt[key] = slot
        self.saved += 1
        return True

    def pin(self, keys) -> None:
        """Never evict these ready checkpoints until `unpin` (a hand-off's, until its request is admitted)."""
        self._pinned.update(keys)

    def unpin(self, keys) -> None:
        self._pinned.difference_update(keys)

    def ready(self) -> list[tuple[int, BlockHash]]:
        """(slot, key) of every ready checkpoint, least recently used first."""
        return [(slot, key) for key, slot in self._ckpt.items()]

    # ---- the KV tiers' side (core/kv_tiers.py: checkpoints travel as io.STATE_GROUP "blocks") ----
    def record_evictions(self) -> None:
        """From now on, record the ready checkpoints capacity evicts, for `pop_evicted`."""
        if self._evicted is None:
            self._evicted = []

    def pop_evicted(self) -> list[tuple[int, BlockHash]]:
        """(slot, key) of the ready checkpoints evicted since the last call: their slots still hold
        the state until this step's compute (saves run after it), so a tier saves them first."""
        if not self._evicted:
            return []
        out, self._evicted = self._evicted, []
        return out

    def _drop(self, request_id: str, key: BlockHash | None) -> None:
        """Forget the request's checkpoint `key` (ready or pending) and free its slot."""
        if key is None:
            return
        if (slot := self._ckpt.pop(key, None)) is not None:
            self._ckpt_free.append(slot)
            return
        pending = self._pending.get(request_id, [])
        for entry in [e for e in pending if e[1] == key]:
            pending.remove(entry)
            self._ckpt_free.append(entry[2])

    def publish(self, request_id: str, num_computed_tokens: int) -> None:
        """Offer the request's pending checkpoints of at most `num_computed_tokens` tokens to lookups."""
        pending = self._pending.get(request_id)
        if not pending:
            return
        keep = []
        for n, key, slot in pending:
            if n <= num_computed_tokens:
                self._ckpt[key] = slot
                self.saved += 1
            else:
                keep.append((n, key, slot))
        self._pending[request_id] = keep


class CheckpointPool:
    """A StatePool's checkpoint slots as the KV connector sees a KV cache group's pool
    (core/kv_connector.py; the group io.STATE_GROUP): a "block" is a checkpoint slot, its key the
    prefix-cache key of the block the checkpoint ends. What the connector calls:

        get_cached_block(key)     the ready checkpoint's slot (no LRU touch), or None
        num_free_blocks           slots `get_new_blocks` can hand out (free, or evictable: not pinned)
        get_new_blocks(n)         n slots, held until `free_blocks` (evicting least recently used
                                  checkpoints: `pop_evicted` hands them to the KV tiers, those
                                  `worth_keeping` says are: the ones whose KV is still held)
        cache_full_blocks(...)    held slots, written, offered to lookups under their keys (and
                                  pinned while held: a hand-off's request is admitted first)
        free_blocks(ids)          the hold dropped (a slot never published goes back)
        cached_blocks()           every ready checkpoint, least recently used first (persistence)
    """

    def __init__(self, state: StatePool, block_size: int, worth_keeping=lambda key: True):
        self.state, self.block_size, self.worth_keeping = state, block_size, worth_keeping
        self.enable_prefix_caching = True
        self._held: dict[int, BlockHash | None] = {}  # slot -> its key once published

    def record_evictions(self) -> None:
        self.state.record_evictions()

    def pop_evicted(self) -> list[tuple[int, BlockHash]]:
        """The evicted checkpoints worth a copy in a KV tier (`worth_keeping`); the others are dropped."""
        return [(slot, key) for slot, key in self.state.pop_evicted() if self.worth_keeping(key)]

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.state.peek(block_hash)

    @property
    def num_free_blocks(self) -> int:
        return self.state.num_takeable

    def get_new_blocks(self, n: int) -> list[int] | None:
        if n > self.num_free_blocks:
            return None
        slots = [self.state.take_slot() for _ in range(n)]
        assert None not in slots, "counted free above"
        self._held.update(dict.fromkeys(slots))
        return slots

    def cache_full_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash], **_) -> int:
        """(parents and tokens, which BlockPool's events carry, mean nothing for a checkpoint.)"""
        new = 0
        for slot, key in zip(block_ids, block_hashes):
            if self.state.put(key, slot):
                self._held[slot] = key
                self.state.pin([key])
                new += 1
            else:  # the key was there already: the slot went back
                self._held.pop(slot, None)
        return new

    def free_blocks(self, block_ids) -> None:
        for slot in block_ids:
            if slot not in self._held:
                continue
            key = self._held.pop(slot)
            if key is None:
                self.state.give_back(slot)
            else:
                self.state.unpin([key])

    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        return self.state.ready()


def refusal(config: Any) -> str | None:
    """Why an engine setting cannot serve a hybrid build (the features whose KV handling the
    recurrent state does not follow yet), or None."""
    if getattr(config, "kv_eviction", "none") != "none":
        return (f"kv_eviction {config.kv_eviction!r} cannot run on a hybrid (gated DeltaNet) build: dropped KV "
                f"tokens would still be in the linear layers' recurrent state; use kv_eviction 'none'")
    if getattr(config, "speculative", "none") != "none":
        return (f"speculative {config.speculative!r} cannot run on a hybrid (gated DeltaNet) build: rolling back "
                f"rejected drafts needs the recurrent state before them, which is not kept; use speculative 'none'")
    return None


def is_hybrid(model_spec: dict) -> bool:
    """The manifest's model spec has linear-attention layers (a recurrent state per sequence)."""
    return model_spec.get("linear_attn") is not None
