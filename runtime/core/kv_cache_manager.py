"""KV memory per request. `KVCacheManager` owns, for every live request id: its block
table (``list[int]``), how many token slots it has reserved, its salt and the prefix-cache
keys of its full blocks. It turns token counts into blocks of a `BlockPool` and back
into slot ids; it never sees tensors (the runner pads block tables into int64 tensors
with ``PAD_BLOCK_ID``) and never decides who runs (that is the scheduler).

Protocol, per request, as the scheduler drives it::

    computed = m.get_computed_blocks(tokens, salt)        # prefix-cache hits (no refs yet)
    new = m.allocate_slots(rid, n, computed_blocks=computed)   # start; None = pool full
    ... runner stores KV of the step at m.slot_mapping(rid, start, n) ...
    m.cache_blocks(rid, tokens, num_computed_tokens)      # publish newly full blocks
    new = m.allocate_slots(rid, 1)                        # append for each decode step
    m.free(rid)                                           # finish / abort / preempt

Out of blocks returns ``None`` and changes nothing; calls out of protocol raise
`KVCacheError`.

NOTE: blocks are published to the prefix cache by `cache_blocks`, after the step that
wrote them, not by `allocate_slots`: with the ``onnx`` attention the runner stores a
step's K/V only after the graph ran, so a block published at allocation could be hit by
another request of the same step and read before it is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvexport.io import FULL_GROUP, PAD_BLOCK_ID

from .block_hash import BlockHash, hash_full_blocks
from .block_pool import BlockPool
from .errors import KVCacheError
from .kv_tiers import DISK, TierEvents, TierIndex, TierOp

# A ComputedBlocks entry found in a KV tier below the pool (kv_tiers.py), not in it: `allocate_slots`
# gives it a fresh block and the runner loads the KV into it before the step (never a real block id)
TIER_BLOCK = -1


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """What `KVCacheManager.get_computed_blocks` found for a prompt; pass it, unchanged
    and in the same step, to `KVCacheManager.allocate_slots`."""

    block_ids: tuple[int, ...]  # cached blocks holding the prompt's first tokens, in order
    num_computed_tokens: int  # tokens those blocks hold (len(block_ids) * block_size)
    block_hashes: tuple[BlockHash, ...]  # keys of every full block of the prompt; () if caching is off
    salt: str | None = None  # the request's salt (block_hash.request_salt; keyed into its first block)
    # (key, tier) of each TIER_BLOCK entry of block_ids, in order: hits in the host or disk tier
    tier_hits: tuple[tuple[BlockHash, str], ...] = ()
    # the tokens of each TIER_BLOCK entry, in order: only for the pool's observer events (a block
    # loaded from a tier is reported stored, as a computed one is: BlockPool.record_events)
    tier_tokens: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def empty(cls, salt: str | None = None) -> ComputedBlocks:
        """No hits and no precomputed keys: start a request from scratch."""
        return cls(block_ids=(), num_computed_tokens=0, block_hashes=(), salt=salt)


@dataclass(frozen=True, slots=True)
class GroupBlocks:
    """A request's blocks in a KV cache group other than the full one (kvexport/io.py),
    for the runner: its block table and the slots of the step's tokens."""

    group: str  # io.LOCAL_GROUP
    block_table: tuple[int, ...]  # PAD_BLOCK_ID where the window released a block
    slot_mapping: tuple[int, ...]  # one slot per token of the step


@dataclass(slots=True)
class _RequestBlocks:
    block_ids: list[int]  # block table; PAD_BLOCK_ID where a sliding window released a block
    num_slots: int  # tokens with a reserved slot (positions 0..num_slots-1)
    salt: str | None
    block_hashes: list[BlockHash] = field(default_factory=list)  # keys of the first full blocks
    num_cached_blocks: int = 0  # blocks [0, n) have been offered to the prefix cache


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tier_tokens(block_ids: Sequence[int], request_tokens: Sequence[int], block_size: int) -> tuple[tuple[int, ...], ...]:
    """The tokens of each TIER_BLOCK entry of `block_ids` (ComputedBlocks.tier_tokens)."""
    return tuple(tuple(request_tokens[i * block_size:(i + 1) * block_size])
                 for i, b in enumerate(block_ids) if b == TIER_BLOCK)


