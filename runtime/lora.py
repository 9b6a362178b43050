"""LoRA adapters at serve time (issue 44 step 3): the adapters `EngineConfig.lora_modules` names, read,
checked against the build and laid into slots once, at start (kvexport/lora_adapters.py `read`, `pack`), and
the name each request asks for (SamplingParams.lora) resolved to its slot.

    --lora-modules a=DIR,b=DIR ─▶ read each (PEFT folder) ─▶ pack(plan, [a, b]) ─▶ lora_a / lora_b
                                   slots 0, 1                                     bound once (backend)
    request lora "b" ─▶ slot 1 ─▶ Request.lora_slot ─▶ ScheduledRequest.lora_slot ─▶ each token's
                                                      io.LORA_INDEX (-1: the base model)

Every step carries all loaded adapters side by side (exporter/lora.py `graph_delta`: one GEMM per
factor whatever the mix), so requests of different adapters and of the base share one batch.

NOTE: an adapter's identity (its name and the sha256 of its weights) is part of each request's
prefix-cache salt (`salt`): a prompt's KV under one adapter is never served to another adapter or the
base, whose KV of the same tokens differs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvexport import io, lora_adapters
from kvexport.errors import ConfigError, KvExportError
from kvexport.manifest import Manifest

from .config import EngineConfig, parse_lora_modules
from .request_checks import RequestError

BASE_SLOT = -1  # io.LORA_INDEX of a token without an adapter


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    name: str  # what requests call it (lora_modules)
    path: Path  # its PEFT folder
    sha256: str  # of its weights file
    slot: int  # its slot in the factors (io.LORA_INDEX value)


class LoraAdapters:
    """The adapters an engine serves: names -> slots, and the graph inputs that hold them. Adapters may be added
    and removed while serving (`add`, `remove`: the engine thread, between steps; runtime loading, vLLM's
    /v1/load_lora_adapter): a removed adapter leaves a hole (zero factors) the next one added takes, so the slots
    of requests in flight never move. `names` may be read from any thread."""

    def __init__(self, adapters: tuple[LoadedAdapter, ...], factors: dict[str, np.ndarray],
                 read: tuple[lora_adapters.LoraAdapter, ...], plan: dict, dtype: np.dtype, max_loras: int):
        self.factors = factors
        self._slots: list[LoadedAdapter | None] = list(adapters)  # by slot; None: a hole
        self._read: list[lora_adapters.LoraAdapter | None] = list(read)  # each slot's adapter as read (packing)
        self._plan, self._dtype, self.max_loras = plan, dtype, max_loras
        self._by_name = {a.name: a for a in adapters}

    @property
    def adapters(self) -> tuple[LoadedAdapter, ...]:
        return tuple(a for a in self._slots if a is not None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)  # NOTE: a new dict is swapped in whole on add/remove: safe from any thread

    def add(self, name: str, adapter: lora_adapters.LoraAdapter) -> LoadedAdapter:
        """Serve `adapter` (read and checked: lora_adapters.read) as `name` from the next step on; returns it.
        ConfigError naming lora_name when the name is taken or max_loras adapters are loaded, lora_path when the
        build cannot take it. The factors are packed anew (the caller binds self.factors to the backend)."""
        if name in self._by_name:
            raise ConfigError(f"lora_name: an adapter named {name!r} is loaded; unload it first or pick another name")
        slot = next((i for i, a in enumerate(self._slots) if a is None), len(self._slots))
        if slot >= self.max_loras:
            raise ConfigError(f"lora_name: {self.max_loras} adapters are loaded (max_loras); unload one first")
        slots, read = list(self._slots), list(self._read)
        if slot == len(slots):
            slots.append(None)
            read.append(None)
        read[slot] = adapter
        try:
            factors = lora_adapters.pack(self._plan, read, self._dtype)
        except KvExportError as e:
            raise ConfigError(f"lora_path: {e}") from None
        loaded = slots[slot] = LoadedAdapter(name, adapter.path, adapter.sha256, slot)
        self._slots, self._read, self.factors = slots, read, factors
        self._by_name = {**self._by_name, name: loaded}
        return loaded

    def remove(self, name: str) -> LoadedAdapter:
        """Stop serving `name` (its slot becomes a hole of zero factors); the caller checks nothing runs under it
        and binds self.factors. KeyError for a name not loaded."""
        gone = self._by_name[name]
        self._by_name = {k: v for k, v in self._by_name.items() if k != name}
        self._slots[gone.slot], self._read[gone.slot] = None, None
        while self._slots and self._slots[-1] is None:  # NOTE: trailing holes dropped: every step computes each slot
            self._slots.pop()
            self._read.pop()
        self.factors = lora_adapters.pack(self._plan, self._read, self._dtype)
        return gone

    def slot(self, name: str | None) -> int:
        """The request's slot (BASE_SLOT for None); RequestError naming `lora` for a name not served."""
        if name is None:
            return BASE_SLOT
        adapter = self._by_name.get(name)
        if adapter is None:
            served = ", ".join(self.names) or "none (start the server with --lora-modules NAME=PATH)"
            raise RequestError(f"lora: no adapter {name!r} is loaded; the adapters served: {served}", "lora")
        return adapter.slot

    def salt(self, name: str | None, salt: str | None) -> str | None:
        """The request's prefix-cache salt with its adapter's identity folded in (module NOTE)."""
        if name is None:
            return salt
        a = self._by_name[name]
        return hashlib.sha256(f"lora\0{a.name}\0{a.sha256}\0{salt or ''}".encode()).hexdigest()


def load(build_dir: Path, manifest: Manifest, config: EngineConfig) -> LoraAdapters | None:
    """The adapters config.lora_modules names, packed for this build (None: none named and the build takes none;
    a build made with --lora-max-rank gets an empty set, to which adapters may be added while serving).
    ConfigError naming lora_modules for a build made without --lora-max-rank, an adapter that is not a PEFT LoRA
    folder, or one the build cannot take (a target it does not adapt, a rank above its max)."""
    named = parse_lora_modules(config.lora_modules)
    if not named and not (manifest.lora and config.backend == "onnxruntime"):
        return None
    if not manifest.lora:
        raise ConfigError(f"lora_modules: {build_dir} takes no adapters (built without --lora-max-rank); rebuild it "
                          f"with `kvexport build MODEL --lora-max-rank R`, or merge one adapter with --lora")
    if config.backend != "onnxruntime":
        raise ConfigError("lora_modules: adapters are served on the onnxruntime backend only (the TensorRT engines' "
                          "runtime does not bind them yet); give --backend onnxruntime")
    read, loaded = [], []
    for slot, (name, path) in enumerate(named.items()):
        try:
            adapter = lora_adapters.read(Path(path).expanduser(), what=f"lora_modules ({name})")
        except KvExportError as e:  # NOTE: named by the adapter's name too (its file errors name only the path)
            what = f"lora_modules ({name})"
            raise ConfigError(str(e) if what in str(e) else f"{what}: {e}") from None
        read.append(adapter)
        loaded.append(LoadedAdapter(name, adapter.path, adapter.sha256, slot))
    dtype = np.dtype(io.DType(manifest.dtype).numpy_name)
    try:
        factors = lora_adapters.pack(manifest.lora, read, dtype)
    except KvExportError as e:
        raise ConfigError(f"lora_modules: {e}") from None
    return LoraAdapters(tuple(loaded), factors, tuple(read), manifest.lora, dtype, config.max_loras)


__all__ = ["BASE_SLOT", "LoadedAdapter", "LoraAdapters", "load"]
