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
                              - prompt chunks end at checkpoint boundaries (every `checkpoint_blocks`
                                blocks), and a chunk that ends on one saves the state there
                              - free releases the slot
    StateStep                 what a step's chunk says about state (ScheduledRequest.state): its slot,
                              the checkpoint to restore first, the checkpoint to save after
The model runner carries the copies out on its side (runtime/execution/state_store.py), restores
before the step's compute and saves after it succeeded; a checkpoint is offered to lookups only once
the step that saves it has completed (`cache_blocks`).

NOTE: a checkpoint is reachable only while the KV blocks of its prefix are cached (the lookup walks
the KV block pool first), so checkpoints go with their blocks; capacity evicts the least recently
used. Hits in the KV tiers (host, disk) are not used by hybrids (their state has no tier yet).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from kvexport.errors import KvExportError

from .block_hash import BlockHash, hash_full_blocks
from .kv_cache_manager import TIER_BLOCK


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
        self.hits = self.saved = 0  # checkpoints restored, checkpoints saved (stats)

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
        """Release the request's slot; its checkpoints not yet published are dropped."""
        slot = self._by_request.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        for _, _, ck in self._pending.pop(request_id, ()):
            self._ckpt_free.append(ck)

    # ---- checkpoints --------------------------------------------------------------------
    def lookup(self, key: BlockHash) -> int | None:
        """The ready checkpoint slot of a block hash (marked recently used), or None."""
        slot = self._ckpt.get(key)
        if slot is not None:
            self._ckpt.move_to_end(key)
        return slot

    def reserve_checkpoint(self, request_id: str, num_tokens: int, key: BlockHash) -> int | None:
        """A checkpoint slot for the request's state after `num_tokens` tokens (block hash `key`),
        published by `publish` once those tokens are computed; None: already held, or no slot
        (the least recently used ready checkpoint is evicted for it when none is free)."""
        if key in self._ckpt or any(k == key for _, k, _ in self._pending.get(request_id, ())):
            return None
        if not self._ckpt_free:
            if not self._ckpt:
                return None
            self._ckpt_free.append(self._ckpt.popitem(last=False)[1])
        slot = self._ckpt_free.pop()
        self._pending.setdefault(request_id, []).append((num_tokens, key, slot))
        return slot

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


