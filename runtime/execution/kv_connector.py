"""The worker side of the engine's KV connector (runtime/kv_connector.py; vLLM's
`KVConnectorBase_V1` worker role): the bytes of pool blocks. It reads a block of any KV cache
group out of the backend's pools, writes bytes into one, and carries out the tier ops the
scheduler side queued (runtime/core/kv_connector.py, kv_tiers.py), through the KV tiers' copier
(execution/kv_offload.py):

    read(blocks)                 [(group, block id), ...] -> their payloads back to back (uint8)
    write(group, blocks)         [(block id, payload), ...] -> those blocks of the group's pool
    run(ops) / flush(timeout)    tier ops (saves, loads, disk writes); wait for the disk writes
    close()                      the disk tier's folder released (shutdown)
    block_bytes, identity        a block's payload size per group; what the bytes mean (the build)

A block's payload is every pool tensor of its group sliced at the block (K/V codes, int4's in-row
scales, an MLA latent row: kv_offload.py's module doc), so what moves is what the pool holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvexport.manifest import Manifest

from ..core.kv_tiers import TierOp
from .kv_offload import KVOffload


class KVConnectorWorker:
    """Pool blocks as bytes (see the module doc). `offload`: the KV tiers' copier and bytes (the
    model runner runs the step's tier ops through it too); None without tiers: the copier is then
    made on first use. Engine thread only."""

    def __init__(self, backend, manifest: Manifest, offload: KVOffload | None = None) -> None:
        self.offload = offload
        self._backend, self._manifest = backend, manifest
        # the copier, layout and identity: the tiers', or made on first use without them or when the tiers hold blocks
        # encoded (--kv-offload-dtype int8): a hand-off between engines is at the pool's precision, never rounded
        self._copies = offload if offload is not None and offload.codec is None else None

    def _blocks(self) -> KVOffload:
        if self._copies is None:
            self._copies = KVOffload(self._backend, self._manifest)
        return self._copies

    @property
    def block_bytes(self) -> dict[str, int]:
        """group -> bytes of one block's payload."""
        return dict(self._blocks().block_bytes)

    @property
    def identity(self) -> bytes:
        """32 bytes naming what a block's bytes mean (kv_offload.build_identity): two engines may
        exchange blocks only when theirs are equal."""
        return self._blocks().identity

    def read(self, blocks: Sequence[tuple[str, int]]) -> np.ndarray:
        """The payloads of pool blocks (group, block id), concatenated in order (1-D uint8)."""
        copier = self._blocks().copier
        parts = [copier.read(g, b) for g, b in blocks]
        copier.synchronize()
        return np.concatenate(parts) if parts else np.empty(0, np.uint8)

    def write(self, group: str, blocks: Sequence[tuple[int, np.ndarray]]) -> None:
        """Write each (block id, payload of block_bytes[group] bytes) into `group`'s pool."""
        copies = self._blocks()
        for block_id, payload in blocks:
            assert payload.size == copies.block_bytes[group], "a payload holds exactly one block of the group"
            copies.copier.write(group, block_id, payload)
        copies.copier.synchronize()

    def run(self, ops: Sequence[TierOp], *, newest_first: bool = False) -> None:
        """Carry out tier ops in order (kv_tiers.py's NOTE); there are none without tiers.
        `newest_first`: their disk writes go most recently used first (KVOffload.run)."""
        if ops:
            assert self.offload is not None, "tier ops come only from an engine with KV tiers"
            self.offload.run(ops, newest_first=newest_first)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for the disk writes queued so far (KVOffload.flush); True when all are done."""
        return self.offload.flush(timeout_s) if self.offload is not None else True

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop using the disk tier and release its folder (KVOffload.close_disk)."""
        if self.offload is not None:
            self.offload.close_disk(timeout_s)


__all__ = ["KVConnectorWorker"]
