"""PEFT LoRA adapters: a folder read and checked (`read`), and merged into the transformers model before the
graphs are built from it (`merge_into`: `kvexport build MODEL --lora PATH`, one adapter's fast path).

    adapter_config.json ──checks──> LoraAdapter (ranks, scales, targets)
    adapter_model.safetensors ──────┘        │
    transformers model ──W += s · B @ A per adapted module──> the build's weights and validation reference

What a PEFT LoRA folder may say, and what is read (peft 0.21's LoraConfig names):
- `r`, `lora_alpha`, `use_rslora` (scale alpha/√r instead of alpha/r), `rank_pattern` / `alpha_pattern` (a module's
  own rank / alpha: the first key that matches the end of its name, as peft's `get_pattern_key`), `target_modules`
  (names or a regex: the modules adapted are those the weights file holds, checked against the model),
  `fan_in_fan_out` (weights stored [in, out], as gpt2's Conv1D: must agree with the module's kind).
- Refused by name: another `peft_type`, `use_dora`, `bias` other than "none", `modules_to_save`,
  `trainable_token_indices`, `target_parameters` (MoE expert tensors), embedding adapters (`lora_embedding_A`),
  `lm_head` of a model whose head is tied to its embeddings, pickled weights (`adapter_model.bin`), a tensor whose
  module the model lacks or whose shape is not that module's (an adapter of another base model).

Merged exactly in float32: W' = W + s · B @ A (B [out, r], A [r, in]; transposed for fan_in_fan_out).

Serving adapters without merging (`kvexport build --lora-max-rank R [--lora-targets ...]`: kvexport/io.py
LORA_INDEX): `serve_plan` decides which graph matmuls take low-rank factors (the build's manifest records it) and
`pack` lays loaded adapters side by side in those factors, one slot each.
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


def read(path: str | Path) -> LoraAdapter:
    """The PEFT LoRA folder at `path`, checked (module docstring): ConfigError / SourceError naming the field."""
    d = Path(path)
    if not d.is_dir():
        raise SourceError(f"--lora {path}: no such folder; give a PEFT adapter folder ({CONFIG_FILE} + {WEIGHTS_FILE})")
    cfg_path = d / CONFIG_FILE
    if not cfg_path.is_file():
        raise SourceError(f"--lora {d} has no {CONFIG_FILE}: not a PEFT adapter folder (save it with "
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
        raise SourceError(f"--lora {d} has no {WEIGHTS_FILE}" + (
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
        found.setdefault(m["module"], {})[m["kind"]] = np.asarray(t, np.float32)
    missing = sorted(k for k, v in found.items() if len(v) != 2)
    if missing:
        raise SourceError(f"{weights}: module(s) {', '.join(missing[:3])} lack lora_A or lora_B; save it again")
    return {k: (v["lora_A"], v["lora_B"]) for k, v in found.items()}


def merge_into(model, adapter: LoraAdapter) -> None:
    """W += scale · B @ A for every adapted module of the transformers `model` (in place, float32). Checked
    first, nothing changed on a refusal: each module exists and is linear, its shape is the adapter's, and
    fan_in_fan_out agrees with how the module stores its weight."""
    import torch

    named = dict(model.named_modules())
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    updates = []
    for name, m in adapter.modules.items():
        module = named.get(name)
        if module is None:
            raise SourceError(f"--lora {adapter.path}: the adapter adapts {name}, which the model does not have "
                              f"(an adapter for another base model?)")
        if name.rsplit(".", 1)[-1] == "lm_head" and tied:
            raise SourceError(f"--lora {adapter.path}: the adapter adapts lm_head, which this model ties to its "
                              f"embeddings; an adapter that changes the head would change the embeddings too")
        w = getattr(module, "weight", None)
        conv1d = type(module).__name__ == "Conv1D"  # transformers' gpt2 linear: weight [in, out]
        if w is None or w.ndim != 2 or not (isinstance(module, torch.nn.Linear) or conv1d):
            raise SourceError(f"--lora {adapter.path}: {name} is a {type(module).__name__}, not a linear layer")
        if adapter.fan_in_fan_out != conv1d:
            raise _refuse(adapter.path, "fan_in_fan_out", adapter.fan_in_fan_out,
                          f"{name} stores its weight as {'[in, out]' if conv1d else '[out, in]'}")
        out_f, in_f = (w.shape[1], w.shape[0]) if conv1d else tuple(w.shape)
        if m.a.shape[1] != in_f or m.b.shape[0] != out_f:
            raise SourceError(f"--lora {adapter.path}: {name} is [{out_f} x {in_f}] in the model, but the adapter's "
                              f"lora_B @ lora_A is [{m.b.shape[0]} x {m.a.shape[1]}]: an adapter for another base "
                              f"model")
        delta = torch.from_numpy(m.b) @ torch.from_numpy(m.a) * m.scale  # [out, in]
        updates.append((w, delta.T if conv1d else delta))
    with torch.no_grad():
        for w, delta in updates:
            w += delta.to(w.dtype)


ALL_TARGETS = tuple(p for parts in io.LORA_MODULES.values() for p in parts)


def serve_plan(spec, max_rank: int, targets: str | None) -> dict:
    """The manifest's `lora` entry of a build that serves adapters: {"max_rank", "targets", "parts": {module:
    [[part, output offset, output width], ...] (targeted parts only, in column order)}, "layers": [[layer,
    module, in, out], ...]}. ConfigError for a family or a target it cannot serve."""
    if spec.moe is not None or spec.mla is not None or spec.linear_attn is not None or spec.per_layer_input:
        raise ConfigError(f"--lora-max-rank: serving adapters is not supported for {spec.family} (mixtures of "
                          f"experts, MLA, hybrids and Gemma 4 come later); dense families with q/k/v/o and "
                          f"gate/up/down projections are, or merge one adapter with --lora")
    from .families import FAMILIES, split_linear_weights

    if FAMILIES[spec.family].weights is not split_linear_weights:
        raise ConfigError(f"--lora-max-rank: serving adapters is not supported for {spec.family} (its checkpoints "
                          f"fuse the projections); merge one adapter with --lora")
    chosen = tuple(t.strip() for t in (targets or ",".join(ALL_TARGETS)).split(",") if t.strip())
    unknown = [t for t in chosen if t not in ALL_TARGETS]
    if unknown or not chosen:
        raise ConfigError(f"--lora-targets {targets!r}: {unknown[0] if unknown else 'none given'} is not one of "
                          f"{', '.join(ALL_TARGETS)}")
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    widths = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": spec.hidden_size,
              "gate_proj": spec.intermediate_size, "up_proj": spec.intermediate_size, "down_proj": spec.hidden_size}
    fan_in = {"attn.qkv": spec.hidden_size, "attn.o": q, "mlp.up": spec.hidden_size, "mlp.down": spec.intermediate_size}
    parts, layers = {}, []
    for m, names in io.LORA_MODULES.items():
        offset, mine = 0, []
        for n in names:
            if n in chosen:
                mine.append([n, offset, widths[n]])
            offset += widths[n]
        if mine:
            parts[m] = mine
            layers += [[i, m, fan_in[m], offset] for i in range(spec.num_layers)]
    layers.sort()
    return {"max_rank": max_rank, "targets": [t for t in ALL_TARGETS if t in chosen], "parts": parts,
            "layers": layers}


def graph_layers(plan: dict | None) -> tuple[tuple[int, str, int, int], ...]:
    """The plan's (layer, module, in, out) matmuls, as io.graph_io takes them; () without a plan."""
    return tuple(tuple(x) for x in plan["layers"]) if plan else ()


