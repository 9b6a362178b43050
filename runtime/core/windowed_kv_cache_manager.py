"""KV memory per request for builds with two KV cache groups (kvexport/io.py: models whose
layers mix full attention and a sliding window, e.g. gemma2/gemma3). `WindowedKVCacheManager`
owns one `KVCacheManager` (over its own `BlockPool`) per group and keeps the two in step:

    full   every full-attention layer's KV: keeps all of a request's blocks
    local  the windowed layers' KV: blocks behind the window are released after each step

A request's block ``j`` means positions ``j*block_size..`` in both groups, so both tables
grow together and the slot mappings differ only in the block ids. Allocation takes blocks
from both pools or from neither (None: the scheduler preempts, as with one group).

It offers the scheduler `KVCacheManager`'s protocol; `extra_groups` gives the local group's
table and slots for the runner.

NOTE: prefix caching: both groups publish their full blocks under the same keys (the request's
block hashes). A prompt hits `h` blocks when the full group holds blocks 0..h-1 and the local
group holds the blocks the next token's window reaches (from position h*bs - window + 1 on);
local blocks behind that stay released (PAD_BLOCK_ID) in the new request's table. Blocks the
window released are evictable, not lost, so they still serve later prompts until reused
(vLLM's hybrid allocator does the same with its sliding-window manager).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvexport import io
from kvexport.errors import ConfigError

from .block_hash import hash_full_blocks
from .block_pool import BlockPool
from .errors import KVCacheError
from .kv_cache_manager import TIER_BLOCK, ComputedBlocks, GroupBlocks, KVCacheManager, tier_tokens
from .kv_tiers import TierEvents, TierIndex, TierOp


@dataclass(frozen=True, slots=True)
class WindowedComputedBlocks:
    """What `WindowedKVCacheManager.get_computed_blocks` found, per group; pass it unchanged, in
    the same step, to `allocate_slots`."""

    full: ComputedBlocks  # the full group's hits
    local: ComputedBlocks  # the local group's: PAD_BLOCK_ID for blocks behind the window

    @property
    def num_computed_tokens(self) -> int:
        """Prompt tokens both groups hold (the same in both)."""
        return self.full.num_computed_tokens


@dataclass(frozen=True, slots=True)
class GroupSizes:
    """How a KV budget is split between the two groups' pools (pad blocks included)."""

    full_blocks: int  # blocks of each full-attention layer's pool
    local_blocks: int  # blocks of each windowed layer's pool
    full_bytes_per_block: int  # K and V of every full-attention layer, one block, bytes
    local_bytes_per_block: int  # K and V of every windowed layer, one block, bytes

    @property
    def bytes(self) -> int:
        """Bytes of all pools."""
        return self.full_blocks * self.full_bytes_per_block + self.local_blocks * self.local_bytes_per_block


def first_needed_block(position: int, window: int, block_size: int) -> int:
    """The first block a windowed layer reads for a token at `position` (window: tokens looked
    back, the query included)."""
    return max(position - window + 1, 0) // block_size


