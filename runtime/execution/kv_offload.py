"""The executor side of the KV tiers (runtime/core/kv_tiers.py): it holds the bytes of the blocks
kept in host memory, reads and writes the disk tier's files (runtime/execution/kv_disk.py) on
an I/O thread, and copies a block's K/V between the backend's pools and those bytes. The model
runner calls `KVOffload.run(SchedulerOutput.kv_ops)` before each step's compute and returns
`poll()`'s events to the scheduler.

A block's bytes (its payload) are, for its KV cache group, every pool tensor of that group's
layers sliced at the block, in the backend's order ([K_0, V_0, K_1, V_1, ...], then any per-block
tensors a backend adds such as scales), each C-contiguous:

    payload(group, b) = concat(t[:, b] for t in the group's block tensors)   # block axis 1
    payload(io.STATE_GROUP, s) = concat(p[s] for p in the state pools)     # a hybrid's checkpoint slot s

With `--kv-offload-dtype int8|int4` the tiers hold each payload encoded (kv_tier_codec.py; `_CodecCopier`
around the copier below), and `block_bytes` is the encoded size, so a budget holds more blocks.

`block_tensors()` reads that list from the backend: `backend.kv_block_tensors()` where a backend
defines it (the hook for pools beyond K/V, e.g. per-block scales), else its `pools` split by the
manifest's layer groups. `build_identity()` hashes the build (weights checksum, model spec, KV
layout, dtype, block size, scales) with that layout, so a block is never read into another build.

    numpy pools (onnxruntime, host memory)   copies with numpy, on the engine thread
    torch CUDA pools (TensorRT)              device <-> pinned host buffers, async on a copy stream;
                                             the compute stream waits on the copies (documented torch API)

NOTE: saves and loads run on the engine thread before the step (they are memory copies: a
block of smollm2-135m fp32 is 720 KiB); only disk I/O runs on the I/O thread, so a request
whose prefix is on disk waits in the queue ("loading") while the others' steps run.

NOTE (bounded waits): a disk read not done within `disk_timeout_s` (DISK_TIMEOUT_S) of its request
counts as missing (failed: recomputed; its late answer is dropped), and a disk job running longer
than that turns the disk tier off (the disk does not answer: a hung mount), so no request waits
on the disk longer than the limit and `flush` (shutdown) does not wait on a hung job.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvexport import io
from kvexport.manifest import Manifest

from ..core.kv_tiers import HOST, STAGED, DropBlock, LoadBlock, MoveToDisk, Prefetch, SaveBlock, TierEvents, \
    TierKey, TierOp
from .kv_disk import CorruptBlock, DiskFull, DiskTier
from .kv_tier_codec import itemsize, tier_codec

log = logging.getLogger(__name__)

DISK_TIMEOUT_S = 5.0  # longest a disk read may take before its block counts as missing (seconds)


def block_tensors(backend, manifest: Manifest) -> list[tuple[str, Any]]:
    """(KV cache group, tensor) of every pool tensor with a block axis 1, in the backend's order."""
    hook = getattr(backend, "kv_block_tensors", None)
    if hook is not None:
        return list(hook())
    groups = manifest.layer_groups or (io.FULL_GROUP,) * manifest.kv.num_layers
    # Gemma 4: a KV cache shared by several layers is one layer's pools (io.py "Shared KV")
    kv_layers = io.kv_layout(manifest.model.spec, manifest.kv.num_kv_heads, manifest.kv.head_dim)[0]
    layers = io.pool_layers(manifest.kv.num_layers, manifest.kv.latent, kv_layers)  # K, V per layer; MLA: one latent pool
    return [(groups[layer], t) for layer, t in zip(layers, backend.pools)]


def _is_torch(t) -> bool:
    return type(t).__module__.startswith("torch")


def layout(tensors: Sequence[tuple[str, Any]]) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """group -> (dtype, shape of one block's slice) of each of its tensors, in order."""
    out: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for g, t in tensors:
        shape = tuple(int(x) for x in t.shape)
        out.setdefault(g, []).append((str(t.dtype).removeprefix("torch."), shape[:1] + shape[2:]))
    return out


def block_bytes(lay: dict[str, list[tuple[str, tuple[int, ...]]]]) -> dict[str, int]:
    """group -> bytes of one block's payload."""
    return {g: sum(itemsize(d) * int(np.prod(s)) for d, s in ts) for g, ts in lay.items()}


