"""The state pool of hybrid models (gated DeltaNet layers: kvexport/io.py "Recurrent state"), the
scheduler's side: numbers, never tensors. Beside the KV block pool it hands out fixed-size STATE
SLOTS: one per running sequence (its linear layers' conv and delta-rule state), plus CHECKPOINT slots
that hold a copy of a sequence's state at a block boundary, keyed by that block's prefix hash
(core/block_hash.py), so a later prompt with the same prefix resumes from the nearest checkpoint
instead of computing its whole prefix again (prefix caching that hits on hybrids).

    StatePool                 slot numbers: running slots by request, checkpoints by block hash (LRU)
    StatefulKVCacheManager    a KV cache manager (kv_cache_interface.py) plus the StatePool:
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

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from kvexport.errors import KvExportError
from kvexport.io import STATE_GROUP

from .block_hash import BlockHash, hash_full_blocks
from .kv_cache_manager import TIER_BLOCK
from .kv_tiers import DISK
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


class StatefulKVCacheManager:
    """A KV cache manager of a hybrid build: `inner`'s KV blocks plus a StatePool (module docstring): the
    recurrent/conv state is this manager's spec beside the KV's, behind the one KVCacheManagerProtocol
    (clip_chunk / state_step are where the scheduler meets it)."""

    def __init__(self, inner: Any, state: StatePool, checkpoint_blocks: int = 0):
        """checkpoint_blocks: a checkpoint every that many KV blocks (0: no prefix caching for the hybrid)."""
        self.inner, self.state, self.checkpoint_blocks = inner, state, checkpoint_blocks
        self._restore: dict[str, int] = {}  # request -> checkpoint to restore before its first chunk
        self._salts: dict[str, str | None] = {}
        # request -> where its prompt's KV hit ended beyond its checkpoint (a branch point: a checkpoint there)
        self._branch: dict[str, int] = {}
        self._lookup: tuple[tuple, int] = ((), 0)  # the last lookup: its block hashes, its KV hit before the cut (tokens)
        self._checkpoints = CheckpointPool(state, inner.block_size, self._kv_held)
        if getattr(inner, "tiers", None) is not None:  # evicted checkpoints go to the KV tiers (host, disk)
            state.record_evictions()

    # ---- the KV itself: `inner`'s, member by member (KVCacheManagerProtocol; NOTE: no __getattr__, so the
    # interface stays in view) ----------------------------------------------------------------------
    @property
    def pool(self) -> Any:
        return self.inner.pool

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def usage(self) -> float:
        return self.inner.usage

    def num_slots(self, request_id: str) -> int:
        return self.inner.num_slots(request_id)

    def block_table(self, request_id: str) -> list[int]:
        return self.inner.block_table(request_id)

    def slot_mapping(self, request_id: str, start_pos: int, num_tokens: int) -> list[int]:
        return self.inner.slot_mapping(request_id, start_pos, num_tokens)

    def extra_groups(self, request_id: str, start_pos: int, num_tokens: int) -> tuple:
        return self.inner.extra_groups(request_id, start_pos, num_tokens)

    def take_tier_ops(self) -> tuple:
        return self.inner.take_tier_ops()

    def apply_tier_events(self, events: Any) -> None:
        self.inner.apply_tier_events(events)

    def free_outside_window(self, request_id: str, num_computed_tokens: int, window: int,
                            keep_first: int = 0) -> list[int]:
        return self.inner.free_outside_window(request_id, num_computed_tokens, window, keep_first)

    def release_blocks(self, request_id: str, indices: Sequence[int]) -> list[int]:
        return self.inner.release_blocks(request_id, indices)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.inner

    @property
    def interval(self) -> int:
        """Tokens between checkpoints (0: none)."""
        return self.checkpoint_blocks * self.inner.block_size

    @property
    def checkpoints(self) -> CheckpointPool:
        """The checkpoint slots as the KV connector's io.STATE_GROUP pool (CheckpointPool)."""
        return self._checkpoints

    def _in_tier(self, key: BlockHash) -> str | None:
        """The KV tier holding the checkpoint of `key` (kv_tiers.where), or None."""
        tiers = self.inner.tiers
        return tiers.where((STATE_GROUP, key)) if tiers is not None else None

    def get_computed_blocks(self, request_tokens: Sequence[int], salt: str | None = None):
        """The inner hits (pool, then KV tiers) cut back to the furthest block boundary with a
        checkpoint in the state pool or a KV tier (none: no hit)."""
        if not self.interval:
            return self.inner.get_computed_blocks((), salt)
        computed = self.inner.get_computed_blocks(request_tokens, salt)
        bs = self.inner.block_size
        pool_hits = next((i for i, b in enumerate(computed.block_ids) if b == TIER_BLOCK), len(computed.block_ids))
        self._lookup = (computed.block_hashes, len(computed.block_ids) * bs)
        for j in range(len(computed.block_ids), 0, -1):
            key = computed.block_hashes[j - 1]
            if self.state.has(key) or self._in_tier(key) is not None:
                k = max(j - pool_hits, 0)  # the KV tier hits kept
                return dataclasses.replace(computed, block_ids=computed.block_ids[:j], num_computed_tokens=j * bs,
                                           tier_hits=computed.tier_hits[:k], tier_tokens=computed.tier_tokens[:k])
        return dataclasses.replace(computed, block_ids=(), num_computed_tokens=0, tier_hits=(), tier_tokens=())

    def _checkpoint_key(self, computed) -> BlockHash | None:
        """The key of the checkpoint a lookup's hit resumes from (None: no hit)."""
        j = computed.num_computed_tokens // self.inner.block_size
        return computed.block_hashes[j - 1] if j else None

    def prefetch_tier_hits(self, computed) -> bool:
        """The KV's disk hits (inner) and the checkpoint's, when it is on disk, read off the step;
        True while any is still on disk or being read (the request waits, core/policies.TierPrefetch)."""
        wait = self.inner.prefetch_tier_hits(computed)
        key = self._checkpoint_key(computed)
        if key is not None and not self.state.has(key) and self._in_tier(key) == DISK:
            self.inner.tiers.prefetch((STATE_GROUP, key))
            wait = True
        return wait

    def allocate_slots(self, request_id: str, num_new_tokens: int, computed_blocks=None):
        """inner.allocate_slots, with a state slot taken on admission (None when none is free). A hit
        resumes from its checkpoint: restored from the state pool before the step's compute, or
        loaded from its KV tier straight into the request's running slot (before the restores)."""
        new_slot = request_id not in self.state
        if new_slot and self.state.allocate(request_id) is None:
            return None
        key = self._checkpoint_key(computed_blocks) if computed_blocks is not None else None
        from_tier = key is not None and not self.state.has(key)
        assert not from_tier or self._in_tier(key) is not None, "a hit ends at a checkpoint (get_computed_blocks)"
        if from_tier:  # NOTE: the evictions inner's allocation makes must not push it out of its tier
            self.inner.tiers.pin([(STATE_GROUP, key)])
        got = self.inner.allocate_slots(request_id, num_new_tokens, computed_blocks)
        if got is None:
            if from_tier:
                self.inner.tiers.unpin([(STATE_GROUP, key)])
            if new_slot:
                self.state.free(request_id)
            return None
        if computed_blocks is not None:
            self._salts[request_id] = computed_blocks.salt
            branch = self._branch_of(computed_blocks)
            if branch:
                self._branch[request_id] = branch
            if from_tier:
                self.inner.tiers.load(STATE_GROUP, self.state.slot(request_id), key)
                self.state.tier_hits += 1
                self.state.hits += 1
            elif key is not None:
                self._restore[request_id] = self.state.lookup(key)
                self.state.hits += 1
        return got

    def free(self, request_id: str) -> None:
        self.inner.free(request_id)
        self.state.free(request_id)
        self._restore.pop(request_id, None)
        self._salts.pop(request_id, None)
        self._branch.pop(request_id, None)

    def _branch_of(self, computed) -> int:
        """The KV hit of the lookup that gave `computed`, where it reaches past the checkpoint it was cut
        back to (0: it does not): this prompt and a cached one share blocks up to there, so a checkpoint
        there lets the next prompt with that prefix (a shared system prompt) resume where the KV hit ends."""
        hashes, hit = self._lookup
        return hit if hashes is computed.block_hashes and hit > computed.num_computed_tokens else 0

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        self.inner.cache_blocks(request_id, token_ids, num_computed_tokens)
        self.state.publish(request_id, num_computed_tokens)

    # ---- the scheduler's hooks (KVCacheManagerProtocol.clip_chunk / state_step) --------------
    def _prompt_ends(self, prompt_len: int) -> tuple[int, int]:
        """The prompt's last block boundary (a follow-up turn resumes there) and the last one a lookup
        of the prompt itself can hit (it leaves the last token to compute: the same but for a prompt
        of whole blocks, one block earlier): the same prompt again, or its decode worker in
        disaggregated serving, resumes there."""
        bs = self.inner.block_size
        return prompt_len // bs * bs, max(prompt_len - 1, 0) // bs * bs

    def _branch_at(self, request_id: str | None) -> int:
        """The request's branch point (`_branch_of`); for one not admitted yet, the last lookup's (the
        scheduler clips its first chunk between get_computed_blocks and allocate_slots)."""
        if request_id in self._branch:
            return self._branch[request_id]
        if request_id is not None and request_id not in self.state:
            return self._lookup[1]
        return 0

    def clip_chunk(self, start: int, n: int, prompt_len: int, request_id: str | None = None) -> int:
        """A prompt chunk [start, start + n) cut to end at the next checkpoint boundary inside the prompt:
        every `interval` tokens, the prompt's last block boundary, and where its KV hit ended (`_branch_of`)."""
        iv = self.interval
        if not iv or start >= prompt_len - 1:
            return n
        ends = [b for b in ((start // iv + 1) * iv, *self._prompt_ends(prompt_len), self._branch_at(request_id))
                if start < b < prompt_len]
        return min(n, min(ends) - start) if ends else n

    def state_step(self, request_id: str, start: int, n: int, tokens: Sequence[int], prompt_len: int) -> StateStep:
        """The chunk's StateStep: the request's slot, a pending restore, and a checkpoint to save when the
        chunk ends on a block boundary that is one (keyed by that block's prefix hash): every `interval`
        tokens, the prompt's last block boundary (prompt chunks are cut there: `clip`), and in decode each
        block boundary crossed, replacing the sequence's previous decode checkpoint (so the next chat turn,
        which repeats this one's answer, resumes from its end, as an attention model's blocks would)."""
        end = start + n
        save = None
        iv, bs = self.interval, self.inner.block_size
        if iv and end % bs == 0 and end <= len(tokens):
            fixed = ((end % iv == 0 and end <= prompt_len) or end in self._prompt_ends(prompt_len)
                     or end == self._branch.get(request_id))
            if fixed or end > prompt_len:
                key = hash_full_blocks(tokens[:end], bs, self._salts.get(request_id))[-1]
                save = self.state.reserve_checkpoint(request_id, end, key, moving=not fixed)
                self._offload_evicted()
        return StateStep(self.state.slot(request_id), self._restore.pop(request_id, None), save)

    def _offload_evicted(self) -> None:
        """The ready checkpoints capacity just evicted go to the KV tiers (saved before the step, whose
        saves overwrite their slots after its compute: kv_tiers.py's NOTE), those worth it (`_kv_held`)."""
        tiers = self.inner.tiers
        for slot, key in self._checkpoints.pop_evicted():
            if tiers is not None:
                tiers.offer(STATE_GROUP, slot, key)

    def _kv_held(self, key: BlockHash) -> bool:
        """The block a checkpoint ends is held somewhere (the pool, a KV tier): without it the checkpoint is
        no hit, not worth a copy in a tier."""
        tiers = self.inner.tiers
        return self.inner.pool.get_cached_block(key) is not None or (
            tiers is not None and tiers.where((self.inner.group, key)) is not None)


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


def for_build(kv: Any, model_spec: dict, config: Any) -> Any:
    """The engine's KV cache manager for a build: `kv` itself, or for a hybrid (the manifest's
    model.linear_attn) `kv` with a StatePool of max_num_seqs running slots and state_checkpoints
    checkpoint slots (none without prefix caching, or with state_checkpoint_blocks / state_checkpoints 0). A
    setting a hybrid cannot serve yet is refused (`refusal`)."""
    from kvexport.errors import ConfigError

    if not is_hybrid(model_spec):
        return kv
    if (why := refusal(config)) is not None:
        raise ConfigError(why)
    every = config.state_checkpoint_blocks if config.enable_prefix_caching and config.state_checkpoints else 0
    return StatefulKVCacheManager(kv, StatePool(config.max_num_seqs, config.state_checkpoints if every else 0), every)