def local_blocks_needed(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks (pad block included) the local group needs so that it never runs out before the
    full group: each running sequence holds at most the blocks of its last `window` - 1 tokens
    plus the block of its next token (cdiv(window, bs) + 1), and one step's new tokens
    (max_num_batched_tokens) may each open a block before the window releases any."""
    per_seq = -(-window // block_size) + 1
    return 1 + max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)


def split_budget(budget_bytes: int, block_size: int, full_bytes_per_token: int, local_bytes_per_token: int,
                 window: int, max_num_seqs: int, max_num_batched_tokens: int) -> GroupSizes:
    """Split `budget_bytes` by need: the local group gets `local_blocks_needed` blocks (never
    more than the full group has: a local block always shadows a full one), the full group the
    rest. Raises ConfigError when the budget cannot hold one full-length step."""
    fb, lb = full_bytes_per_token * block_size, local_bytes_per_token * block_size
    want = local_blocks_needed(window, block_size, max_num_seqs, max_num_batched_tokens)
    full = (budget_bytes - want * lb) // fb
    local = want
    if full < want:  # small budget: as many local blocks as full ones
        full = local = budget_bytes // (fb + lb)
    need_one = 1 + -(-(window + max_num_batched_tokens) // block_size) + 1
    if local < min(need_one, want) or full < 2:
        raise ConfigError(
            f"a KV budget of {budget_bytes} bytes holds {full} full-attention and {local} windowed-layer blocks "
            f"of {block_size} tokens; one sequence needs {need_one} windowed-layer blocks (window {window} + "
            f"max_num_batched_tokens {max_num_batched_tokens}): raise kv_cache_memory to >= "
            f"{need_one * (fb + lb)} bytes or lower max_num_batched_tokens")
    return GroupSizes(int(full), int(local), fb, lb)


class WindowedKVCacheManager:
    """Per-request block tables over a full and a local `BlockPool` (see the module doc)."""

    def __init__(self, full: BlockPool, local: BlockPool, window: int, tiers: TierIndex | None = None) -> None:
        if full.block_size != local.block_size:
            raise ConfigError(f"the KV groups' block sizes differ ({full.block_size} vs {local.block_size})")
        if window < 1:
            raise ConfigError(f"window={window}: the local group's window must be >= 1 token")
        self.pool = full  # what the scheduler sizes sequences by, and the engine reports
        self.local_pool = local
        self.window = window  # tokens the local group's layers look back, the query included
        self.block_size = full.block_size  # tokens per block
        # NOTE: one TierIndex for both groups: its keys carry the group, its budgets are shared
        self.tiers = tiers
        self.full = KVCacheManager(full, tiers, io.FULL_GROUP)
        self.local = KVCacheManager(local, tiers, io.LOCAL_GROUP)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.full

    @property
    def usage(self) -> float:
        """The fuller of the two groups' usage, in [0, 1]."""
        return max(self.full.usage, self.local.usage)

    def num_slots(self, request_id: str) -> int:
        return self.full.num_slots(request_id)

    def block_table(self, request_id: str) -> list[int]:
        """The full group's table (the local one: `extra_groups`)."""
        return self.full.block_table(request_id)

    def slot_mapping(self, request_id: str, start_pos: int, num_tokens: int) -> list[int]:
        return self.full.slot_mapping(request_id, start_pos, num_tokens)

    def extra_groups(self, request_id: str, start_pos: int, num_tokens: int) -> tuple[GroupBlocks, ...]:
        """The local group's block table and the slots of positions start_pos.. in it."""
        return (GroupBlocks(io.LOCAL_GROUP, tuple(self.local.block_table(request_id)),
                            tuple(self.local.slot_mapping(request_id, start_pos, num_tokens))),)

    def held_bytes(self, request_id: str, full_bytes_per_block: int, local_bytes_per_block: int) -> int:
        """KV bytes the request's blocks take in both groups' pools."""
        held = lambda t: sum(1 for b in t if b != io.PAD_BLOCK_ID)  # noqa: E731
        return (held(self.full.block_table(request_id)) * full_bytes_per_block
                + held(self.local.block_table(request_id)) * local_bytes_per_block)

    # ---- prefix cache --------------------------------------------------------------
    def get_computed_blocks(self, request_tokens: Sequence[int], salt: str | None = None) -> WindowedComputedBlocks:
        """The longest cached prefix both groups can serve (see the module doc), at most
        ``(len - 1) // block_size`` blocks. References nothing; counts queries and hits in
        the full pool's stats."""
        if not self.pool.enable_prefix_caching:
            return WindowedComputedBlocks(ComputedBlocks.empty(salt), ComputedBlocks.empty(salt))
        bs = self.block_size
        hashes = hash_full_blocks(request_tokens, bs, salt)
        max_hits = max(len(request_tokens) - 1, 0) // bs
        full: list[int] = []
        for h in hashes[:max_hits]:
            b = self._find(self.pool, io.FULL_GROUP, h)
            if b is None:
                break
            full.append(b)
        for n in range(len(full), -1, -1):  # the longest prefix whose window the local group holds
            lo = self.first_needed_block(n * bs)
            local = [self._find(self.local_pool, io.LOCAL_GROUP, h) for h in hashes[lo:n]]
            if all(b is not None for b in local):
                break
        self.pool.count_lookup(max_hits, n)
        pad = (io.PAD_BLOCK_ID,) * min(lo, n)
        local_ids = tuple(b for b in local if b is not None)
        return WindowedComputedBlocks(
            ComputedBlocks(tuple(full[:n]), n * bs, tuple(hashes), salt,
                           self._tier_hits(io.FULL_GROUP, full[:n], hashes),
                           tier_tokens(full[:n], request_tokens, bs)),
            ComputedBlocks(pad + local_ids, n * bs, tuple(hashes), salt,
                           self._tier_hits(io.LOCAL_GROUP, pad + local_ids, hashes),
                           tier_tokens(pad + local_ids, request_tokens, bs)))

    def _find(self, pool: BlockPool, group: str, h) -> int | None:
        """A block's place: its pool block, TIER_BLOCK when a KV tier holds it, else None."""
        b = pool.get_cached_block(h)
        if b is None and self.tiers is not None and self.tiers.where((group, h)) is not None:
            return TIER_BLOCK
        return b

    def _tier_hits(self, group: str, block_ids, hashes) -> tuple:
        return tuple((hashes[i], self.tiers.where((group, hashes[i])))
                     for i, b in enumerate(block_ids) if b == TIER_BLOCK)

    # ---- KV tiers (kv_tiers.py) ------------------------------------------------------
    def prefetch_tier_hits(self, computed: WindowedComputedBlocks) -> bool:
        """Both groups' disk hits asked for; True while any is still on disk or being read."""
        a = self.full.prefetch_tier_hits(computed.full)
        return self.local.prefetch_tier_hits(computed.local) or a

    def take_tier_ops(self) -> tuple[TierOp, ...]:
        return self.tiers.take_ops() if self.tiers is not None else ()

    def apply_tier_events(self, events: TierEvents) -> None:
        if self.tiers is not None:
            self.tiers.apply(events)

    def first_needed_block(self, position: int) -> int:
        """The first block the local group's layers read for a token at `position`."""
        return first_needed_block(position, self.window, self.block_size)

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Publish both groups' newly full blocks (the local group's released ones are skipped)."""
        self.full.cache_blocks(request_id, token_ids, num_computed_tokens)
        self.local.cache_blocks(request_id, token_ids, num_computed_tokens)

    # ---- allocation ----------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_new_tokens: int,
                       computed_blocks: WindowedComputedBlocks | None = None) -> list[int] | None:
        """Reserve slots in both groups; returns the full group's new block ids, or None
        (nothing changed in either group) when either pool is short."""
        bs = self.block_size
        if computed_blocks is None:
            total = self.local.num_slots(request_id) + num_new_tokens
            need = math.ceil(total / bs) - len(self.local.block_table(request_id))
            free = self.local_pool.num_free_blocks
            full = local = None
        else:
            full, local = computed_blocks.full, computed_blocks.local
            total = local.num_computed_tokens + num_new_tokens
            need = math.ceil(total / bs) - len(local.block_ids) + local.block_ids.count(TIER_BLOCK)
            free = self.local.num_free_after_hits([b for b in local.block_ids if b not in (io.PAD_BLOCK_ID, TIER_BLOCK)])
        if need > free:
            return None
        pinned = [(g, h) for g, c in ((io.FULL_GROUP, full), (io.LOCAL_GROUP, local)) if c is not None
                  for h, _ in c.tier_hits]
        if pinned:  # NOTE: the full group's evictions must not push the local group's hits out of a tier
            self.tiers.pin(pinned)
        new = self.full.allocate_slots(request_id, num_new_tokens, full)
        if new is None:
            if pinned:
                self.tiers.unpin(pinned)
            return None
        got = self.local.allocate_slots(request_id, num_new_tokens, local)
        assert got is not None, "the local pool's free count was checked above"
        return new

    def free(self, request_id: str) -> None:
        self.full.free(request_id)
        self.local.free(request_id)

    # ---- per-sequence state (KVCacheManagerProtocol): none here, the KV alone ------------------------
    def clip_chunk(self, start: int, n: int, prompt_len: int, request_id: str | None = None) -> int:
        """A prompt chunk's length: no state to checkpoint, so n."""
        return n

    def state_step(self, request_id: str, start: int, n: int, tokens: Sequence[int], prompt_len: int) -> None:
        """No per-sequence state beside the KV (core/state_pool.py has a hybrid's)."""
        return None

    def release_blocks(self, request_id: str, indices: Sequence[int]) -> list[int]:
        """Importance eviction is not served on windowed (local + full group) builds: the engine refuses
        `--kv-eviction snapkv` for them (runtime/core/importance.py)."""
        raise KVCacheError("release_blocks: importance eviction is not served on builds with a windowed-layer "
                           "KV cache group")

    def free_outside_window(self, request_id: str, num_computed_tokens: int, window: int,
                            keep_first: int = 0) -> list[int]:
        """Release the local group's blocks behind `window` but its first `keep_first` (the full group
        keeps all); returns the released local block ids."""
        return self.local.free_outside_window(request_id, num_computed_tokens, window, keep_first)


def windowed_manager(budget_bytes: int, block_size: int, full_bytes_per_token: int, local_bytes_per_token: int,
                   window: int, max_num_seqs: int, max_num_batched_tokens: int,
                   enable_prefix_caching: bool = True, tiers: TierIndex | None = None
                   ) -> tuple[WindowedKVCacheManager, GroupSizes]:
    """A windowed manager whose pools split `budget_bytes` as `split_budget` says."""
    sizes = split_budget(budget_bytes, block_size, full_bytes_per_token, local_bytes_per_token, window,
                         max_num_seqs, max_num_batched_tokens)
    pools = (BlockPool(sizes.full_blocks, block_size, enable_prefix_caching),
             BlockPool(sizes.local_blocks, block_size, enable_prefix_caching))
    return WindowedKVCacheManager(*pools, window, tiers), sizes


__all__ = ["GroupSizes", "WindowedComputedBlocks", "WindowedKVCacheManager", "first_needed_block", "windowed_manager",
           "local_blocks_needed", "split_budget"]
