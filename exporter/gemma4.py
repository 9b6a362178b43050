"""Gemma 4 (transformers `gemma4_text`): what its layers add to the Gemma 3 decoder, read from the
config, the checkpoint and emitted into the graph from a few hooks of exporter/graph.py.

- KV shared across layers (`num_kv_shared_layers`): the last num_kv_shared_layers layers have no
  k/v projections; each reads the KV of the last earlier layer of its type (transformers'
  `kv_sharing_modes`: "store" writes, "reuse" reads). The spec says it as `kv_sources`; only the
  writing layers have pools, so a shared cache is held once (kvexport/io.py "Shared KV").
- `attention_k_eq_v`: full-attention layers have no v_proj; values are the key projection's
  output. NOTE: K and V then still differ where they are stored (keys pass k_norm and RoPE,
  values v_norm), so both pools are kept; the weights put k_proj in the value slot of qkv.
- per-layer input embeddings (PLE, `hidden_size_per_layer_input` P):
      ple   = (rms(embeds @ W_proj / sqrt(hidden)) * w_norm + E_ple[ids] * sqrt(P)) / sqrt(2)   [T, L, P]
      layer i, after its MLP:  x += norm(act(x @ gate_i) * ple[:, i] @ proj_i)
  and every layer ends with x *= layer_scalar_i.
- local (sliding) and global layers with their own KV heads / head_dim (`per_layer_config`) and
  RoPE (global: "proportional"); attention scale 1 (q/k norms); values RMS-normed without a weight.
Refused by name: the MoE block (`enable_moe_block`), bidirectional attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvexport.errors import ConfigError, UnsupportedModelError


@dataclass(slots=True)
class LayerExtras:
    """A Gemma 4 layer's weights beyond LayerWeights, matmuls [in, out]."""

    layer_scalar: float  # the layer's output is multiplied by it
    ple_gate_w: np.ndarray | None  # [hidden, P] per_layer_input_gate
    ple_proj_w: np.ndarray | None  # [P, hidden] per_layer_projection
    ple_norm_w: np.ndarray | None  # [hidden] post_per_layer_input_norm


@dataclass(slots=True)
class ModelExtras:
    """The model's per-layer input embedding tables (PLE)."""

    ple_embed: np.ndarray  # [vocab_per_layer, L * P] embed_tokens_per_layer
    ple_proj_w: np.ndarray  # [hidden, L * P] per_layer_model_projection
    ple_norm_w: np.ndarray  # [P] per_layer_projection_norm


def global_view(config):
    """A shallow copy of a gemma4_text config whose global head_dim / num_key_value_heads read as the
    local layers' (transformers refuses them on heterogeneous configs); read_fields reads each
    layer's from per_layer_config."""
    import copy

    view = copy.copy(config)
    if hasattr(type(view), "allow_global_per_layer_attribute_access"):
        view.allow_global_per_layer_attribute_access = True
    return view


def read_fields(config) -> dict[str, Any]:
    """The spec fields a gemma4_text config sets beyond the Gemma 3 ones (exporter/spec.py)."""
    if getattr(config, "enable_moe_block", False):
        raise UnsupportedModelError("config field 'enable_moe_block' is true for a gemma4_text model; kvexport "
                                    "does not export Gemma 4's MoE block yet (dense Gemma 4 models only)")
    n = int(config.num_hidden_layers)
    layers = [config.per_layer_config[i] for i in range(n)] if getattr(config, "per_layer_config", None) else None
    dims = tuple(int(c.head_dim) for c in layers) if layers else None
    kv_heads = tuple(int(c.num_key_value_heads) for c in layers) if layers else None
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if not isinstance(shared, int) or not 0 <= shared < n:
        raise ConfigError(f"config field 'num_kv_shared_layers' must be an integer in [0, {n}) "
                          f"(num_hidden_layers {n}; a first layer must write a KV cache), got {shared!r}")
    sources = None
    if shared:
        types, first = list(config.layer_types), n - shared
        last = {t: max(i for i in range(first) if types[i] == t) for t in set(types[:first])}
        missing = sorted(set(types[first:]) - set(last))
        if missing:
            raise ConfigError(f"config field 'num_kv_shared_layers' ({shared}) leaves no earlier "
                              f"{missing[0]} layer to share a KV cache with")
        sources = tuple(i if i < first else last[types[i]] for i in range(n))
    ple = getattr(config, "hidden_size_per_layer_input", 0) or None
    if ple is not None and getattr(config, "vocab_size_per_layer_input", config.vocab_size) < config.vocab_size:
        raise UnsupportedModelError(
            f"config field 'vocab_size_per_layer_input' ({config.vocab_size_per_layer_input}) is smaller than "
            f"vocab_size ({config.vocab_size}); kvexport needs a per-layer embedding row for every token")
    uniform = dims is not None and len(set(dims)) == 1 and len(set(kv_heads)) == 1
    return dict(layer_head_dims=None if uniform else dims, layer_kv_heads=None if uniform else kv_heads,
                kv_sources=sources, v_norm=True, per_layer_input=ple, attn_scale=1.0)