class KVCacheManager:
    """Per-request block tables over one `BlockPool`."""

    def __init__(self, pool: BlockPool, tiers: TierIndex | None = None, group: str = FULL_GROUP) -> None:
        self.pool = pool
        self.block_size = pool.block_size  # tokens per block
        self._reqs: dict[str, _RequestBlocks] = {}
        # the KV tiers below the pool (kv_tiers.py; shared by a windowed build's two groups), this pool's group
        self.tiers, self.group = tiers, group
        if tiers is not None:
            pool.record_evictions()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reqs

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return self.pool.usage

    def num_slots(self, request_id: str) -> int:
        """Tokens the request has reserved slots for."""
        return self._get(request_id, "num_slots").num_slots

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table: block ``i`` holds positions
        ``i*block_size .. (i+1)*block_size-1``; ``PAD_BLOCK_ID`` where released."""
        return list(self._get(request_id, "block_table").block_ids)

    # ---- prefix cache -------------------------------------------------------------
    def get_computed_blocks(self, request_tokens: Sequence[int], salt: str | None = None) -> ComputedBlocks:
        """The longest run of cached full blocks at the start of ``request_tokens``.

        NOTE: never covers the whole prompt: at least one token is left to compute so
        the model produces logits for the last one. So a prompt of ``L`` tokens can hit
        at most ``(L - 1) // block_size`` blocks. References nothing; counts queries and
        hits in ``pool.stats``."""
        if not self.pool.enable_prefix_caching:
            return ComputedBlocks.empty(salt)
        hashes = hash_full_blocks(request_tokens, self.block_size, salt)
        max_hits = max(len(request_tokens) - 1, 0) // self.block_size
        hits = self.pool.lookup(hashes[:max_hits])
        tier_hits = []
        if self.tiers is not None:  # pool -> host -> disk: the prefix continues in the tiers
            for h in hashes[len(hits):max_hits]:
                tier = self.tiers.where((self.group, h))
                if tier is None:
                    break
                tier_hits.append((h, tier))
        block_ids = tuple(hits) + (TIER_BLOCK,) * len(tier_hits)
        return ComputedBlocks(
            block_ids=block_ids,
            num_computed_tokens=(len(hits) + len(tier_hits)) * self.block_size,
            block_hashes=tuple(hashes),
            salt=salt,
            tier_hits=tuple(tier_hits),
            tier_tokens=tier_tokens(block_ids, request_tokens, self.block_size) if tier_hits else (),
        )

    # ---- KV tiers (kv_tiers.py) ----------------------------------------------------------
    def prefetch_tier_hits(self, computed: ComputedBlocks) -> bool:
        """Ask for `computed`'s disk hits to be read (off the step); True while any is still
        on disk or being read: the request waits ("loading") and looks its prefix up again."""
        waiting = False
        for h, tier in computed.tier_hits:
            if tier == DISK:
                self.tiers.prefetch((self.group, h))
                waiting = True
        return waiting

    def take_tier_ops(self) -> tuple[TierOp, ...]:
        """The transfers this step's allocations asked for, in order (SchedulerOutput.kv_ops)."""
        return self.tiers.take_ops() if self.tiers is not None else ()

    def apply_tier_events(self, events: TierEvents) -> None:
        if self.tiers is not None:
            self.tiers.apply(events)

    def _offload_evicted(self) -> None:
        """Hand the cached blocks the pool just evicted to the tiers (saved before the step)."""
        if self.tiers is not None:
            for block_id, block_hash in self.pool.pop_evicted():
                self.tiers.offer(self.group, block_id, block_hash)

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Publish the request's blocks that became full once the KV of its first
        ``num_computed_tokens`` tokens is stored. ``token_ids`` are the request's tokens
        (prompt then output), at least ``num_computed_tokens`` of them. Call after the
        runner stored the step's KV."""
        req = self._get(request_id, "cache_blocks")
        if not 0 <= num_computed_tokens <= min(req.num_slots, len(token_ids)):
            raise KVCacheError(
                f"cache_blocks({request_id!r}): num_computed_tokens={num_computed_tokens} must be in "
                f"0..min(reserved slots {req.num_slots}, len(token_ids) {len(token_ids)})"
            )
        num_full = num_computed_tokens // self.block_size
        if not self.pool.enable_prefix_caching or num_full <= req.num_cached_blocks:
            return
        if len(req.block_hashes) < num_full:
            full_tokens = token_ids[: num_full * self.block_size]
            req.block_hashes = hash_full_blocks(
                full_tokens, self.block_size, req.salt, parent_hashes=req.block_hashes
            )
        idx = [i for i in range(req.num_cached_blocks, num_full) if req.block_ids[i] != PAD_BLOCK_ID]
        bs = self.block_size
        # parents and tokens only feed the pool's observer events (BlockPool.record_events)
        self.pool.cache_full_blocks([req.block_ids[i] for i in idx], [req.block_hashes[i] for i in idx],
                                    parent_hashes=[req.block_hashes[i - 1] if i else None for i in idx],
                                    block_tokens=[token_ids[i * bs:(i + 1) * bs] for i in idx], salt=req.salt)
        req.num_cached_blocks = num_full

    # ---- allocation ---------------------------------------------------------------
    def allocate_slots(
        self, request_id: str, num_new_tokens: int, computed_blocks: ComputedBlocks | None = None
    ) -> list[int] | None:
        """Reserve slots for ``num_new_tokens`` more tokens of the request; returns the
        newly allocated block ids (possibly ``[]``), or None when the pool cannot
        satisfy it (then nothing changed: no refs taken, no block handed out).

        With ``computed_blocks`` the request starts (new, or re-admitted after
        preemption): it takes a reference on the cached blocks and reserves
        ``computed_blocks.num_computed_tokens + num_new_tokens`` slots. Without it the
        request must be live and its reservation grows by ``num_new_tokens``."""
        if num_new_tokens < 0:
            raise KVCacheError(
                f"allocate_slots({request_id!r}): num_new_tokens={num_new_tokens} must be >= 0"
            )
        if computed_blocks is None:
            req = self._get(request_id, "allocate_slots")
            total = req.num_slots + num_new_tokens
            new = self.pool.get_new_blocks(_cdiv(total, self.block_size) - len(req.block_ids))
            if new is None:
                return None
            self._offload_evicted()
            req.block_ids.extend(new)
            req.num_slots = total
            return new
        return self._start(request_id, num_new_tokens, computed_blocks)

    def _start(self, request_id: str, num_new_tokens: int, computed: ComputedBlocks) -> list[int] | None:
        if request_id in self._reqs:
            raise KVCacheError(
                f"allocate_slots({request_id!r}, computed_blocks=...): the request already holds "
                "blocks; append without computed_blocks, or free() it first"
            )
        # NOTE: PAD_BLOCK_ID hits: blocks a sliding window no longer needs (a windowed build's
        # local group, runtime/core/windowed_kv_cache_manager.py): kept as released, never touched
        hits = list(computed.block_ids)
        held = [b for b in hits if b not in (PAD_BLOCK_ID, TIER_BLOCK)]
        num_tier = hits.count(TIER_BLOCK)
        if num_tier != len(computed.tier_hits) or (num_tier and self.tiers is None):
            raise KVCacheError(f"allocate_slots({request_id!r}): computed_blocks' tier hits do not match its "
                               "block ids; pass get_computed_blocks()'s result unchanged")
        if computed.num_computed_tokens != len(hits) * self.block_size:
            raise KVCacheError(
                f"allocate_slots({request_id!r}): computed_blocks holds {len(hits)} blocks but "
                f"claims {computed.num_computed_tokens} tokens; pass get_computed_blocks()'s result unchanged"
            )
        for i, block_id in enumerate(hits):
            if block_id in (PAD_BLOCK_ID, TIER_BLOCK):
                continue
            if i >= len(computed.block_hashes) or self.pool.block_hash(block_id) != computed.block_hashes[i]:
                raise KVCacheError(
                    f"allocate_slots({request_id!r}): cached block {block_id} was evicted after "
                    "get_computed_blocks(); call both in the same step with no allocation between"
                )
        total = computed.num_computed_tokens + num_new_tokens
        num_needed = _cdiv(total, self.block_size) - len(hits) + num_tier
        # Touching an evictable hit takes it out of the free count, so it cannot pay
        # for the new blocks too.
        if num_needed > self.num_free_after_hits(held):
            return None
        if num_tier:  # NOTE: the evictions below must not push these hits out of their tier
            self.tiers.pin((self.group, h) for h, _ in computed.tier_hits)
        self.pool.touch(held)
        new = self.pool.get_new_blocks(num_needed)
        assert new is not None, "free count was checked above"
        self._offload_evicted()  # NOTE: first: a reused block's old KV is saved before a load overwrites it
        if num_tier:  # tier hits: fresh blocks, loaded before the step, published at once
            loaded, new = new[:num_tier], new[num_tier:]
            at = [i for i, b in enumerate(hits) if b == TIER_BLOCK]
            it = iter(loaded)
            hits = [next(it) if b == TIER_BLOCK else b for b in hits]
            keys = [h for h, _ in computed.tier_hits]
            for block_id, block_hash in zip(loaded, keys):
                self.tiers.load(self.group, block_id, block_hash)
            # NOTE: reported stored like computed blocks (with parents and tokens when the caller
            # gave them), so a cluster router learns this pool holds them again
            tokens = computed.tier_tokens if len(computed.tier_tokens) == num_tier else None
            self.pool.cache_full_blocks(loaded, keys, parent_hashes=[computed.block_hashes[i - 1] if i else None
                                                                     for i in at],
                                        block_tokens=tokens, salt=computed.salt)
        self._reqs[request_id] = _RequestBlocks(
            block_ids=hits + new,
            num_slots=total,
            salt=computed.salt,
            block_hashes=list(computed.block_hashes),
            num_cached_blocks=len(hits),
        )
        return new

    def num_free_after_hits(self, hit_block_ids: Sequence[int]) -> int:
        """Blocks still free for new allocations once the prefix-cache hits `hit_block_ids`
        (no pad block) are referenced: touching an evictable hit takes it out of the free count."""
        return self.pool.num_free_blocks - sum(1 for b in hit_block_ids if self.pool.ref_count(b) == 0)

    def free(self, request_id: str) -> None:
        """Release every block of the request (finished, aborted or preempted), tail
        first so its last blocks are evicted before its shared prefix. The id may then
        start again with ``allocate_slots(..., computed_blocks=...)``."""
        req = self._get(request_id, "free")
        del self._reqs[request_id]
        self.pool.free_blocks(b for b in reversed(req.block_ids) if b != PAD_BLOCK_ID)

    def fork(self, parent_id: str, child_id: str, num_tokens: int | None = None) -> int:
        """Start ``child_id`` sharing the parent's full blocks within its first
        ``num_tokens`` tokens (default: all reserved slots); each shared block gains a
        reference. Returns the tokens the child now holds (a multiple of block_size);
        the child computes the rest (e.g. the prompt's partial last block) itself.

        NOTE: only full blocks are shared: a partial block would be written by both.
        Fork only over tokens whose KV is already stored."""
        parent = self._get(parent_id, "fork")
        if child_id in self._reqs:
            raise KVCacheError(f"fork({parent_id!r}, {child_id!r}): the child id already holds blocks")
        if num_tokens is None:
            num_tokens = parent.num_slots
        if not 0 <= num_tokens <= parent.num_slots:
            raise KVCacheError(
                f"fork({parent_id!r}, {child_id!r}): num_tokens={num_tokens} must be in 0..{parent.num_slots}"
            )
        n = num_tokens // self.block_size
        shared = parent.block_ids[:n]
        self.pool.touch([b for b in shared if b != PAD_BLOCK_ID])
        self._reqs[child_id] = _RequestBlocks(
            block_ids=list(shared),
            num_slots=n * self.block_size,
            salt=parent.salt,
            block_hashes=parent.block_hashes[:n],
            num_cached_blocks=min(parent.num_cached_blocks, n),
        )
        return n * self.block_size

    def free_outside_window(self, request_id: str, num_computed_tokens: int, window: int,
                            keep_first: int = 0) -> list[int]:
        """Sliding window: release the request's blocks that no future token can attend
        to, replacing them by ``PAD_BLOCK_ID`` so block ``i`` still means positions
        ``i*block_size..``. Returns the released block ids.

        The next token, at position ``num_computed_tokens``, attends to positions
        ``>= num_computed_tokens - window + 1`` (HF Mistral's convention), so blocks
        ending before that are released, except the first ``keep_first`` blocks (streaming
        eviction's attention sinks, runtime/core/streaming.py)."""
        req = self._get(request_id, "free_outside_window")
        if window < 1:
            raise KVCacheError(f"free_outside_window({request_id!r}): window={window} must be >= 1")
        if not 0 <= num_computed_tokens <= req.num_slots:
            raise KVCacheError(
                f"free_outside_window({request_id!r}): num_computed_tokens={num_computed_tokens} "
                f"must be in 0..{req.num_slots}"
            )
        first_needed = max(num_computed_tokens - window + 1, 0)
        released = []
        for i in range(keep_first, first_needed // self.block_size):
            if req.block_ids[i] != PAD_BLOCK_ID:
                released.append(req.block_ids[i])
                req.block_ids[i] = PAD_BLOCK_ID
        self.pool.free_blocks(reversed(released))
        return released

    # ---- per-sequence state (KVCacheManagerProtocol): none here, the KV alone ------------------------
    def clip_chunk(self, start: int, n: int, prompt_len: int, request_id: str | None = None) -> int:
        """A prompt chunk's length: no state to checkpoint, so n."""
        return n

    def state_step(self, request_id: str, start: int, n: int, tokens: Sequence[int], prompt_len: int) -> None:
        """No per-sequence state beside the KV (core/state_pool.py has a hybrid's)."""
        return None

    def release_blocks(self, request_id: str, indices: Sequence[int]) -> list[int]:
        """Importance eviction (runtime/core/importance.py): release the request's blocks at table
        indices `indices` (each a full block before the one the next token is written to), replacing
        them by ``PAD_BLOCK_ID`` as `free_outside_window` does. Returns the released block ids.
        NOTE: a block another sequence shares (a prefix-cache hit) only loses this reference: its
        contents never change, and a cached block stays a valid prefix-cache entry (it holds what its
        hash chain says) until the pool evicts it, which tiers and KV events see as usual."""
        req = self._get(request_id, "release_blocks")
        released = []
        for i in sorted(set(indices)):
            if not 0 <= i < len(req.block_ids) or (i + 1) * self.block_size > req.num_slots:
                raise KVCacheError(f"release_blocks({request_id!r}): index {i} is not a full block of the table "
                                   f"({len(req.block_ids)} blocks, {req.num_slots} slots)")
            if req.block_ids[i] != PAD_BLOCK_ID:
                released.append(req.block_ids[i])
                req.block_ids[i] = PAD_BLOCK_ID
        self.pool.free_blocks(reversed(released))
        return released

    def extra_groups(self, request_id: str, start_pos: int, num_tokens: int) -> tuple[GroupBlocks, ...]:
        """The request's blocks in other KV cache groups: none (one group; see
        runtime/core/windowed_kv_cache_manager.py)."""
        return ()

    def slot_mapping(self, request_id: str, start_pos: int, num_tokens: int) -> list[int]:
        """Slot of each position ``start_pos .. start_pos+num_tokens-1`` of the request:
        ``block_id * block_size + position % block_size``. Raises for a position
        without a reserved slot or in a block released by the sliding window."""
        req = self._get(request_id, "slot_mapping")
        end = start_pos + num_tokens
        if start_pos < 0 or num_tokens < 0 or end > req.num_slots:
            raise KVCacheError(
                f"slot_mapping({request_id!r}, {start_pos}, {num_tokens}): positions must lie in "
                f"0..{req.num_slots - 1}; allocate_slots() first"
            )
        bs = self.block_size
        out = []
        for pos in range(start_pos, end):
            block_id = req.block_ids[pos // bs]
            if block_id == PAD_BLOCK_ID:
                raise KVCacheError(
                    f"slot_mapping({request_id!r}): position {pos} is in a block released by "
                    "the sliding window"
                )
            out.append(block_id * bs + pos % bs)
        return out

    def _get(self, request_id: str, call: str) -> _RequestBlocks:
        req = self._reqs.get(request_id)
        if req is None:
            raise KVCacheError(
                f"{call}({request_id!r}): the request holds no blocks (unknown id, or already "
                "freed); start it with allocate_slots(id, n, computed_blocks=get_computed_blocks(tokens))"
            )
        return req