def module_rank(plan: dict, module: str) -> int:
    """A module's rank in the graph: max_rank per targeted part fused into it."""
    return plan["max_rank"] * len(plan["parts"][module])


_MODULE = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


def pack(plan: dict, adapters: list[LoraAdapter], dtype=np.float32) -> dict[str, np.ndarray]:
    """The graph inputs lora_a / lora_b of every adapted matmul with `adapters` in slots 0.. (kvexport/io.py
    LORA_INDEX), each adapter's scale folded into B; SourceError naming the adapter and module it cannot take
    (a target the build does not adapt, a rank above its max_rank)."""
    r, slots = plan["max_rank"], len(adapters)
    where = {(m, part[0]): (k, part[1], part[2]) for m, parts in plan["parts"].items() for k, part in enumerate(parts)}
    module_of = {n: m for m, names in io.LORA_MODULES.items() for n in names}
    out = {}
    for i, m, fan_in, fan_out in plan["layers"]:
        rank = module_rank(plan, m)
        out[io.lora_a(i, m)] = np.zeros((fan_in, slots * rank), dtype)
        out[io.lora_b(i, m)] = np.zeros((slots * rank, fan_out), dtype)
    for s, adapter in enumerate(adapters):
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


def graph_delta(g, i: int, module: str, x: str, y: str, rank: int) -> str:
    """y + the LoRA delta of layer i's `module` for each token's adapter (kvexport/io.py LORA_INDEX), emitted
    into DecoderGraph `g` (exporter/graph.py):

        x [T, in] ─> MatMul lora_a [in, S·R] ─> [T, S, R] × (lora_index [T] == slot s) [T, S, 1] ─> [T, S·R]
          ─> MatMul lora_b [S·R, out] ─> (+ y) [T, out]           (S: the slots loaded, R: the module's rank)
    """
    from .onnx_builder import onnx_dtype

    b = g.b
    xa = b.op("MatMul", x, io.lora_a(i, module))  # [T, S·R]
    slots = b.op("Div", b.op("Gather", b.op("Shape", io.lora_a(i, module)), b.const(1), axis=0), b.const(rank))
    mask = b.op("Equal", b.op("Unsqueeze", io.LORA_INDEX, b.const([1])),
                b.op("Range", b.const(0), slots, b.const(1)))  # [T, S]
    mask = b.op("Unsqueeze", b.op("Cast", mask, to=onnx_dtype(g.act)), b.const([2]))  # [T, S, 1]
    xa = b.op("Reshape", b.op("Mul", b.op("Reshape", xa, b.const([0, -1, rank])), mask), b.const([0, -1]))
    return b.op("Add", y, b.op("MatMul", xa, io.lora_b(i, module)))