def build_identity(manifest: Manifest, lay: dict, codec: str = "auto") -> bytes:
    """32 bytes naming what a block's bytes mean: the build's weights (the source's checksums and
    the weights file's size and form), model spec, KV spec (layout, dtype, block size, int8 scales)
    and the payload layout. Two builds share it only if their KV blocks are interchangeable."""
    kv = manifest.kv
    ident = {"source": manifest.source, "model": manifest.model.spec, "dtype": manifest.dtype,
             "kv": {"layout": kv.layout, "attention": kv.attention, "dtype": kv.dtype, "block_size": kv.block_size,
                    "num_layers": kv.num_layers, "num_kv_heads": kv.num_kv_heads, "head_dim": kv.head_dim,
                    "local_window": kv.local_window,
                    "scales": hashlib.sha256(json.dumps(kv.quantization, sort_keys=True).encode()).hexdigest()},
             # NOTE: the weights file's own checksum too: two builds of one source with the same sizes (another
             # kvexport's weight transform, a re-export) would otherwise swap KV blocks (a Dynamo prefill worker
             # of the other build: bench/dynamo_trial.py)
             "weights": {"bytes": manifest.weights.bytes, "precision": manifest.weights.precision,
                         "quantization": repr(manifest.weights.quantization), "sha256": manifest.weights.sha256},
             "graphs": {p: g.bytes for p, g in sorted(manifest.graphs.items())},
             "layout": {g: [[d, list(s)] for d, s in ts] for g, ts in sorted(lay.items())}}
    if codec != "auto":  # NOTE: only then: folders written at the pool's precision keep their identity
        ident["tier_dtype"] = codec
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).digest()


class _NumpyCopier:
    """Blocks of numpy pools (host memory): copies on the calling thread."""

    def __init__(self, backend, manifest: Manifest):
        self.backend, self.manifest = backend, manifest

    def _tensors(self, group: str) -> list:
        # NOTE: read every time: the reference-op backend replaces its pools each step
        return [t for g, t in block_tensors(self.backend, self.manifest) if g == group]

    def read(self, group: str, block_id: int) -> np.ndarray:
        parts = [np.ascontiguousarray(t[:, block_id]).reshape(-1).view(np.uint8) for t in self._tensors(group)]
        return np.concatenate(parts)

    def write(self, group: str, block_id: int, payload: np.ndarray) -> None:
        at = 0
        for t in self._tensors(group):
            view = t[:, block_id]  # in place: the pools are bound to the sessions by address
            n = view.size * view.itemsize
            view[...] = payload[at:at + n].view(t.dtype).reshape(view.shape)
            at += n
        assert at == payload.size, "a payload holds exactly one block of the group's tensors"

    def synchronize(self) -> None:
        pass


class _StateCopier:
    """Another copier (`inner`), plus the io.STATE_GROUP "blocks" of a hybrid build: checkpoint slots
    of its recurrent state pools (execution/state_store.py; host memory whatever the backend)."""

    def __init__(self, inner, store):
        self.inner, self.store = inner, store

    def read(self, group: str, block_id: int) -> np.ndarray:
        return self.store.read(block_id) if group == io.STATE_GROUP else self.inner.read(group, block_id)

    def write(self, group: str, block_id: int, payload: np.ndarray) -> None:
        if group == io.STATE_GROUP:
            self.store.write(block_id, payload)
        else:
            self.inner.write(group, block_id, payload)

    def synchronize(self) -> None:
        self.inner.synchronize()


