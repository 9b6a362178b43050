"""The physical KV blocks. `BlockPool` owns, for every block of the pool: its reference
count, whether it is free, and its prefix-cache key; plus the map from key to block and
the prefix-cache hit counters. It knows nothing about requests (that is
`KVCacheManager`) and never touches tensors (that is the model runner).

Every usable block is in exactly one of three states::

    free       ref 0, no key        in `_free` (FIFO; handed out first)
    evictable  ref 0, cached key    in `_evictable` (LRU: oldest release evicted first)
    used       ref >= 1             held by one or more requests (key or not)

so ``num_free_plain + num_evictable + num_used == num_blocks - 1`` at all times.

NOTE: block ``PAD_BLOCK_ID`` (0) is never in any of the three states: padded block-table
entries point at it, so it must never hold a real token's KV.

NOTE: unlike vLLM's single free queue, blocks without a key are handed out before any
cached block is evicted: an uncached free block holds nothing worth keeping, so taking
it first can only raise the hit rate.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvexport.errors import ConfigError
from kvexport.io import PAD_BLOCK_ID

from .block_hash import BlockHash
from .errors import KVCacheError


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Observer event: a full block became a prefix-cache entry (`BlockPool.record_events`)."""

    block_hash: BlockHash  # its key
    parent_hash: BlockHash | None  # the key of the block before it in its sequence; None for a first block
    token_ids: tuple[int, ...] | None  # the block's tokens (block_size of them); None when the caller gave none
    salt: str | None = None  # the prefix-cache salt of the request that stored it (block_hash.request_salt)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Observer event: a prefix-cache entry was dropped (evicted, or the cache was reset)."""

    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Prefix-cache counters since the pool was built (or `reset_stats`)."""

    queries: int  # full blocks looked up in the cache (blocks)
    hits: int  # of those, found cached (blocks)
    evictions: int  # cached blocks whose key was dropped to reuse the block (blocks)

    @property
    def hit_rate(self) -> float:
        """hits / queries, 0.0 before the first query."""
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Fixed-size KV blocks with reference counts, a free list and a prefix cache.

    ``num_blocks`` counts every block of the KV tensors, the pad block included (so
    ``num_blocks - 1`` can be handed out); ``block_size`` is tokens per block. With
    ``enable_prefix_caching=False`` no key is ever stored and lookups always miss.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ConfigError(
                f"num_blocks={num_blocks!r}: a KV pool needs at least 2 blocks (block "
                f"{PAD_BLOCK_ID} is the reserved pad block); raise the KV memory budget"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size={block_size!r}: must be a positive number of tokens, e.g. 16")
        self.num_blocks = num_blocks  # blocks in the KV tensors, pad block included
        self.block_size = block_size  # tokens per block
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks  # per block: requests holding it
        self._hash: list[BlockHash | None] = [None] * num_blocks  # per block: its cache key
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != PAD_BLOCK_ID)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently released
        self._cached: dict[BlockHash, int] = {}  # key -> the one block holding it
        self._queries = 0
        self._hits = 0
        self._evictions = 0
        # (block id, key) of cached blocks evicted since `pop_evicted`, when a KV tier keeps them
        # (runtime/core/kv_tiers.py); None: not recorded
        self._evicted: list[tuple[int, BlockHash]] | None = None
        # prefix-cache events since `pop_events`, when an observer drains them; None: not recorded
        self._events: list[BlockStored | BlockRemoved] | None = None

    def record_events(self) -> None:
        """From now on, record every prefix-cache change as a `BlockStored` / `BlockRemoved`
        event for `pop_events` (an observer outside the engine, through the engine's KV connector,
        runtime/core/kv_connector.py: e.g. the cluster router runtime/serving/dynamo_worker.py
        feeds). Off by default: nobody drains them."""
        if self._events is None:
            self._events = []

    def pop_events(self) -> list[BlockStored | BlockRemoved]:
        """The prefix-cache events since the last call, in the order they happened."""
        out, self._events = self._events or [], [] if self._events is not None else None
        return out

    def record_evictions(self) -> None:
        """From now on, remember every evicted cached block for `pop_evicted` (a KV tier below
        the pool copies it out before the step overwrites it)."""
        if self._evicted is None:
            self._evicted = []

    def pop_evicted(self) -> list[tuple[int, BlockHash]]:
        """(block id, key) of the cached blocks evicted since the last call, in order. The block
        ids are handed out again already: their KV is intact only until the step runs."""
        out, self._evicted = self._evicted or [], [] if self._evicted is not None else None
        return out

    # ---- counts -------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the pad block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks `get_new_blocks` can hand out now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        """Unreferenced blocks that still hold a cached key."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1] (evictable counts as free)."""
        return self.num_used_blocks / self.num_usable_blocks

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(queries=self._queries, hits=self._hits, evictions=self._evictions)

    def reset_stats(self) -> None:
        self._queries = self._hits = self._evictions = 0

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The cache key `block_id` is registered under, or None."""
        self._check_id(block_id)
        return self._hash[block_id]

    # ---- allocation ---------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[int] | None:
        """Hand out ``n`` blocks with ref count 1, or None (nothing changed) when fewer
        than ``n`` are free. Uncached free blocks go first, then cached ones are evicted
        least recently released first."""
        if n < 0:
            raise KVCacheError(f"get_new_blocks(n={n}): n must be >= 0")
        if n > self.num_free_blocks:
            return None
        out = []
        for _ in range(n):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._evict(block_id)
            self._ref[block_id] = 1
            out.append(block_id)
        return out

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in order. A block reaching ref 0 becomes
        evictable (appended as most recently released) if it holds a cached key, free
        otherwise. Raises, changing nothing, if a block would drop below 0.

        NOTE: callers pass a request's blocks tail first, so its last blocks, which
        fewer later prompts share, are evicted before its first ones."""
        block_ids = list(block_ids)
        for block_id, n in Counter(block_ids).items():
            self._check_id(block_id)
            if self._ref[block_id] < n:
                raise KVCacheError(
                    f"free_blocks: block {block_id} has ref count {self._ref[block_id]} and "
                    f"was freed {n} time(s) (double free?)"
                )
        for block_id in block_ids:
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                if self._hash[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    # ---- prefix cache ---------------------------------------------------------------
    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        """(block id, key) of every block registered in the prefix cache (held or evictable)."""
        return [(b, h) for h, b in self._cached.items()]

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash``, or None. Counts nothing."""
        return self._cached.get(block_hash)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of ``block_hashes`` (stops at the first
        miss). Counts ``len(block_hashes)`` queries and one hit per block returned.
        References nothing: `touch` the result before the next `get_new_blocks`, or it
        may be evicted."""
        if not self.enable_prefix_caching:
            return []
        out = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            out.append(block_id)
        self._queries += len(block_hashes)
        self._hits += len(out)
        return out

    def count_lookup(self, queries: int, hits: int) -> None:
        """Count a lookup made with `get_cached_block` (a caller that decides the hits itself,
        e.g. runtime/core/windowed_kv_cache_manager.py) in `stats`, as `lookup` counts its own."""
        self._queries += queries
        self._hits += hits

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (a prefix-cache hit). An evictable block
        leaves the eviction queue. Raises, changing nothing, for a block that is free
        and uncached (its contents are garbage)."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref[block_id] == 0 and block_id not in self._evictable:
                raise KVCacheError(
                    f"touch: block {block_id} is free and holds no cached prefix; "
                    "only blocks returned by lookup() may be touched"
                )
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._evictable[block_id]
            self._ref[block_id] += 1

    def cache_full_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash], *,
                          parent_hashes: Sequence[BlockHash | None] | None = None,
                          block_tokens: Sequence[Sequence[int]] | None = None, salt: str | None = None) -> int:
        """Register each held, full block under its key so later prompts can hit it.
        Returns how many blocks were newly registered. ``parent_hashes``, ``block_tokens``
        (per block: the key before it, its tokens) and ``salt`` (the request's, already in
        the keys) only go into the `BlockStored` events.

        A block already registered under the same key is skipped; a key already held by
        another block is skipped too (two requests computed the same prefix at once: the
        first stays the cached copy, the second block stays uncached and is freed
        normally). Raises for a block that is not held or is registered under another
        key. No-op when prefix caching is off."""
        if len(block_ids) != len(block_hashes):
            raise KVCacheError(
                f"cache_full_blocks: {len(block_ids)} block ids but {len(block_hashes)} hashes"
            )
        for block_id, block_hash in zip(block_ids, block_hashes):
            self._check_id(block_id)
            if self._ref[block_id] == 0:
                raise KVCacheError(f"cache_full_blocks: block {block_id} is not held by any request")
            if self._hash[block_id] not in (None, block_hash):
                raise KVCacheError(
                    f"cache_full_blocks: block {block_id} is already cached under another key; "
                    "a cached block is never rewritten"
                )
        if not self.enable_prefix_caching:
            return 0
        added = 0
        for i, (block_id, block_hash) in enumerate(zip(block_ids, block_hashes)):
            if self._hash[block_id] is None and block_hash not in self._cached:
                self._hash[block_id] = block_hash
                self._cached[block_hash] = block_id
                added += 1
                if self._events is not None:
                    self._events.append(BlockStored(
                        block_hash, parent_hashes[i] if parent_hashes is not None else None,
                        tuple(block_tokens[i]) if block_tokens is not None else None, salt))
        return added

    def reset_prefix_cache(self) -> bool:
        """Drop every cached key (e.g. between benchmark runs). Only possible while no
        block is held; returns whether the cache was reset."""
        if self.num_used_blocks:
            return False
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            if self._events is not None:
                self._events.append(BlockRemoved(self._hash[block_id]))
            self._hash[block_id] = None
            self._free.append(block_id)
        self._cached.clear()
        return True

    # ---- internals ---------------------------------------------------------------
    def _evict(self, block_id: int) -> None:
        block_hash = self._hash[block_id]
        assert block_hash is not None and self._cached[block_hash] == block_id
        del self._cached[block_hash]
        self._hash[block_id] = None
        self._evictions += 1
        if self._events is not None:
            self._events.append(BlockRemoved(block_hash))
        if self._evicted is not None:
            self._evicted.append((block_id, block_hash))

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or block_id == PAD_BLOCK_ID or not 0 <= block_id < self.num_blocks:
            raise KVCacheError(
                f"block id {block_id!r} is not a usable block (valid: 0..{self.num_blocks - 1} "
                f"except the pad block {PAD_BLOCK_ID})"
            )