# ---- graph hooks (exporter/graph.py DecoderGraph) -----------------------------------------------
def rms(g, x: str, w: np.ndarray | None, name: str) -> str:
    """float32 x / sqrt(mean(x², last axis) + eps) (× w): Gemma 4's RMSNorm, w None for v_norm."""
    b = g.b
    var = b.op("ReduceMean", b.op("Mul", x, x), b.const([-1]), keepdims=1)
    y = b.op("Div", x, b.op("Sqrt", b.op("Add", var, b.const(g.spec.norm_eps, "float32"))))
    return y if w is None else b.op("Mul", y, g.f32(name, w))


def per_layer_inputs(g, ids: str, embeds: str) -> str:
    """The PLE rows of this step, float32 [.., L, P] (the module docstring):

        embeds ─> @ W_proj ─> × hidden^-1/2 ─> [.., L, P] ─> rms × w ─┐
        ids ─> Gather(E_ple) ─> × sqrt(P) ─> [.., L, P] ────────────(+)─> × 2^-1/2
    """
    b, spec, ex = g.b, g.spec, g.w.extra
    L, P = spec.num_layers, spec.per_layer_input
    lead = [0] if g.paged else [0, 0]
    proj = g.linear(embeds, g.matrix("model.per_layer_model_projection.weight", ex.ple_proj_w), None)
    proj = b.op("Mul", g.cast(proj, g.act, "float32"), b.const(spec.hidden_size ** -0.5, "float32"))
    proj = rms(g, b.op("Reshape", proj, b.const(lead + [L, P])), ex.ple_norm_w,
               "model.per_layer_projection_norm.weight")
    tok = b.op("Gather", g.matrix("model.embed_tokens_per_layer.weight", ex.ple_embed), ids, axis=0)
    tok = b.op("Mul", g.cast(b.op("Reshape", tok, b.const(lead + [L, P])), g.act, "float32"),
               b.const(float(P) ** 0.5, "float32"))
    return b.op("Mul", b.op("Add", proj, tok), b.const(2.0 ** -0.5, "float32"))  # [.., L, P]


def layer_tail(g, i: int, lw, x: str, ple: str | None) -> str:
    """After layer i's MLP: x += norm(act(x @ gate) * ple[.., i] @ proj) (PLE), then x *= layer_scalar."""
    b, ex = g.b, lw.extra
    p = f"model.layers.{i}."
    if ple is not None:
        gate = g.activation(g.linear(x, g.matrix(p + "per_layer_input_gate.weight", ex.ple_gate_w), None))
        row = b.op("Gather", ple, b.const(i), axis=-2)  # [.., P]
        m = b.op("Mul", gate, g.cast(row, "float32", g.act))
        m = g.linear(m, g.matrix(p + "per_layer_projection.weight", ex.ple_proj_w), None)
        m = g.cast(rms(g, g.cast(m, g.act, "float32"), ex.ple_norm_w, p + "post_per_layer_input_norm.weight"),
                   "float32", g.act)
        x = b.op("Add", x, m)
    if ex.layer_scalar != 1.0:
        x = b.op("Mul", x, b.const(ex.layer_scalar, g.act))
    return x


def kv_refusal(spec, kv_dtype: str) -> str | None:
    """Why a quantized KV form (exporter/kv_forms.py) cannot be built for `spec`, or None. NOTE:
    refused where layers share KV or differ in KV shape: calibration gives one scale shape for
    every layer, each writing its own cache (transformers' cache has no entries for sharing layers),
    and the sharing layers would have to adopt their source's scales / int4 key transform (not built)."""
    if spec.kv_sources is None and spec.layer_head_dims is None and spec.layer_kv_heads is None:
        return None
    field = "num_kv_shared_layers" if spec.kv_sources is not None else "per_layer_config"
    return (f"--kv-dtype {kv_dtype} is not implemented for a {spec.model_type} model whose layers share KV or differ "
            f"in KV shape (config field {field!r}); use --kv-dtype fp32 or fp16")


def graph_io_fields(spec, kv_dtype) -> dict[str, Any]:
    """io.graph_io's kv_layers / layer_dims for a spec whose layers share KV or differ in KV shape
    ({} otherwise); quantized KV refused as `kv_refusal` says (the build refuses it earlier)."""
    from kvexport import io

    out: dict[str, Any] = {}
    shaped = spec.layer_head_dims is not None or spec.layer_kv_heads is not None
    if kv_dtype in (io.DType.INT8, io.DType.INT4) and (why := kv_refusal(spec, kv_dtype.value)):
        raise UnsupportedModelError(why)
    if spec.kv_sources is not None:
        out["kv_layers"] = spec.kv_layers
    if shaped:
        out["layer_dims"] = tuple(spec.layer_kv_shape(i) for i in range(spec.num_layers))
    return out