class _TorchCopier:
    """Blocks of torch CUDA pools (TensorRT backend): device -> pinned host on a copy stream
    (`Tensor.copy_(non_blocking=True)` into `pin_memory()` buffers), host -> device the same way,
    with the backend's compute stream made to wait on the copies (`Stream.wait_stream`). Written
    against the documented torch CUDA API; not run here (no GPU)."""

    def __init__(self, backend, manifest: Manifest):
        import torch

        self.backend, self.manifest = backend, manifest
        self.copy_stream = torch.cuda.Stream()

    def _tensors(self, group: str) -> list:
        return [t for g, t in block_tensors(self.backend, self.manifest) if g == group]

    def read(self, group: str, block_id: int) -> np.ndarray:
        import torch

        ts = self._tensors(group)
        sizes = [t[:, block_id].numel() * t.element_size() for t in ts]
        host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
        self.copy_stream.wait_stream(self.backend.stream)  # the block's KV was written on the compute stream
        with torch.cuda.stream(self.copy_stream):
            at = 0
            for t, n in zip(ts, sizes):
                host[at:at + n].copy_(t[:, block_id].contiguous().view(-1).view(torch.uint8), non_blocking=True)
                at += n
        self.copy_stream.synchronize()  # NOTE: the block is reused by this step: its bytes must be out first
        return host.numpy()

    def write(self, group: str, block_id: int, payload: np.ndarray) -> None:
        import torch

        src = torch.from_numpy(payload).pin_memory()
        with torch.cuda.stream(self.copy_stream):
            at = 0
            for t in self._tensors(group):
                view = t[:, block_id]
                n = view.numel() * view.element_size()
                staged = src[at:at + n].to(t.device, non_blocking=True)
                view.copy_(staged.view(t.dtype).view(view.shape))
                at += n
        self.backend.stream.wait_stream(self.copy_stream)  # the step reads the block after the copy

    def synchronize(self) -> None:
        self.copy_stream.synchronize()


@dataclass
class OffloadStats:
    """Bytes moved per tier and load latency since start (the metrics: runtime/serving/metrics.py)."""

    host_write_bytes: int = 0  # pool -> host memory
    host_read_bytes: int = 0  # host memory -> pool
    disk_write_bytes: int = 0  # -> disk files
    disk_read_bytes: int = 0  # disk files -> staging (verified)
    load_seconds: float = 0.0  # copying tier hits into the pool + reading them from disk
    loads: int = 0  # blocks loaded into the pool
    disk_errors: int = 0  # corrupt, truncated or foreign block files, entries not regular files, torn temporary
    # files a killed process left (counted at start), reads too slow


class _CodecCopier:
    """Another copier (`inner`) whose blocks a tier holds encoded (kv_tier_codec.py: `--kv-offload-dtype int8`)."""

    def __init__(self, inner, codec):
        self.inner, self.codec = inner, codec

    def read(self, group: str, block_id: int) -> np.ndarray:
        return self.codec.encode(group, self.inner.read(group, block_id))

    def write(self, group: str, block_id: int, payload: np.ndarray) -> None:
        self.inner.write(group, block_id, self.codec.decode(group, payload))

    def synchronize(self) -> None:
        self.inner.synchronize()


