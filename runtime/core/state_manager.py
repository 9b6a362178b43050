"""The recurrent-state spec's manager (issue 43 §2, vLLM v1's per-spec managers): a hybrid build's
gated DeltaNet / short-conv layers keep one fixed-size state per sequence instead of KV that grows,
so their cache is a spec of its own beside the attention groups' — slots and checkpoints from a
StatePool (core/state_pool.py) — and the KV cache coordinator (core/kv_cache_coordinator.py) asks it,
beside the attention manager, at each call of the one KVCacheManagerProtocol:

    coordinator                          RecurrentStateManager (this spec's part)
    get_computed_blocks   attention hits ─▶ cut_hit: back to the furthest block boundary with a
                                            checkpoint in the state pool or a KV tier (none: no hit)
    prefetch_tier_hits    attention's   +  prefetch: the checkpoint's disk read
    allocate_slots        take a slot (admit) ─▶ attention allocates ─▶ admitted: restore or tier load
                          (attention out of blocks: unadmit, the slot goes back)
    cache_blocks          attention's   +  publish: the step's checkpoints offered to lookups
    free                  attention's   +  free: the slot, unpublished checkpoints
    clip_chunk            prompt chunks end at checkpoint boundaries
    state_step            the chunk's StateStep (slot, restore, save) for the runner

Where checkpoints are saved (every `checkpoint_blocks` blocks, the prompt's last block boundary,
a branch point where a prompt's KV hit ended past its checkpoint, and decode's moving checkpoint)
is core/state_pool.py's module docstring.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from kvexport.io import STATE_GROUP

from .block_hash import BlockHash, hash_full_blocks
from .kv_cache_manager import TIER_BLOCK
from .kv_tiers import DISK, TierIndex
from .state_pool import CheckpointPool, StatePool, StateStep
from .stats import StateCheckpointStats


class RecurrentStateManager:
    """The recurrent state's slots and checkpoints for the coordinator (module docstring). `kv_held(key)`:
    the attention block a checkpoint ends is held (pool or tier), else the checkpoint is no hit."""

    def __init__(self, pool: StatePool, block_size: int, checkpoint_blocks: int = 0, tiers: TierIndex | None = None,
                 kv_held: Callable[[BlockHash], bool] = lambda key: True):
        """checkpoint_blocks: a checkpoint every that many KV blocks (0: no prefix caching for the hybrid)."""
        self.pool, self.block_size, self.checkpoint_blocks, self.tiers = pool, block_size, checkpoint_blocks, tiers
        self._restore: dict[str, int] = {}  # request -> checkpoint to restore before its first chunk
        self._salts: dict[str, str | None] = {}
        # request -> where its prompt's KV hit ended beyond its checkpoint (a branch point: a checkpoint there)
        self._branch: dict[str, int] = {}
        self._lookup: tuple[tuple, int] = ((), 0)  # the last lookup: its block hashes, its KV hit before the cut (tokens)
        self.checkpoints = CheckpointPool(pool, block_size, kv_held)  # the connector's io.STATE_GROUP pool
        if tiers is not None:  # evicted checkpoints go to the KV tiers (host, disk)
            pool.record_evictions()

    def stats(self) -> StateCheckpointStats:
        return self.pool.stats()

    @property
    def interval(self) -> int:
        """Tokens between checkpoints (0: none)."""
        return self.checkpoint_blocks * self.block_size

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.pool

    def _in_tier(self, key: BlockHash) -> str | None:
        """The KV tier holding the checkpoint of `key` (kv_tiers.where), or None."""
        return self.tiers.where((STATE_GROUP, key)) if self.tiers is not None else None

    # ---- lookups ------------------------------------------------------------------------
    def cut_hit(self, computed):
        """The attention groups' hit `computed` (pool, then KV tiers) cut back to the furthest block
        boundary with a checkpoint in the state pool or a KV tier (none: no hit)."""
        bs = self.block_size
        pool_hits = next((i for i, b in enumerate(computed.block_ids) if b == TIER_BLOCK), len(computed.block_ids))
        self._lookup = (computed.block_hashes, len(computed.block_ids) * bs)
        for j in range(len(computed.block_ids), 0, -1):
            key = computed.block_hashes[j - 1]
            if self.pool.has(key) or self._in_tier(key) is not None:
                k = max(j - pool_hits, 0)  # the KV tier hits kept
                return dataclasses.replace(computed, block_ids=computed.block_ids[:j], num_computed_tokens=j * bs,
                                           tier_hits=computed.tier_hits[:k], tier_tokens=computed.tier_tokens[:k])
        return dataclasses.replace(computed, block_ids=(), num_computed_tokens=0, tier_hits=(), tier_tokens=())

    def _checkpoint_key(self, computed) -> BlockHash | None:
        """The key of the checkpoint a lookup's hit resumes from (None: no hit)."""
        j = computed.num_computed_tokens // self.block_size
        return computed.block_hashes[j - 1] if j else None

    def prefetch(self, computed) -> bool:
        """The hit's checkpoint, when it is on disk, read off the step; True while it is (the request
        waits, core/policies.TierPrefetch)."""
        key = self._checkpoint_key(computed)
        if key is not None and not self.pool.has(key) and self._in_tier(key) == DISK:
            self.tiers.prefetch((STATE_GROUP, key))
            return True
        return False

    # ---- admission ----------------------------------------------------------------------
    def admit(self, request_id: str, computed) -> tuple[bool, bool] | None:
        """Before the attention groups allocate: the request's running slot (taken on admission) and,
        for a hit resuming from a KV tier's checkpoint, that checkpoint pinned in its tier (the
        attention's allocation may evict). None: no slot free (like no blocks); else the two facts
        `unadmit` / `admitted` take back: (a slot was taken now, the checkpoint comes from a tier)."""
        new_slot = request_id not in self.pool
        if new_slot and self.pool.allocate(request_id) is None:
            return None
        key = self._checkpoint_key(computed) if computed is not None else None
        from_tier = key is not None and not self.pool.has(key)
        assert not from_tier or self._in_tier(key) is not None, "a hit ends at a checkpoint (cut_hit)"
        if from_tier:
            self.tiers.pin([(STATE_GROUP, key)])
        return new_slot, from_tier

    def unadmit(self, request_id: str, computed, taken: tuple[bool, bool]) -> None:
        """The attention groups had no blocks: `admit` undone."""
        new_slot, from_tier = taken
        if from_tier:
            self.tiers.unpin([(STATE_GROUP, self._checkpoint_key(computed))])
        if new_slot:
            self.pool.free(request_id)

    def admitted(self, request_id: str, computed, taken: tuple[bool, bool]) -> None:
        """The request is admitted with the hit `computed` (None: a later chunk): it resumes from its
        checkpoint, restored from the state pool before the step's compute, or loaded from its KV tier
        straight into the request's running slot (before the restores)."""
        if computed is None:
            return
        self._salts[request_id] = computed.salt
        branch = self._branch_of(computed)
        if branch:
            self._branch[request_id] = branch
        key = self._checkpoint_key(computed)
        if taken[1]:
            self.tiers.load(STATE_GROUP, self.pool.slot(request_id), key)
            self.pool.tier_hits += 1
            self.pool.hits += 1
        elif key is not None:
            self._restore[request_id] = self.pool.lookup(key)
            self.pool.hits += 1

    def free(self, request_id: str) -> None:
        self.pool.free(request_id)
        self._restore.pop(request_id, None)
        self._salts.pop(request_id, None)
        self._branch.pop(request_id, None)

    def publish(self, request_id: str, num_computed_tokens: int) -> None:
        """The step that saved the request's checkpoints up to here completed: offer them to lookups."""
        self.pool.publish(request_id, num_computed_tokens)

    def _branch_of(self, computed) -> int:
        """The KV hit of the lookup that gave `computed`, where it reaches past the checkpoint it was cut
        back to (0: it does not): this prompt and a cached one share blocks up to there, so a checkpoint
        there lets the next prompt with that prefix (a shared system prompt) resume where the KV hit ends."""
        hashes, hit = self._lookup
        return hit if hashes is computed.block_hashes and hit > computed.num_computed_tokens else 0

    # ---- the scheduler's hooks (KVCacheManagerProtocol.clip_chunk / state_step) --------------
    def _prompt_ends(self, prompt_len: int) -> tuple[int, int]:
        """The prompt's last block boundary (a follow-up turn resumes there) and the last one a lookup
        of the prompt itself can hit (it leaves the last token to compute: the same but for a prompt
        of whole blocks, one block earlier): the same prompt again, or its decode worker in
        disaggregated serving, resumes there."""
        bs = self.block_size
        return prompt_len // bs * bs, max(prompt_len - 1, 0) // bs * bs

    def _branch_at(self, request_id: str | None) -> int:
        """The request's branch point (`_branch_of`); for one not admitted yet, the last lookup's (the
        scheduler clips its first chunk between get_computed_blocks and allocate_slots)."""
        if request_id in self._branch:
            return self._branch[request_id]
        if request_id is not None and request_id not in self.pool:
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
        tokens, the prompt's last block boundary (prompt chunks are cut there: `clip_chunk`), and in decode
        each block boundary crossed, replacing the sequence's previous decode checkpoint (so the next chat
        turn, which repeats this one's answer, resumes from its end, as an attention model's blocks would)."""
        end = start + n
        save = None
        iv, bs = self.interval, self.block_size
        if iv and end % bs == 0 and end <= len(tokens):
            fixed = ((end % iv == 0 and end <= prompt_len) or end in self._prompt_ends(prompt_len)
                     or end == self._branch.get(request_id))
            if fixed or end > prompt_len:
                key = hash_full_blocks(tokens[:end], bs, self._salts.get(request_id))[-1]
                save = self.pool.reserve_checkpoint(request_id, end, key, moving=not fixed)
                self._offload_evicted()
        return StateStep(self.pool.slot(request_id), self._restore.pop(request_id, None), save)

    def _offload_evicted(self) -> None:
        """The ready checkpoints capacity just evicted go to the KV tiers (saved before the step, whose
        saves overwrite their slots after its compute: kv_tiers.py's NOTE), those worth it (kv_held)."""
        for slot, key in self.checkpoints.pop_evicted():
            if self.tiers is not None:
                self.tiers.offer(STATE_GROUP, slot, key)


__all__ = ["RecurrentStateManager"]
