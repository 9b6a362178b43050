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
`pack` lays loaded adapters side by side in those factors, one slot each. `read` and `pack` live in
src/kvexport/lora_adapters.py, which the runtime reads adapters with too (runtime/lora.py).
"""

from __future__ import annotations

from kvexport import io
from kvexport.errors import ConfigError, SourceError
from kvexport.lora_adapters import (CONFIG_FILE, WEIGHTS_FILE, LoraAdapter, ModuleLora, _refuse,  # noqa: F401
                                    module_rank, pack, read)

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
