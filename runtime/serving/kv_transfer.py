"""Moving a sequence's KV bytes from a prefill worker to a decode worker through NIXL (NVIDIA's
Inference Xfer Library, the transfer layer Dynamo's vLLM / SGLang / TensorRT-LLM backends use),
host memory over its UCX backend. runtime/serving/dynamo_disagg.py decides which bytes; this
module only moves them.

    prefill worker                                         decode worker
    offer(room, payload)  registers the payload (DRAM),
      returns {agent, metadata, room, addr, size} ──(the prefill response's kv_transfer_params,
                                                     through the frontend)──▶ pull(offer, ranges)
                                                       add_remote_agent(metadata) (once per agent)
                                                       READ the ranges into a registered buffer
    poll(): the READ's notification (room) ◀────────── notification `room` (also sent when
      frees the room; expire(): rooms nobody pulled       nothing had to be read: done(offer))
      within timeout_s are freed too

One-sided: the decode side reads the prefill side's memory; the prefill side's CPU does nothing
but register the bytes and, on the notification, free them. On GPUs the same calls take VRAM
("VRAM" descriptors, GPUDirect RDMA over UCX); this module registers host memory only: kvexport's
onnxruntime pools are host memory, and a TensorRT pool's blocks are first copied to pinned host
buffers by execution/kv_offload.py's copier (so NIXL's GPU path is not exercised here).

`nixl` is the meta package (it picks nixl_cu12 / nixl_cu13); `nixl_cu12` alone also works (the
`dynamo` extra installs it: the meta package requires both CUDA variants' wheels).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from kvexport.errors import ConfigError

log = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "kvexport[dynamo]" (it carries nixl-cu12)'
PULL_TIMEOUT_S = 60.0  # longest one READ may take before the decode side gives up on it


def import_nixl():
    """NIXL's Python API (`nixl_agent`, `nixl_agent_config`), or a ConfigError saying how to install it."""
    errors = []
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            mod = __import__(name, fromlist=["nixl_agent"])
            return mod.nixl_agent, mod.nixl_agent_config
        except ImportError as e:  # NOTE: also a wheel whose CUDA libraries cannot load
            errors.append(f"{name}: {e}")
    raise ConfigError(f"disaggregated serving moves KV through NIXL, which is not installed ({'; '.join(errors)}): "
                      f"{INSTALL_HINT}")


@dataclass
class _Room:
    payload: np.ndarray
    handle: object  # the registration
    deadline: float  # time.monotonic() after which the room is freed unpulled


