"""PEFT LoRA adapters as the build and the runtime both read them (issue 44): a folder read and checked
(`read`: adapter_config.json and adapter_model.safetensors -> LoraAdapter), and adapters laid side by side
into the graph inputs of a build that serves them (`pack`: kvexport/io.py LORA_INDEX, lora_a / lora_b). The
exporter merges one adapter (exporter/lora.py `merge_into`) and plans the graphs (`serve_plan`); the
runtime loads the adapters it serves (runtime/lora.py). numpy and safetensors only.

What a PEFT LoRA folder may say, and what is read (peft 0.21's LoraConfig names): exporter/lora.py's
module docstring.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvexport import io
from kvexport.errors import ConfigError, SourceError
from kvexport.manifest import sha256

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# <module>.<kind>[.<adapter name>][.weight|.bias]: peft saves without the adapter name, loads either
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|"
                     r"lora_embedding_B|lora_magnitude_vector)(?:\.(?P<adapter>[^.]+))??(?:\.(?P<param>weight|bias))?$")


@dataclass(frozen=True, slots=True)
class ModuleLora:
    a: np.ndarray  # [r, in] float32
    b: np.ndarray  # [out, r] float32
    scale: float  # alpha / r, or alpha / sqrt(r) with use_rslora


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    path: Path  # the adapter folder
    sha256: str  # of its weights file
    rank: int  # the config's r (a module's own rank may differ: rank_pattern)
    alpha: float  # the config's lora_alpha
    use_rslora: bool
    fan_in_fan_out: bool
    modules: dict[str, ModuleLora]  # adapted module name (as the model names it) -> its low-rank pair

    @property
    def max_rank(self) -> int:
        return max(m.a.shape[0] for m in self.modules.values())

    def to_json(self) -> dict:
        return {"path": str(self.path), "sha256": self.sha256, "r": self.rank, "lora_alpha": self.alpha,
                "use_rslora": self.use_rslora, "max_rank": self.max_rank, "modules": len(self.modules),
                "targets": sorted({name.rsplit(".", 1)[-1] for name in self.modules})}


def _refuse(path: Path, field: str, value, why: str) -> ConfigError:
    return ConfigError(f"{CONFIG_FILE} field '{field}' of {path} is {value!r}: {why}")


def _pattern_value(pattern: dict, module: str, default):
    """peft's get_pattern_key: the first key matching the end of `module` ('(.*\\.)?KEY$'), else `default`."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read(path: str | Path, what: str = "--lora") -> LoraAdapter:
    """The PEFT LoRA folder at `path`, checked (exporter/lora.py's docstring says what is read): ConfigError /
    SourceError naming the field, and `what` (the option that gave the folder)."""
    d = Path(path)
    if not d.is_dir():
        raise SourceError(f"{what} {path}: no such folder; give a PEFT adapter folder ({CONFIG_FILE} + {WEIGHTS_FILE})")
    cfg_path = d / CONFIG_FILE
    if not cfg_path.is_file():
        raise SourceError(f"{what} {d} has no {CONFIG_FILE}: not a PEFT adapter folder (save it with "
                          f"peft's save_pretrained)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{cfg_path} is not valid JSON ({e}); save the adapter again") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_path} must hold a JSON object, got {type(cfg).__name__}")
    checks = [("peft_type", lambda v: v in (None, "LORA"), "only LoRA adapters are read"),
              ("use_dora", lambda v: not v, "DoRA's magnitude vectors are not supported; use a plain LoRA adapter"),
              ("bias", lambda v: v in (None, "none"), "adapters that train biases are not supported (bias: none)"),
              ("lora_bias", lambda v: not v, "a bias on lora_B is not supported"),
              ("modules_to_save", lambda v: not v, "fully trained modules beside the adapter are not supported"),
              ("trainable_token_indices", lambda v: not v, "trained embedding rows are not supported"),
              ("target_parameters", lambda v: not v, "adapters on raw parameters (MoE experts) are not supported"),
              ("layers_to_transform", lambda v: v is None, "read the layers from the weights file instead: save the "
                                                           "adapter without it")]
    for field, ok, why in checks:
        if not ok(cfg.get(field)):
            raise _refuse(d, field, cfg.get(field), why)
    rank, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    for field, v in (("r", rank), ("lora_alpha", alpha)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1 << 16:
            raise _refuse(d, field, v, "must be a positive number below 65536")
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    for field, pattern in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        if not isinstance(pattern, dict):
            raise _refuse(d, field, pattern, "must map module names to numbers")
        for key, v in pattern.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1 << 16:
                raise _refuse(d, f"{field}.{key}", v, "must be a positive number below 65536")
            try:
                re.compile(key)
            except re.error as e:
                raise _refuse(d, field, key, f"the key is not a regular expression ({e})") from None
    rslora, fan = bool(cfg.get("use_rslora", False)), bool(cfg.get("fan_in_fan_out", False))
    weights = d / WEIGHTS_FILE
    if not weights.is_file():
        pickled = d / "adapter_model.bin"
        raise SourceError(f"{what} {d} has no {WEIGHTS_FILE}" + (
            f"; its {pickled.name} is pickled (it can run code when loaded): save the adapter with "
            f"safe_serialization=True" if pickled.is_file() else ""))
    pairs = _pairs(weights)
    modules = {}
    for module, (a, b) in sorted(pairs.items()):
        r = a.shape[0]
        want = _pattern_value(rank_pattern, module, rank)
        if r != want or b.shape[1] != r:
            raise SourceError(f"{weights} module {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not "
                              f"of rank {want} (r / rank_pattern of {CONFIG_FILE}); save the adapter again")
        a_ = float(_pattern_value(alpha_pattern, module, alpha))
        modules[module] = ModuleLora(a, b, a_ / (r ** 0.5) if rslora else a_ / r)
    if not modules:
        raise SourceError(f"{weights} holds no lora_A / lora_B tensors; it is not a LoRA adapter's weights file")
    return LoraAdapter(d, sha256(weights), int(rank), float(alpha), rslora, fan, modules)


MAX_FACTOR = 65504.0  # the largest magnitude a LoRA factor's entry may have (float16's largest value)


def _pairs(weights: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="np") as st:
            tensors = {k: st.get_tensor(k) for k in st.keys()}
    except Exception as e:  # noqa: BLE001 - SafetensorError and OS errors alike
        raise SourceError(f"{weights} is not a readable safetensors file ({e}); save the adapter again") from None
    found: dict[str, dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        m = _TENSOR.match(key)
        if m is None:
            raise SourceError(f"{weights} holds {key!r}, which is not a LoRA tensor (lora_A / lora_B); "
                              f"adapters that save other tensors are not supported")
        if m["kind"] in ("lora_embedding_A", "lora_embedding_B"):
            raise SourceError(f"{weights} adapts the embedding {m['module']} ({key}); embedding adapters are "
                              f"not supported: train the adapter without it in target_modules")
        if m["kind"] == "lora_magnitude_vector":
            raise SourceError(f"{weights} holds DoRA magnitudes ({key}); DoRA is not supported")
        if m["param"] == "bias":
            raise SourceError(f"{weights} holds a LoRA bias ({key}); adapters with lora_bias are not supported")
        if t.ndim != 2:
            raise SourceError(f"{weights} tensor {key} is {t.ndim}-D; LoRA matrices are 2-D")
        t = np.asarray(t, np.float32)
        # NOTE: every step multiplies each token by every loaded adapter's factors and masks the others' results
        # with zeros (exporter/lora.py graph_delta): a NaN or an overflow in one adapter makes every request's
        # logits NaN, the base model's too. Bounded by float16's range, a product of the factors stays finite.
        if not np.isfinite(t).all():
            raise SourceError(f"{weights} tensor {key} holds NaN or infinity; the adapter is damaged: train or save "
                              f"it again")
        if t.size and float(np.abs(t).max()) > MAX_FACTOR:
            raise SourceError(f"{weights} tensor {key} holds {float(np.abs(t).max()):.3g}, beyond {MAX_FACTOR:g} "
                              f"(float16's range; no trained LoRA factor is this large): the adapter is damaged")
        found.setdefault(m["module"], {})[m["kind"]] = t
    missing = sorted(k for k, v in found.items() if len(v) != 2)
    if missing:
        raise SourceError(f"{weights}: module(s) {', '.join(missing[:3])} lack lora_A or lora_B; save it again")
    return {k: (v["lora_A"], v["lora_B"]) for k, v in found.items()}


def module_rank(plan: dict, module: str) -> int:
    """A module's rank in the graph: max_rank per targeted part fused into it."""
    return plan["max_rank"] * len(plan["parts"][module])


_MODULE = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


def pack(plan: dict, adapters: list[LoraAdapter | None], dtype=np.float32) -> dict[str, np.ndarray]:
    """The graph inputs lora_a / lora_b of every adapted matmul with `adapters` in slots 0.. (kvexport/io.py
    LORA_INDEX; None: an empty slot, zeros), each adapter's scale folded into B; SourceError naming the adapter
    and module it cannot take (a target the build does not adapt, a rank above its max_rank)."""
    r, slots = plan["max_rank"], len(adapters)
    where = {(m, part[0]): (k, part[1], part[2]) for m, parts in plan["parts"].items() for k, part in enumerate(parts)}
    module_of = {n: m for m, names in io.LORA_MODULES.items() for n in names}
    out = {}
    for i, m, fan_in, fan_out in plan["layers"]:
        rank = module_rank(plan, m)
        out[io.lora_a(i, m)] = np.zeros((fan_in, slots * rank), dtype)
        out[io.lora_b(i, m)] = np.zeros((slots * rank, fan_out), dtype)
    for s, adapter in enumerate(adapters):
        if adapter is None:  # an empty slot (an adapter unloaded while serving): zero factors
            continue
        for name, ml in adapter.modules.items():
            found = _MODULE.match(name)
            part = found[2] if found else None
            m = module_of.get(part)
            if found is None or m is None or (m, part) not in where:
                raise SourceError(f"adapter {adapter.path} adapts {name}, which this build does not take adapters "
                                  f"on (its targets: {', '.join(plan['targets'])}); rebuild with --lora-targets "
                                  f"naming {part or name}")
            if ml.a.shape[0] > r:
                raise SourceError(f"adapter {adapter.path}: {name} has rank {ml.a.shape[0]}, above the build's "
                                  f"--lora-max-rank {r}; rebuild with --lora-max-rank {ml.a.shape[0]} or more")
            k, offset, width = where[(m, part)]
            col = s * module_rank(plan, m) + k * r
            key = (io.lora_a(int(found[1]), m), io.lora_b(int(found[1]), m))
            if key[0] not in out:
                raise SourceError(f"adapter {adapter.path} adapts {name}: the build has no such layer")
            a, b = out[key[0]], out[key[1]]
            if ml.a.shape[1] != a.shape[0] or ml.b.shape[0] != width:
                raise SourceError(f"adapter {adapter.path}: {name} is [{ml.b.shape[0]} x {ml.a.shape[1]}], the build's "
                                  f"is [{width} x {a.shape[0]}]: an adapter for another base model")
            a[:, col:col + ml.a.shape[0]] = ml.a.T
            b[col:col + ml.a.shape[0], offset:offset + width] = ml.b.T * ml.scale
    return out


__all__ = ["CONFIG_FILE", "LoraAdapter", "ModuleLora", "WEIGHTS_FILE", "module_rank", "pack", "read"]