class StatefulKVCacheManager:
    """A KV cache manager of a hybrid build: `inner`'s KV blocks plus a StatePool (module docstring).
    Everything else is `inner`'s."""

    def __init__(self, inner: Any, state: StatePool, checkpoint_blocks: int = 0):
        """checkpoint_blocks: a checkpoint every that many KV blocks (0: no prefix caching for the hybrid)."""
        self.inner, self.state, self.checkpoint_blocks = inner, state, checkpoint_blocks
        self._restore: dict[str, int] = {}  # request -> checkpoint to restore before its first chunk
        self._salts: dict[str, str | None] = {}

    def __getattr__(self, name: str) -> Any:  # pool, block_size, usage, block_table, slot_mapping, tiers...
        return getattr(self.inner, name)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.inner

    @property
    def interval(self) -> int:
        """Tokens between checkpoints (0: none)."""
        return self.checkpoint_blocks * self.inner.block_size

    def get_computed_blocks(self, request_tokens: Sequence[int], salt: str | None = None):
        """The inner hits cut back to the furthest checkpointed boundary (no checkpoint: no hit).
        NOTE: only pool hits count (tier hits have no state)."""
        if not self.interval:
            return self.inner.get_computed_blocks((), salt)
        computed = self.inner.get_computed_blocks(request_tokens, salt)
        bs = self.inner.block_size
        pool_hits = next((i for i, b in enumerate(computed.block_ids) if b == TIER_BLOCK), len(computed.block_ids))
        for j in range(pool_hits, 0, -1):
            if j % self.checkpoint_blocks == 0 and self.state.lookup(computed.block_hashes[j - 1]) is not None:
                return dataclasses.replace(computed, block_ids=computed.block_ids[:j], num_computed_tokens=j * bs,
                                           tier_hits=(), tier_tokens=())
        return dataclasses.replace(computed, block_ids=(), num_computed_tokens=0, tier_hits=(), tier_tokens=())

    def allocate_slots(self, request_id: str, num_new_tokens: int, computed_blocks=None):
        """inner.allocate_slots, with a state slot taken on admission (None when none is free)."""
        new_slot = request_id not in self.state
        if new_slot and self.state.allocate(request_id) is None:
            return None
        got = self.inner.allocate_slots(request_id, num_new_tokens, computed_blocks)
        if got is None:
            if new_slot:
                self.state.free(request_id)
            return None
        if computed_blocks is not None:
            self._salts[request_id] = computed_blocks.salt
            j = computed_blocks.num_computed_tokens // self.inner.block_size
            if j:
                ck = self.state.lookup(computed_blocks.block_hashes[j - 1])
                assert ck is not None, "a hit is cut back to a checkpoint (get_computed_blocks)"
                self._restore[request_id] = ck
                self.state.hits += 1
        return got

    def free(self, request_id: str) -> None:
        self.inner.free(request_id)
        self.state.free(request_id)
        self._restore.pop(request_id, None)
        self._salts.pop(request_id, None)

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        self.inner.cache_blocks(request_id, token_ids, num_computed_tokens)
        self.state.publish(request_id, num_computed_tokens)

    # ---- the scheduler's hooks (`clip_chunk`, `state_step` below) ---------------------------
    def clip(self, start: int, n: int, prompt_len: int) -> int:
        """A prompt chunk [start, start + n) cut to end at the next checkpoint boundary inside the prompt."""
        iv = self.interval
        if not iv or start >= prompt_len - 1:
            return n
        boundary = (start // iv + 1) * iv
        return min(n, boundary - start) if boundary < prompt_len else n

    def step(self, request_id: str, start: int, n: int, tokens: Sequence[int], prompt_len: int) -> StateStep:
        """The chunk's StateStep: the request's slot, a pending restore, a checkpoint to save when the
        chunk ends on a boundary inside the prompt (keyed by that block's prefix hash)."""
        end = start + n
        save = None
        iv = self.interval
        if iv and end % iv == 0 and end <= len(tokens):  # prompt chunks end on boundaries (clip); decodes cross them
            key = hash_full_blocks(tokens[:end], self.inner.block_size, self._salts.get(request_id))[-1]
            save = self.state.reserve_checkpoint(request_id, end, key)
        return StateStep(self.state.slot(request_id), self._restore.pop(request_id, None), save)


def clip_chunk(kv: Any, start: int, n: int, prompt_len: int) -> int:
    """Scheduler hook: a prompt chunk's length, cut at a state checkpoint boundary for a hybrid's
    manager (StatefulKVCacheManager), else n."""
    return kv.clip(start, n, prompt_len) if isinstance(kv, StatefulKVCacheManager) else n


def state_step(kv: Any, request_id: str, start: int, n: int, tokens: Sequence[int],
               prompt_len: int) -> StateStep | None:
    """Scheduler hook: the chunk's StateStep for a hybrid's manager, else None."""
    if not isinstance(kv, StatefulKVCacheManager):
        return None
    return kv.step(request_id, start, n, tokens, prompt_len)


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


def for_build(kv: Any, model_spec: dict, config: Any) -> Any:
    """The engine's KV cache manager for a build: `kv` itself, or for a hybrid (the manifest's
    model.linear_attn) `kv` with a StatePool of max_num_seqs running slots and state_checkpoints
    checkpoint slots (none without prefix caching, or with state_checkpoint_blocks / state_checkpoints 0). A setting a hybrid
    cannot serve yet is refused (`refusal`)."""
    from kvexport.errors import ConfigError

    if model_spec.get("linear_attn") is None:
        return kv
    if (why := refusal(config)) is not None:
        raise ConfigError(why)
    every = config.state_checkpoint_blocks if config.enable_prefix_caching and config.state_checkpoints else 0
    return StatefulKVCacheManager(kv, StatePool(config.max_num_seqs, config.state_checkpoints if every else 0), every)