class NixlTransfer:
    """One NIXL agent (UCX backend) of a worker; `role` names it in the logs ("prefill", "decode")."""

    def __init__(self, role: str, timeout_s: float = 60.0):
        agent_cls, config_cls = import_nixl()
        self.name = f"kvexport-{role}-{uuid.uuid4().hex[:12]}"
        try:
            self.agent = agent_cls(self.name, config_cls(backends=["UCX"]))
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
            raise ConfigError(f"NIXL's UCX backend did not start: {e}") from None
        self.timeout_s = timeout_s  # how long an offered room waits to be pulled
        self._metadata = self.agent.get_agent_metadata()
        self._rooms: dict[str, _Room] = {}
        self._remotes: set[str] = set()  # agents this one read from (connected)
        # NOTE: every agent call holds it: the agent is made without NIXL's own locking
        # (NIXL_THREAD_SYNC_NONE, its default without a listener thread), and pulls run on worker
        # threads beside the event loop's offers and polls (so one pull at a time)
        self._lock = threading.RLock()
        self.pulled_bytes = 0  # decode side: bytes READ
        self.offered_bytes = 0  # prefill side: bytes registered for a pull
        self.expired = 0  # prefill side: rooms freed by the timeout, never pulled

    # ---- prefill side --------------------------------------------------------------------
    def offer(self, room: str, payload: np.ndarray) -> dict:
        """Register `payload` (1-D uint8, C-contiguous) for one pull; returns what the decode side
        needs to read it (JSON-able)."""
        assert payload.dtype == np.uint8 and payload.ndim == 1 and payload.flags.c_contiguous
        addr, size = int(payload.ctypes.data), int(payload.nbytes)
        with self._lock:
            handle = self.agent.register_memory([(addr, size, 0, room)], "DRAM") if size else None
            # NOTE: this registration's remote keys, and how to connect: a decode side that saw
            # this agent before merges them into what it knows (NIXL's partial metadata)
            md = self.agent.get_partial_agent_metadata(handle, True, ["UCX"]) if size else self._metadata
            self._rooms[room] = _Room(payload, handle, time.monotonic() + self.timeout_s)
            self.offered_bytes += size
        return {"agent": self.name, "metadata": base64.b64encode(md).decode("ascii"),
                "room": room, "addr": addr, "size": size}

    def poll(self) -> list[str]:
        """Free the rooms whose decode side said it is done (and those past their timeout);
        returns the rooms freed because they were pulled."""
        with self._lock:
            if not self._rooms:
                return []
            notes = self.agent.get_new_notifs()
            done = [m.decode("ascii", "replace") for msgs in notes.values() for m in msgs]
            freed = [r for r in done if self._free(r)]
            now = time.monotonic()
            for room in [r for r, v in self._rooms.items() if v.deadline < now]:
                log.warning("KV transfer %s: not pulled within %.0f s; its blocks are freed", room, self.timeout_s)
                self._free(room)
                self.expired += 1
            return freed

    @property
    def rooms(self) -> int:
        """Rooms offered and not yet pulled or expired."""
        return len(self._rooms)

    def _free(self, room: str) -> bool:
        r = self._rooms.pop(room, None)
        if r is None:
            return False
        if r.handle is not None:
            self.agent.deregister_memory(r.handle)
        return True

    # ---- decode side ---------------------------------------------------------------------
    def _remote(self, offer: dict) -> str:
        with self._lock:  # NOTE: every offer: its metadata names the memory registered for it
            name = self.agent.add_remote_agent(base64.b64decode(offer["metadata"]))
            self._remotes.add(name)
            return name

    def pull(self, offer: dict, ranges: list[tuple[int, int]]) -> np.ndarray:
        """READ the byte ranges (offset, length) of an offered payload, in order, into one new
        array; then tell the prefill side the room is done. Blocking (call it off the event loop).
        Raises RuntimeError when NIXL reports the transfer failed or it outlasts PULL_TIMEOUT_S."""
        remote = self._remote(offer)
        total = sum(n for _, n in ranges)
        out = np.empty(total, np.uint8)
        room = offer["room"].encode("ascii")
        if not total:
            self.done(offer)
            return out
        base = int(offer["addr"])
        for off, n in ranges:
            if off < 0 or n <= 0 or off + n > int(offer["size"]):
                raise RuntimeError(f"KV transfer {offer['room']}: range ({off}, {n}) outside the offered "
                                   f"{offer['size']} bytes")
        at, local, remote_descs = int(out.ctypes.data), [], []
        for off, n in ranges:
            local.append((at, n, 0))
            remote_descs.append((base + off, n, 0))
            at += n
        with self._lock:
            reg = self.agent.register_memory([(int(out.ctypes.data), total, 0, "")], "DRAM")
            try:
                handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                                    self.agent.get_xfer_descs(remote_descs, "DRAM"), remote, room)
                try:
                    state = self.agent.transfer(handle)
                    deadline = time.monotonic() + PULL_TIMEOUT_S
                    while state not in ("DONE", "ERR"):
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"KV transfer {offer['room']}: not done after {PULL_TIMEOUT_S:.0f} s")
                        time.sleep(0.0002)
                        state = self.agent.check_xfer_state(handle)
                    if state == "ERR":
                        raise RuntimeError(f"KV transfer {offer['room']}: NIXL reported an error reading from {remote}")
                finally:
                    self.agent.release_xfer_handle(handle)
            finally:
                self.agent.deregister_memory(reg)
        self.pulled_bytes += total
        return out

    def done(self, offer: dict) -> None:
        """Tell the prefill side its room is no longer needed (nothing was read from it)."""
        with self._lock:
            self.agent.send_notif(self._remote(offer), offer["room"].encode("ascii"))

    def close(self) -> None:
        """Free every room and disconnect from the agents read from, while the process still
        runs. NOTE: left to the interpreter's exit, the agent's teardown with live UCX
        connections hung the worker (seen with Dynamo's runtime stopping beside it)."""
        with self._lock:
            for room in list(self._rooms):
                self._free(room)
            for name in self._remotes:
                try:
                    self.agent.remove_remote_agent(name)
                except Exception as e:  # noqa: BLE001 - the other side may be gone already
                    log.debug("NIXL: disconnecting from %s: %s", name, e)
            self._remotes.clear()
