"""The scheduler side of the engine's KV connector (runtime/kv_connector.py: the one seam through
which KV blocks move in or out of the pools; vLLM's `KVConnectorBase_V1` scheduler role). It
owns the view of every KV cache group's pool and of the KV tiers that moving blocks needs, in
block ids and prefix-cache keys only (no tensors, no requests):

    prompt_blocks(prompt, salt)   the (group, index, key) of a prompt's blocks a prefix lookup can use
    cached(group, key)            the pool block holding a key, or None
    held(keys)                    the keys held in a pool or a KV tier below it
    allocate(group, n)            n fresh pool blocks, held once; the evicted blocks offered to the tiers
    publish(group, ids, ...)      blocks written from outside registered under their keys
    release(holds)                the references `allocate` took, dropped
    persist()                     every cached pool block, then the host tier's, queued for the disk
                                  tier, most recently used first within its budget (shutdown)
    take_ops()                    the tier ops those calls queued, for the worker side, in order
    record_events / pop_events    a group's prefix-cache events (stored / removed) for a router
    usage()                       the full group's blocks, used and usable (a router's load signal)

The step's own tier traffic (evictions saved, hits loaded) does not pass here: the KV cache
managers queue it in the same `TierIndex` and it travels in `SchedulerOutput.kv_ops`, the
connector metadata of a step (runtime/core/kv_tiers.py).

NOTE: a block id is one group's: block 7 of the full group and block 7 of the local group are
different blocks of different pools. Every call names its group (`kvexport/io.py` FULL_GROUP,
LOCAL_GROUP); a build of one group has only FULL_GROUP. A hybrid (gated DeltaNet) build adds
io.STATE_GROUP last, whose pool is its state checkpoints (core/state_pool.py CheckpointPool: a
"block" is a checkpoint slot, keyed by the block the checkpoint ends).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvexport import io

from .block_hash import BlockHash, hash_full_blocks
from .block_pool import BlockPool, BlockRemoved, BlockStored
from .windowed_kv_cache_manager import first_needed_block
from .kv_tiers import TierIndex, TierKey, TierOp


class BlockRef(NamedTuple):
    """One block of a prompt: its group, its index in the prompt (tokens
    block_index*block_size..) and its prefix-cache key."""

    group: str
    block_index: int
    block_hash: BlockHash


class BlockImport(NamedTuple):
    """A block written into the pool from outside (another engine's bytes): where its bytes
    start in the payload, and what its `BlockStored` event says."""

    group: str
    block_hash: BlockHash
    parent_hash: BlockHash | None  # the key of the block before it; None for a prompt's first block
    offset: int  # bytes into the payload
    token_ids: Sequence[int]  # the block's tokens (block_size of them)


class BlockHold(NamedTuple):
    """Pool blocks of one group held (one reference each) until `release`."""

    group: str
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class KVUsage:
    """The full group's pool: what a router balances by."""

    used_blocks: int  # blocks held by requests
    usable_blocks: int  # blocks that can ever be handed out (the pad block excluded)


class KVConnectorScheduler:
    """Block ids and keys of every KV cache group (see the module doc). `pools`: group -> its
    pool (FULL_GROUP first); `tiers`: the KV tiers below them (None: none); `local_window`:
    the local group's window in tokens (None: no local group). Engine thread only."""

    def __init__(self, pools: Mapping[str, BlockPool], tiers: TierIndex | None = None,
                 local_window: int | None = None) -> None:
        assert next(iter(pools)) == io.FULL_GROUP, "the full group comes first"
        assert (io.LOCAL_GROUP in pools) == (local_window is not None), "a local group has a window"
        self.pools = dict(pools)
        self.tiers = tiers
        self.local_window = local_window
        self.block_size = pools[io.FULL_GROUP].block_size  # tokens per block, every group
        if tiers is not None:  # an allocation's evictions go to the tiers (as the KV cache managers' do)
            for pool in self.pools.values():
                pool.record_evictions()

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(self.pools)

    # ---- lookups --------------------------------------------------------------------
    def prompt_blocks(self, prompt: Sequence[int], salt: str | None = None) -> list[BlockRef]:
        """The blocks a prefix lookup of `prompt` can hit: the full group's first n = (L - 1) //
        block_size blocks (the last token is always computed), then the local group's blocks of
        those that the next token's window reaches (core/windowed_kv_cache_manager.py), then for a
        hybrid (gated DeltaNet) build the checkpoint of its recurrent state after block n - 1
        (io.STATE_GROUP, core/state_pool.py: a lookup resumes only where one is)."""
        bs = self.block_size
        n = max(len(prompt) - 1, 0) // bs
        hashes = hash_full_blocks(prompt[:n * bs], bs, salt)
        refs = [BlockRef(io.FULL_GROUP, i, hashes[i]) for i in range(n)]
        if self.local_window is not None:
            first = first_needed_block(n * bs, self.local_window, bs)
            refs += [BlockRef(io.LOCAL_GROUP, i, hashes[i]) for i in range(first, n)]
        if io.STATE_GROUP in self.pools and n:  # a hybrid: the recurrent state where those blocks end
            refs.append(BlockRef(io.STATE_GROUP, n - 1, hashes[n - 1]))
        return refs

    def cached(self, group: str, block_hash: BlockHash) -> int | None:
        """The pool block of `group` registered under `block_hash`, or None. Counts nothing."""
        return self.pools[group].get_cached_block(block_hash)

    def held(self, keys: Iterable[TierKey]) -> set[TierKey]:
        """The (group, key)s this engine holds, in a pool or a KV tier below it."""
        tiers = self.tiers
        return {(g, h) for g, h in keys if self.cached(g, h) is not None
                or (tiers is not None and tiers.where((g, h)) is not None)}

    # ---- moving blocks in -----------------------------------------------------------
    def allocate(self, group: str, n: int) -> list[int] | None:
        """`n` fresh blocks of `group`'s pool, each held once (None: fewer are free; nothing
        changed). Cached blocks this evicts are offered to the KV tiers: run `take_ops()` on
        the worker side before writing the new blocks (their old KV is saved first)."""
        pool = self.pools[group]
        ids = pool.get_new_blocks(n) if n <= pool.num_free_blocks else None
        if ids is not None and self.tiers is not None:
            for block_id, block_hash in pool.pop_evicted():
                self.tiers.offer(group, block_id, block_hash)
        return ids

    def publish(self, group: str, block_ids: Sequence[int], block_hashes: Sequence[BlockHash], *,
                parent_hashes: Sequence[BlockHash | None] | None = None,
                block_tokens: Sequence[Sequence[int]] | None = None) -> int:
        """Register held, written blocks under their keys (BlockPool.cache_full_blocks: `BlockStored`
        events carry the parents and tokens); returns how many were newly registered."""
        return self.pools[group].cache_full_blocks(block_ids, block_hashes, parent_hashes=parent_hashes,
                                                   block_tokens=block_tokens)

    def release(self, holds: list[BlockHold]) -> None:
        """Drop the references `allocate` took (the blocks stay cached, evictable). Empties
        `holds`, so a second call frees nothing."""
        for group, ids in holds:
            self.pools[group].free_blocks(ids)
        holds.clear()

    # ---- moving blocks out ----------------------------------------------------------
    @property
    def disk_on(self) -> bool:
        """A disk tier is configured and on."""
        return self.tiers is not None and self.tiers.disk_on

    def persist(self) -> None:
        """Queue for the disk tier what a restart should find (TierIndex.persist): every block the
        pools still cache, every group, then the host tier's blocks, most recently used first,
        within the disk budget. No-op without a disk tier."""
        if self.tiers is None or not self.tiers.disk_on:
            return
        # NOTE: the pools' blocks in the order they were cached: a prompt's first blocks before its
        # later ones, so a tight budget keeps prefixes whole (a block is no hit without its parent)
        self.tiers.persist([(group, block_id, block_hash) for group, pool in self.pools.items()
                            for block_id, block_hash in pool.cached_blocks()])

    def take_ops(self) -> tuple[TierOp, ...]:
        """The tier transfers queued so far, in order, for the worker side (and forget them)."""
        return self.tiers.take_ops() if self.tiers is not None else ()

    # ---- reporting --------------------------------------------------------------------
    def record_events(self, group: str = io.FULL_GROUP) -> None:
        """From now on, record `group`'s prefix-cache changes for `pop_events`."""
        self.pools[group].record_events()

    def pop_events(self, group: str = io.FULL_GROUP) -> list[BlockStored | BlockRemoved]:
        """`group`'s prefix-cache events since the last call, in order ([] when not recorded)."""
        return self.pools[group].pop_events()

    def usage(self) -> KVUsage:
        pool = self.pools[io.FULL_GROUP]
        return KVUsage(pool.num_used_blocks, pool.num_usable_blocks)


__all__ = ["BlockHold", "BlockImport", "BlockRef", "KVConnectorScheduler", "KVUsage"]