class KVOffload:
    """The bytes of the host tier and staging area, the disk tier, and the copies (module doc).

    The host tier's budget is TierIndex's to enforce; `open_disk` adds the disk tier. `offload_dtype`: the
    precision the tiers hold blocks at (kv_tier_codec.py; "auto": the pool's)."""

    def __init__(self, backend, manifest: Manifest, offload_dtype: str = "auto"):
        tensors = block_tensors(backend, manifest)
        self.layout = layout(tensors)
        state = getattr(backend, "state", None)  # a hybrid's recurrent state pools: checkpoints move too
        if state is not None:
            self.layout[io.STATE_GROUP] = state.layout()
        self.offload_dtype = offload_dtype
        self.codec = codec = tier_codec(offload_dtype, self.layout)
        # group -> bytes of one block in a tier (encoded: kv_tier_codec.py)
        self.block_bytes = {g: codec.encoded_bytes(g, n) if codec else n for g, n in block_bytes(self.layout).items()}
        self.identity = build_identity(manifest, self.layout, offload_dtype)
        torch_pools = bool(tensors) and _is_torch(tensors[0][1])
        self.copier = _TorchCopier(backend, manifest) if torch_pools else _NumpyCopier(backend, manifest)
        if state is not None:
            self.copier = _StateCopier(self.copier, state)
        if codec is not None:
            self.copier = _CodecCopier(self.copier, codec)
        self.host: dict[TierKey, np.ndarray] = {}
        self.staged: dict[TierKey, np.ndarray] = {}
        self.stats = OffloadStats()
        self.disk: DiskTier | None = None
        self.disk_timeout_s = DISK_TIMEOUT_S  # seconds (module NOTE)
        self._disk_off: str | None = None  # why the disk tier turned off
        self._reported_off = False
        self._done: queue.Queue = queue.Queue()  # (kind, read id, key, payload | reason, seconds) from the I/O thread
        self._jobs: queue.Queue = queue.Queue()
        self._reads: dict[int, tuple[TierKey, float]] = {}  # prefetches not yet polled: id -> (key, deadline)
        self._read_id = 0
        self._busy: tuple[str, float] | None = None  # the I/O thread's job now: (kind, time.monotonic() at start)
        self._manifest = manifest

    def open_disk(self, folder: str | Path) -> None:
        """Use `folder` as the disk tier (kv_disk.DiskTier checks and locks it: ConfigError naming
        --kv-offload-dir) and start the I/O thread."""
        m = self._manifest
        describe = {"build": str(m.model.family), "kv_dtype": m.kv.dtype, "block_size": m.kv.block_size,
                    "tier_dtype": self.offload_dtype}
        self.disk = DiskTier(folder, self.identity, describe)
        self._thread = threading.Thread(target=self._io_loop, name="kvexport-kv-disk", daemon=True)
        self._thread.start()
        atexit.register(self.flush, 10.0)

    def disk_blocks(self) -> list[TierKey]:
        """The blocks on disk at start, least recently written first (TierIndex.add_disk_blocks);
        entries that are not block files, and the temporary files of writes a killed process never
        finished (torn files), are counted as disk errors."""
        if self.disk is None:
            return []
        found = [(g, k) for g, k, n in self.disk.scan() if g in self.block_bytes]
        self.stats.disk_errors += self.disk.bad_entries + self.disk.torn_files
        return found

    def close_disk(self, timeout_s: float = 10.0) -> None:
        """Stop using the disk tier (shutdown, after `flush`): later disk jobs are dropped, and the
        folder's lock is released once the jobs queued are done (at most `timeout_s`)."""
        if self.disk is None:
            return
        self.flush(timeout_s)
        if self._disk_off is None:
            self._disk_off = "closed"
            self._reported_off = True  # NOTE: not a fault: nothing to report
        self.disk.close()

    # ---- the step's ops ------------------------------------------------------------------
    def run(self, ops: Sequence[TierOp], *, newest_first: bool = False) -> None:
        """Carry out a step's transfers in order (kv_tiers.py module NOTE). `newest_first`: the
        disk writes among `ops` go from the most to the least recently used block (persistence),
        and their files are dated so, so a restart's index keeps that order."""
        stamp = time.time_ns() if newest_first else None
        for op in ops:
            key = (op.group, op.block_hash)
            mtime = None
            if stamp is not None and isinstance(op, (SaveBlock, MoveToDisk)):
                stamp -= 1_000  # one microsecond older than the block written before it
                mtime = stamp
            if isinstance(op, SaveBlock):
                payload = self.copier.read(op.group, op.block_id)
                if op.tier == HOST:
                    self.host[key] = payload
                    self.stats.host_write_bytes += payload.nbytes
                else:
                    self._submit(("write", key, payload, mtime))
            elif isinstance(op, MoveToDisk):
                payload = self.host.pop(key, None)
                if payload is not None:
                    self._submit(("write", key, payload, mtime))
            elif isinstance(op, DropBlock):
                if op.tier == HOST:
                    self.host.pop(key, None)
                elif op.tier == STAGED:
                    self.staged.pop(key, None)
                else:
                    self._submit(("remove", key, None, None))
            elif isinstance(op, Prefetch):
                self._read_id += 1
                self._reads[self._read_id] = (key, time.monotonic() + self.disk_timeout_s)
                self._submit(("read", key, None, self._read_id))
            else:
                assert isinstance(op, LoadBlock)
                t = time.perf_counter()
                payload = self.host[key] if op.tier == HOST else self.staged.pop(key)
                self.copier.write(op.group, op.block_id, payload)
                if op.tier == HOST:
                    self.stats.host_read_bytes += payload.nbytes
                self.stats.loads += 1
                self.stats.load_seconds += time.perf_counter() - t

    def poll(self, wait_s: float = 0.0) -> TierEvents:
        """Disk reads finished since the last poll (waiting up to `wait_s` for one when some are in
        flight: an engine with nothing else to do), failures (reads past `disk_timeout_s` among
        them), and the disk tier turning off (a disk job running past that limit turns it off)."""
        prefetched, failed = [], []
        block = wait_s > 0 and bool(self._reads)
        while True:
            try:
                kind, rid, key, value, seconds = self._done.get(timeout=wait_s) if block else self._done.get_nowait()
            except queue.Empty:
                break
            block = False
            if kind == "lost":  # a block written nowhere (kv_disk.CorruptBlock on write)
                failed.append(key)
                continue
            if self._reads.pop(rid, None) is None:
                continue  # NOTE: too late: already reported failed (timed out)
            self.stats.load_seconds += seconds
            if kind == "ok":
                self.staged[key] = value
                self.stats.disk_read_bytes += value.nbytes
                prefetched.append(key)
            else:
                failed.append(key)
        self._check_time(failed)
        off = None
        if self._disk_off is not None and not self._reported_off:
            off, self._reported_off = self._disk_off, True
        if not (prefetched or failed or off):
            return _NO_EVENTS
        return TierEvents(tuple(prefetched), tuple(failed), off)

    def _check_time(self, failed: list[TierKey]) -> None:
        """Reads past their deadline fail (counted as disk errors); a disk job running past the
        limit turns the disk tier off, and then every read in flight fails."""
        now, busy = time.monotonic(), self._busy
        if busy is not None and now - busy[1] > self.disk_timeout_s and self._disk_off is None:
            self._disk_off = (f"a disk {busy[0]} in {self.disk.root if self.disk else '?'} took more than "
                              f"{self.disk_timeout_s:g} s (the disk does not answer)")
            log.warning("the disk KV tier is off: %s; serving goes on without it", self._disk_off)
        for rid, (key, deadline) in list(self._reads.items()):
            if now > deadline or self._disk_off is not None:
                del self._reads[rid]
                self.stats.disk_errors += 1
                log.warning("disk KV tier: reading %s-%s took more than %g s; the block is recomputed", key[0],
                            key[1].hex(), self.disk_timeout_s)
                failed.append(key)

    @property
    def busy(self) -> bool:
        """Disk reads are in flight."""
        return bool(self._reads)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the disk writes queued so far are done (a restart then finds them); returns
        whether they all are. Gives up early when a disk job hangs past `disk_timeout_s`. Also runs
        at interpreter exit (a server stopping)."""
        end = time.monotonic() + timeout_s
        while self._jobs.unfinished_tasks and time.monotonic() < end:
            busy = self._busy
            if busy is not None and time.monotonic() - busy[1] > self.disk_timeout_s:
                log.warning("disk KV tier: a disk %s hangs; %d disk jobs left undone", busy[0],
                            self._jobs.unfinished_tasks)
                break
            time.sleep(0.005)
        return not self._jobs.unfinished_tasks

    # ---- the I/O thread -------------------------------------------------------------------------
    def _submit(self, job) -> None:
        if self.disk is None or (self._disk_off is not None and job[0] != "read"):
            return
        if self._disk_off is not None:  # NOTE: never left waiting: a read the tier cannot serve fails
            self._done.put(("failed", job[3], job[1], "the disk tier is off", 0.0))
            return
        self._jobs.put(job)

    def _io_loop(self) -> None:
        disk = self.disk
        assert disk is not None
        while True:
            job = self._jobs.get()
            self._busy = (job[0], time.monotonic())
            try:
                self._do(disk, *job)
            finally:
                self._busy = None
                self._jobs.task_done()

    def _do(self, disk: DiskTier, kind: str, gk: TierKey, payload, extra) -> None:
        group, key = gk
        try:
            if kind == "write":
                if self._disk_off is None:
                    self.stats.disk_write_bytes += disk.write(group, key, memoryview(payload), mtime_ns=extra)
            elif kind == "remove":
                disk.remove(group, key)
            else:
                t = time.perf_counter()
                data = np.frombuffer(disk.read(group, key), np.uint8)
                if data.size != self.block_bytes[group]:
                    disk.remove(group, key)
                    raise CorruptBlock(f"{group}-{key.hex()}: {data.size} bytes, a block has {self.block_bytes[group]}")
                self._done.put(("ok", extra, gk, data, time.perf_counter() - t))
        except DiskFull as e:
            self._disk_off = f"writing {disk.root} failed: {e}"
            log.warning("the disk KV tier is off: %s; serving goes on without it", self._disk_off)
        except CorruptBlock as e:
            self.stats.disk_errors += 1
            log.warning("disk KV tier: %s; the block is recomputed", e)
            self._done.put(("failed", extra, gk, str(e), 0.0) if kind == "read" else ("lost", None, gk, str(e), 0.0))
        except Exception as e:  # noqa: BLE001 - the I/O thread must survive anything a file does
            log.exception("disk KV tier: %s of %s failed", kind, key.hex())
            if kind == "read":
                self._done.put(("failed", extra, gk, str(e), 0.0))


_NO_EVENTS = TierEvents()
