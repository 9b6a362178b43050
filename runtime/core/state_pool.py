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
                                block boundary, and where the prompt's KV hit ended past its checkpoint (a
                                branch point: a shared system prompt's end); decode keeps one checkpoint per
                                sequence at the last block boundary it crossed (the next chat turn's resume
                                point), so a hybrid hits where an attention model's blocks would
                              - free releases the slot
    StateStep                 what a step's chunk says about state (ScheduledRequest.state): its slot,
                              the checkpoint to restore first, the checkpoint to save after
The model runner carries the copies out on its side (runtime/execution/state_store.py), restores
before the step's compute and saves after it succeeded; a checkpoint is offered to lookups only once
the step that saves it has completed (`cache_blocks`).

NOTE: a checkpoint is reachable only while the KV blocks of its prefix are cached (the lookup walks
the KV block pool first), so checkpoints go with their blocks; capacity evicts the least recently
used. The KV tiers (host, disk) and disaggregated prefill -> decode move KV blocks only, no state:
both are refused on hybrids by name (`refusal`, `disaggregation_refusal`) rather than served with
every hit recomputed.
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
        self._moving: dict[str, BlockHash] = {}  # request -> its decode checkpoint (replaced at each block boundary)
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
        if not self._ckpt_free:
            if not self._ckpt:
                return None
            self._ckpt_free.append(self._ckpt.popitem(last=False)[1])
        slot = self._ckpt_free.pop()
        self._pending.setdefault(request_id, []).append((num_tokens, key, slot))
        if moving:
            self._moving[request_id] = key
        return slot

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


class StatefulKVCacheManager:
    """A KV cache manager of a hybrid build: `inner`'s KV blocks plus a StatePool (module docstring).
    Everything else is `inner`'s."""

    def __init__(self, inner: Any, state: StatePool, checkpoint_blocks: int = 0):
        """checkpoint_blocks: a checkpoint every that many KV blocks (0: no prefix caching for the hybrid)."""
        self.inner, self.state, self.checkpoint_blocks = inner, state, checkpoint_blocks
        self._restore: dict[str, int] = {}  # request -> checkpoint to restore before its first chunk
        self._salts: dict[str, str | None] = {}
        # request -> where its prompt's KV hit ended beyond its checkpoint (a branch point: a checkpoint there)
        self._branch: dict[str, int] = {}
        self._lookup: tuple[tuple, int] = ((), 0)  # the last lookup: its block hashes, its KV hit before the cut (tokens)

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
        self._lookup = (computed.block_hashes, pool_hits * bs)
        for j in range(pool_hits, 0, -1):
            if self.state.has(computed.block_hashes[j - 1]):
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
            branch = self._branch_of(computed_blocks)
            if branch:
                self._branch[request_id] = branch
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

    # ---- the scheduler's hooks (`clip_chunk`, `state_step` below) ---------------------------
    def _prompt_end(self, prompt_len: int) -> int:
        """The prompt's last block boundary (its own checkpoint: a follow-up turn resumes there)."""
        return prompt_len // self.inner.block_size * self.inner.block_size

    def _branch_at(self, request_id: str | None) -> int:
        """The request's branch point (`_branch_of`); for one not admitted yet, the last lookup's (the
        scheduler clips its first chunk between get_computed_blocks and allocate_slots)."""
        if request_id in self._branch:
            return self._branch[request_id]
        if request_id is not None and request_id not in self.state:
            return self._lookup[1]
        return 0

    def clip(self, start: int, n: int, prompt_len: int, request_id: str | None = None) -> int:
        """A prompt chunk [start, start + n) cut to end at the next checkpoint boundary inside the prompt:
        every `interval` tokens, the prompt's last block boundary, and where its KV hit ended (`_branch_of`)."""
        iv = self.interval
        if not iv or start >= prompt_len - 1:
            return n
        ends = [b for b in ((start // iv + 1) * iv, self._prompt_end(prompt_len), self._branch_at(request_id))
                if start < b < prompt_len]
        return min(n, min(ends) - start) if ends else n

    def step(self, request_id: str, start: int, n: int, tokens: Sequence[int], prompt_len: int) -> StateStep:
        """The chunk's StateStep: the request's slot, a pending restore, and a checkpoint to save when the
        chunk ends on a block boundary that is one (keyed by that block's prefix hash): every `interval`
        tokens, the prompt's last block boundary (prompt chunks are cut there: `clip`), and in decode each
        block boundary crossed, replacing the sequence's previous decode checkpoint (so the next chat turn,
        which repeats this one's answer, resumes from its end, as an attention model's blocks would)."""
        end = start + n
        save = None
        iv, bs = self.interval, self.inner.block_size
        if iv and end % bs == 0 and end <= len(tokens):
            fixed = ((end % iv == 0 and end <= prompt_len) or end == self._prompt_end(prompt_len)
                     or end == self._branch.get(request_id))
            if fixed or end > prompt_len:
                key = hash_full_blocks(tokens[:end], bs, self._salts.get(request_id))[-1]
                save = self.state.reserve_checkpoint(request_id, end, key, moving=not fixed)
        return StateStep(self.state.slot(request_id), self._restore.pop(request_id, None), save)


def clip_chunk(kv: Any, start: int, n: int, prompt_len: int, request_id: str | None = None) -> int:
    """Scheduler hook: a prompt chunk's length, cut at a state checkpoint boundary for a hybrid's
    manager (StatefulKVCacheManager), else n."""
    return kv.clip(start, n, prompt_len, request_id) if isinstance(kv, StatefulKVCacheManager) else n


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
    from ..core.memory import parse_size

    if parse_size(getattr(config, "kv_offload_memory", 0) or 0) or getattr(config, "kv_offload_dir", ""):
        return ("kv_offload_memory / kv_offload_dir (the host and disk KV tiers) cannot serve a hybrid (gated "
                "DeltaNet) build yet: the tiers hold KV blocks only, not the state checkpoints a hybrid resumes "
                "from, so every tier hit would be recomputed; leave kv_offload_memory 0 and kv_offload_dir empty "
                "(prefix caching in the pool still hits, from its state checkpoints)")
    return None


def is_hybrid(model_spec: dict) -> bool:
    """The manifest's model spec has linear-attention layers (a recurrent state per sequence)."""
    return model_spec.get("linear_attn") is not None


def disaggregation_refusal(model_spec: dict, mode: str) -> str | None:
    """Why a disaggregated role (`kvexport dynamo --mode prefill|decode`) cannot serve this build, or None.
    NOTE: the hand-off moves KV blocks only; a hybrid's decode worker would also need the prompt's
    recurrent state, so it would find no checkpoint and recompute the whole prompt."""
    if mode == "agg" or not is_hybrid(model_spec):
        return None
    return (f"--mode {mode}: a hybrid (gated DeltaNet) build cannot be served disaggregated yet: the prefill -> "
            f"decode hand-off moves KV blocks, not the linear layers' recurrent state, so the decode worker would "
            f"recompute the whole prompt; serve it with --mode agg")


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
