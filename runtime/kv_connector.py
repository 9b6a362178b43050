"""The engine's KV connector: the one seam through which KV blocks move in or out of the pools
(vLLM's `KVConnectorBase_V1`, with its two roles). `LLMEngine.kv_connector` is the only way
front ends, disaggregated serving and shutdown reach the blocks; nothing above the engine reads
its pools, KV cache managers, tiers or runner.

    scheduler side (core/kv_connector.py)       block ids and prefix-cache keys, every KV cache
                                                group; the tiers' index; prefix-cache events
    worker side (execution/kv_connector.py)     the blocks' bytes: read, write, tier ops, disk flush

Who calls what (all on the engine thread, between steps):

    KV tiers          the KV cache managers queue saves / loads in the scheduler side's TierIndex;
                      they travel per step in SchedulerOutput.kv_ops to the runner, which runs
                      them on the worker side's copier (the connector metadata of a step)
    disaggregation    prefill: prompt_blocks -> export_blocks (runtime/serving/dynamo_disagg.py);
                      decode: prompt_blocks -> held -> import_blocks -> release once admitted
    shutdown          LLMEngine.close -> persist (every group's cached blocks and the host tier's to
                      the disk tier), close (the folder's lock released)
    router events     record_events / pop_events / usage (runtime/serving/dynamo_worker.py)
    metrics           tier_stats -> KVTierStats (in LLMEngine.stats(): /metrics, Triton's metrics, bench)

Blocks are named by `BlockRef` (group, index in the prompt, prefix-cache key): full and local
(windowed) groups alike; a block's bytes are its group's payload (K/V codes, int8/int4 scales
where the pool holds them, MLA latent rows), `block_bytes[group]` long.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np

from kvexport import io

from .core.block_pool import BlockRemoved, BlockStored
from .core.kv_connector import BlockHold, BlockImport, BlockRef, KVConnectorScheduler, KVUsage
from .core.kv_tiers import TierKey
from .core.stats import KVTierStats
from .execution.kv_connector import KVConnectorWorker

log = logging.getLogger(__name__)

__all__ = ["BlockHold", "BlockImport", "BlockRef", "KVConnector", "KVUsage"]


class KVConnector:
    """Both sides of the seam, and the moves that need both (see the module doc)."""

    def __init__(self, scheduler: KVConnectorScheduler, worker: KVConnectorWorker) -> None:
        self.scheduler = scheduler
        self.worker = worker

    # ---- what blocks are ----------------------------------------------------------------
    @property
    def block_size(self) -> int:
        """Tokens per block (every group)."""
        return self.scheduler.block_size

    @property
    def groups(self) -> tuple[str, ...]:
        """The KV cache groups, FULL_GROUP first."""
        return self.scheduler.groups

    @property
    def block_bytes(self) -> dict[str, int]:
        """group -> bytes of one block's payload."""
        return self.worker.block_bytes

    @property
    def identity(self) -> str:
        """What a block's bytes mean (the build and the payload layout), hex: engines exchange
        blocks only when theirs are equal."""
        return self.worker.identity.hex()

    def prompt_blocks(self, prompt: Sequence[int], salt: str | None = None) -> list[BlockRef]:
        """The blocks of `prompt` a prefix lookup can use, every group (KVConnectorScheduler.prompt_blocks)."""
        return self.scheduler.prompt_blocks(prompt, salt)

    def held(self, keys: Iterable[TierKey]) -> set[TierKey]:
        """The (group, key)s held in a pool or a KV tier."""
        return self.scheduler.held(keys)

    # ---- out ----------------------------------------------------------------------------
    def export_blocks(self, refs: Sequence[BlockRef]) -> tuple[list[BlockRef], np.ndarray]:
        """The refs whose blocks the pools hold, and their payloads back to back (each
        block_bytes[group] long, in that order). The full group stops at its first missing block
        (the prefix ends there). Call it before any allocation after the step that computed them."""
        out, stopped = [], set()
        for ref in refs:
            b = None if ref.group in stopped else self.scheduler.cached(ref.group, ref.block_hash)
            if b is None:
                if ref.group == io.FULL_GROUP:
                    stopped.add(ref.group)
                continue
            out.append((ref, b))
        return [r for r, _ in out], self.worker.read([(r.group, b) for r, b in out])

    def persist(self, timeout_s: float = 30.0) -> bool:
        """Write every block the pools still cache, every group, and the host tier's blocks to the
        disk tier, most recently used first within its budget, and wait up to `timeout_s` for the
        writes (a restart on the same folder finds them); True when all are written or there is no
        disk tier."""
        if not self.scheduler.disk_on:
            return True
        self.scheduler.persist()
        self.worker.run(self.scheduler.take_ops(), newest_first=True)
        return self.worker.flush(timeout_s)

    def close(self) -> None:
        """Stop using the disk tier and release its folder's lock (after `persist`, at shutdown):
        another process may use the folder from now on."""
        self.worker.close(timeout_s=0.0)

    # ---- in -----------------------------------------------------------------------------
    def import_blocks(self, blocks: Sequence[BlockImport], payload: np.ndarray) -> list[BlockHold]:
        """Write blocks from outside into fresh pool blocks and publish them under their keys,
        each held (one reference) until `release`. Blocks whose key the pool got meanwhile are
        skipped; a group whose pool has too few free blocks is skipped whole (its prefix is then
        recomputed). Returns the holds, one per group written. ValueError, before anything is allocated, when a
        block's bytes lie outside `payload` (a short or damaged hand-off: the caller recomputes the prompt).
        NOTE: checked first: a block found short while writing would leave its group's fresh blocks allocated and
        never published nor freed, one leak per bad hand-off (hostile trial, issue 48)."""
        sizes = self.worker.block_bytes
        for b in blocks:
            n = sizes.get(b.group)
            if n is None or not 0 <= b.offset <= payload.size - n:
                raise ValueError(f"KV import: the {b.group!r} block at offset {b.offset!r} lies outside the "
                                 f"{payload.size}-byte payload (a block is {n} bytes); nothing was written")
        holds = []
        for group in self.groups:
            todo = [b for b in blocks if b.group == group and self.scheduler.cached(group, b.block_hash) is None]
            if not todo:
                continue
            ids = self.scheduler.allocate(group, len(todo))
            if ids is None:
                log.warning("KV connector: %d %s blocks do not fit the pool now; recomputing them", len(todo), group)
                continue
            self.worker.run(self.scheduler.take_ops())  # NOTE: a reused block's old KV goes to its tier first
            size = self.worker.block_bytes[group]
            self.worker.write(group, [(b, payload[t.offset:t.offset + size]) for b, t in zip(ids, todo)])
            self.scheduler.publish(group, ids, [t.block_hash for t in todo],
                                   parent_hashes=[t.parent_hash for t in todo],
                                   block_tokens=[list(t.token_ids) for t in todo])
            holds.append(BlockHold(group, ids))
        return holds

    def release(self, holds: list[BlockHold]) -> None:
        """Drop the references `import_blocks` took; empties `holds` (a second call frees nothing)."""
        self.scheduler.release(holds)

    # ---- reporting ----------------------------------------------------------------------
    def record_events(self, group: str = io.FULL_GROUP) -> None:
        """From now on, record `group`'s prefix-cache events (stored / removed blocks) for `pop_events`."""
        self.scheduler.record_events(group)

    def pop_events(self, group: str = io.FULL_GROUP) -> list[BlockStored | BlockRemoved]:
        """`group`'s prefix-cache events since the last call, in order."""
        return self.scheduler.pop_events(group)

    def usage(self) -> KVUsage:
        """The full group's blocks, used and usable."""
        return self.scheduler.usage()

    def tier_stats(self) -> KVTierStats:
        """The KV tiers' figures (core/stats.py; all 0 without tiers): blocks held, hits and bytes
        moved per tier, load time and blocks loaded, whether the disk tier is on."""
        tiers, offload = self.scheduler.tiers, self.worker.offload
        if tiers is None or offload is None:
            return KVTierStats()
        t, o = tiers.stats(), offload.stats
        return KVTierStats(host_blocks=t.host_blocks, disk_blocks=t.disk_blocks, host_hits=t.host_hits,
                           disk_hits=t.disk_hits, host_write_bytes=o.host_write_bytes,
                           host_read_bytes=o.host_read_bytes, disk_write_bytes=o.disk_write_bytes,
                           disk_read_bytes=o.disk_read_bytes, load_seconds=o.load_seconds, loads=o.loads,
                           disk_errors=o.disk_errors, disk_on=t.disk_on)
