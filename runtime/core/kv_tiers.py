"""The KV tiers below the pool: which evicted prefix-cache blocks are kept in host memory and
on disk, and the transfers that move them. `TierIndex` owns, per tier, the keys it holds
(LRU order) and their bytes against the tier's budget; it never touches tensors. The model
runner's copier (runtime/execution/kv_offload.py) holds the bytes and carries out the
`TierOp`s the scheduler hands it in `SchedulerOutput.kv_ops`, in order, before the step runs.

    pool ──evict──▶ host (LRU, --kv-offload-memory) ──overflow──▶ disk (LRU, --kv-offload-disk)
      ▲                 │                                           │
      └──LoadBlock──────┘◀──────── staged ◀──Prefetch (I/O thread)──┘

A lookup walks pool → host → disk (`where`). A host hit is loaded into a fresh pool block in
the step that admits the request. A disk hit is first read by the copier's I/O thread into a
staging area (`Prefetch`); the request waits ("loading") while the others run, and is admitted
once `TierEvents.prefetched` reports the read done (or recomputes from the first block that
failed to read: `TierEvents.failed`).

Keys are `(KV cache group, block hash)`: the pool's chained, salted block hashes
(block_hash.py), per group (a windowed-layer build keeps the full and the local group's blocks apart).
The build's identity guards the disk tier's files (kv_offload.py), so a key can never name
another build's KV.

The tiers are one user of the engine's KV connector (runtime/kv_connector.py): `TierIndex` is
its scheduler side's tier state (runtime/core/kv_connector.py), the copier its worker side's;
blocks moved from outside a step (a disaggregated hand-off, persistence at shutdown) queue their
tier ops here through the connector too.

NOTE: ops are one ordered list per step: a block evicted and reused in the same step is
saved (`SaveBlock`) before anything is loaded into it, and a key dropped after it was loaded
was loaded first. The copier must run them in this order, before the step's compute writes
the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .block_hash import BlockHash

HOST, DISK, STAGED = "host", "disk", "staged"  # where a tier op reads or writes
TierKey = tuple[str, BlockHash]  # (KV cache group, block hash)


@dataclass(frozen=True, slots=True)
class SaveBlock:
    """Copy pool block `block_id` of `group` (just evicted, still intact) into `tier`."""

    group: str
    block_id: int
    block_hash: BlockHash
    tier: str  # HOST | DISK


@dataclass(frozen=True, slots=True)
class MoveToDisk:
    """The host tier's copy of the block goes to the disk tier (the host copy is dropped)."""

    group: str
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class DropBlock:
    """Forget the block in `tier` (HOST | DISK | STAGED)."""

    group: str
    block_hash: BlockHash
    tier: str


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Read the block from disk into the staging area, off the step (the copier's I/O thread)."""

    group: str
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class LoadBlock:
    """Copy the block from `tier` (HOST | STAGED) into pool block `block_id` of `group`."""

    group: str
    block_id: int
    block_hash: BlockHash
    tier: str


TierOp = SaveBlock | MoveToDisk | DropBlock | Prefetch | LoadBlock


@dataclass(frozen=True, slots=True)
class TierEvents:
    """What the copier reports back after a step (ModelRunnerOutput.tier_events)."""

    prefetched: tuple[TierKey, ...] = ()  # read from disk and verified: now staged
    failed: tuple[TierKey, ...] = ()  # unreadable, corrupt or foreign files: forgotten (recomputed)
    disk_off: str | None = None  # why the disk tier turned off (a full disk, an I/O error); None: it is on


@dataclass(frozen=True, slots=True)
class TierStats:
    """Tier counters since the engine started."""

    host_blocks: int  # blocks held in host memory now
    disk_blocks: int  # blocks held on disk now
    host_hits: int  # blocks loaded into the pool from host memory
    disk_hits: int  # blocks loaded into the pool from disk (read, staged, loaded)
    disk_on: bool  # the disk tier is configured and has not been turned off


class TierIndex:
    """Keys and budgets of the host and disk tiers (see the module doc).

    `block_bytes`: bytes one block of each KV cache group takes in a tier (the copier's
    layout); `host_bytes` / `disk_bytes`: the budgets (0: no such tier); `staged_cap`: blocks
    the staging area holds at most (read from disk for requests about to be admitted)."""

    def __init__(self, block_bytes: dict[str, int], host_bytes: int, disk_bytes: int, staged_cap: int = 1024):
        self.block_bytes = dict(block_bytes)
        self.host_bytes, self.disk_bytes = host_bytes, disk_bytes  # budgets, bytes
        self.staged_cap = staged_cap  # blocks
        self._host: OrderedDict[TierKey, None] = OrderedDict()  # first = least recently used
        self._disk: OrderedDict[TierKey, None] = OrderedDict()
        self._staged: OrderedDict[TierKey, None] = OrderedDict()  # read from disk, waiting for their load
        self._loading: set[TierKey] = set()  # a Prefetch is in flight
        self._pinned: set[TierKey] = set()  # hits about to be loaded: never evicted before their LoadBlock
        self._host_used = self._disk_used = 0  # bytes
        self._ops: list[TierOp] = []
        self.host_hits = self.disk_hits = 0
        self.disk_off_reason: str | None = None

    # ---- state ------------------------------------------------------------------------
    @property
    def disk_on(self) -> bool:
        return self.disk_bytes > 0 and self.disk_off_reason is None

    def stats(self) -> TierStats:
        return TierStats(len(self._host), len(self._disk), self.host_hits, self.disk_hits, self.disk_on)

    def where(self, key: TierKey) -> str | None:
        """The tier a lookup finds `key` in: HOST, STAGED (read from disk, ready to load), DISK
        (to prefetch first), or None."""
        if key in self._host:
            return HOST
        if key in self._staged:
            return STAGED
        if key in self._disk and self.disk_on:
            return DISK
        return None

    def add_disk_blocks(self, keys: list[TierKey]) -> None:
        """Blocks found on disk at start (oldest first): the disk tier's index after a restart;
        beyond the budget the oldest are dropped."""
        for key in keys:
            if key not in self._disk and key[0] in self.block_bytes:
                self._disk[key] = None
                self._disk_used += self.block_bytes[key[0]]
        self._fit_disk()

    # ---- scheduler side -------------------------------------------------------------------
    def offer(self, group: str, block_id: int, block_hash: BlockHash) -> None:
        """Cached pool block `block_id` of `group` was evicted: keep its KV in the host tier (or,
        without one, on disk) if the budgets allow. The save reads the block before the step
        overwrites it (the module's NOTE)."""
        key, size = (group, block_hash), self.block_bytes[group]
        if key in self._host:
            self._host.move_to_end(key)  # the same key is the same KV: nothing to copy
        elif self.host_bytes >= size:
            self._ops.append(SaveBlock(group, block_id, block_hash, HOST))
            self._host[key] = None
            self._host_used += size
            self._fit_host()
        elif key in self._disk and self.disk_on:
            self._disk.move_to_end(key)
        elif self.disk_on and self.disk_bytes >= size:
            self._ops.append(SaveBlock(group, block_id, block_hash, DISK))
            self._disk[key] = None
            self._disk_used += size
            self._fit_disk()

    def persist(self, pool_blocks: list[tuple[str, int, BlockHash]]) -> None:
        """At shutdown: keep on disk what a restart should find, most recently used first, within
        the disk budget: `pool_blocks` (group, block id, key: the blocks the pools still cache, in
        the order to keep them), then the host tier's blocks (most recent first), then the disk's
        own. Queues the drops of the disk blocks that no longer fit first (the budget is never
        overrun), then the writes in that order (a short grace writes the best)."""
        if not self.disk_on:
            return
        keep: dict[TierKey, SaveBlock | MoveToDisk | None] = {}  # most recent first; None: on disk already
        used = 0

        def want(key: TierKey, op: SaveBlock | MoveToDisk | None) -> None:
            nonlocal used
            size = self.block_bytes[key[0]]
            if key not in keep and used + size <= self.disk_bytes:
                keep[key] = None if key in self._disk else op
                used += size

        for group, block_id, block_hash in pool_blocks:
            want((group, block_hash), SaveBlock(group, block_id, block_hash, DISK))
        for key in reversed(self._host):
            want(key, MoveToDisk(*key))
        for key in reversed(self._disk):
            want(key, None)
        self._ops += [DropBlock(*key, DISK) for key in self._disk if key not in keep]
        self._ops += [op for op in keep.values() if op is not None]
        for key, op in keep.items():
            if isinstance(op, MoveToDisk):  # the host copy goes to disk (the copier drops it)
                del self._host[key]
                self._host_used -= self.block_bytes[key[0]]
        self._disk = OrderedDict((key, None) for key in reversed(keep))  # first = least recently used
        self._disk_used = used

    def prefetch(self, key: TierKey) -> None:
        """Ask for a disk block to be read into the staging area (once)."""
        if key in self._loading or key in self._staged or key in self._host:
            return
        self._loading.add(key)
        self._ops.append(Prefetch(*key))

    def pin(self, keys) -> None:
        """Keep these hits until `load` (or `unpin`): the allocation that makes room for them
        may evict other pool blocks into the tiers, which must not push the hits out.
        NOTE: a tier may then run over its budget by the pinned blocks until they load."""
        self._pinned.update(keys)

    def unpin(self, keys) -> None:
        self._pinned.difference_update(keys)

    def load(self, group: str, block_id: int, block_hash: BlockHash) -> None:
        """Copy a tier hit into pool block `block_id` (this step, before its compute)."""
        key = (group, block_hash)
        self._pinned.discard(key)
        tier = self.where(key)
        assert tier in (HOST, STAGED), "only host or staged blocks load in a step; disk ones prefetch first"
        if tier == HOST:
            self._host.move_to_end(key)
            self.host_hits += 1
        else:
            del self._staged[key]
            if key in self._disk:
                self._disk.move_to_end(key)
            self.disk_hits += 1
        self._ops.append(LoadBlock(group, block_id, block_hash, tier))

    def take_ops(self) -> tuple[TierOp, ...]:
        """This step's transfers, in order (and forget them)."""
        ops, self._ops = tuple(self._ops), []
        return ops

    # ---- runner side --------------------------------------------------------------------
    def apply(self, events: TierEvents) -> None:
        """What the copier reported after a step."""
        for key in events.prefetched:
            self._loading.discard(key)
            if key in self._disk:  # NOTE: a key dropped from disk while it was read is not staged
                self._staged[key] = None
                while len(self._staged) > self.staged_cap:
                    old = self._oldest(self._staged)
                    if old is None:
                        break
                    del self._staged[old]
                    self._ops.append(DropBlock(*old, STAGED))
            else:
                self._ops.append(DropBlock(*key, STAGED))
        for key in events.failed:
            self._loading.discard(key)
            self._staged.pop(key, None)
            if key in self._disk:
                del self._disk[key]
                self._disk_used -= self.block_bytes[key[0]]
        if events.disk_off and self.disk_off_reason is None:
            self.disk_off_reason = events.disk_off
            self._disk.clear()
            self._disk_used = 0
            self._loading.clear()

    # ---- internals ----------------------------------------------------------------------
    def _fit_host(self) -> None:
        while self._host_used > self.host_bytes:
            key = self._oldest(self._host)
            if key is None:
                break
            del self._host[key]
            self._host_used -= self.block_bytes[key[0]]
            if self.disk_on and key not in self._disk and self.disk_bytes >= self.block_bytes[key[0]]:
                self._ops.append(MoveToDisk(*key))
                self._disk[key] = None
                self._disk_used += self.block_bytes[key[0]]
                self._fit_disk()
            else:
                self._ops.append(DropBlock(*key, HOST))

    def _fit_disk(self) -> None:
        while self._disk_used > self.disk_bytes:
            key = self._oldest(self._disk)
            if key is None:
                break
            del self._disk[key]
            self._disk_used -= self.block_bytes[key[0]]
            self._ops.append(DropBlock(*key, DISK))

    def _oldest(self, tier: OrderedDict) -> TierKey | None:
        """The least recently used key of `tier` that is not pinned (None: all are)."""
        return next((k for k in tier if k not in self._pinned), None)
