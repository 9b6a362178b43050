"""LFM2's short-conv layers (Liquid LFM2, model_type lfm2): the spec its config declares, one layer's
weights, the model's weights, and the layer's subgraph in standard ONNX ops, with its conv state as
explicit graph I/O (kvexport/io.py "Recurrent state": conv_state.{j} alone, no recurrent matrix).

LFM2 interleaves these layers with GQA attention layers (per-head RMSNorm of q and k, RoPE) per
`config.layer_types` ("conv" / "full_attention"); every layer has an RMSNorm before its mixer
(`operator_norm`) and before its SwiGLU MLP (`ffn_norm`; w1 gate, w3 up, w2 down), the model a final
`embedding_norm`. The attention layers keep the paged KV cache; a conv layer keeps, per sequence, its
conv's last K-1 inputs [K-1, hidden]. The runtime holds them in the hybrids' state pool
(runtime/core/state_pool.py), so prefix caching, the KV tiers and the disaggregated hand-off carry them
as they carry a gated DeltaNet's state.

The layer, as transformers' Lfm2ShortConv computes it (its double gate: B before the conv, C after)::

    x ─> [B | C | x] = x @ W_in (+ b_in)                           (in_proj: 3 × hidden)
    B ∘ x ─> causal depthwise conv (kernel K = conv_L_cache, the state's K-1 inputs first, + conv bias)
    C ∘ conv ─> out_proj (+ b_out)                                  (no activation anywhere)

The conv is the gated DeltaNet's (exporter/linear_attention.py causal_conv) without its silu; the
`plugin` builds write it in standard ops too (their attention layers take PagedAttention nodes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np

from kvexport import io
from kvexport.errors import ConfigError, UnsupportedModelError

from . import linear_attention
from .model_weights import LayerWeights, ModelWeights

CONV, FULL = "conv", "full_attention"  # LFM2's config.layer_types entries


@dataclass(frozen=True, slots=True)
class ShortConvSpec:
    """The short-conv layers of an LFM2 model (ModelSpec.linear_attn: the manifest's key the runtime's state
    pool reads for every state-holding layer; its "mixer" tells it apart from a gated DeltaNet's)."""

    KIND: ClassVar[str] = "short-conv (LFM2)"  # for messages and `kvexport plan`'s note

    layers: tuple[int, ...]  # the conv layers' indices, ascending; the others are full attention
    conv_dim: int  # channels of the conv (hidden_size), elements
    conv_kernel: int  # K (config conv_L_cache): the conv's taps; the conv state keeps K - 1 inputs
    conv_bias: bool  # in_proj, the conv and out_proj carry biases (config conv_bias)
    mixer: str = io.SHORT_CONV  # written to the manifest (io.state_dims reads it)

    def __post_init__(self) -> None:
        if self.mixer != io.SHORT_CONV:
            raise ConfigError(f"linear_attn mixer must be {io.SHORT_CONV!r}, got {self.mixer!r}")
        if isinstance(self.conv_dim, bool) or not isinstance(self.conv_dim, int) or self.conv_dim < 1:
            raise ConfigError(f"config field 'hidden_size' must be a positive integer, got {self.conv_dim!r}")
        if isinstance(self.conv_kernel, bool) or not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise UnsupportedModelError(f"config field 'conv_L_cache' is {self.conv_kernel!r}; kvexport supports an "
                                        f"integer >= 2 (a conv that keeps state)")
        if not isinstance(self.conv_bias, bool):
            raise ConfigError(f"config field 'conv_bias' must be true or false, got {self.conv_bias!r}")

    def state_dims(self) -> io.StateDims:
        return io.StateDims(conv_width=self.conv_kernel - 1, conv_dim=self.conv_dim)

    def matmul_shapes(self, hidden: int) -> list[tuple[int, int]]:
        """[K, N] of one conv layer's matmuls: in_proj (B | C | x) and out_proj."""
        return [(hidden, 3 * self.conv_dim), (self.conv_dim, hidden)]

    def float32_elements(self) -> int:
        """Elements of every conv layer's float32 tensors: conv taps [K, hidden] (and bias [hidden])."""
        return len(self.layers) * (self.conv_kernel + self.conv_bias) * self.conv_dim

    def bias_elements(self) -> int:
        """Elements of every conv layer's matmul biases (activation dtype): in_proj's and out_proj's."""
        return len(self.layers) * 4 * self.conv_dim if self.conv_bias else 0

    def to_json(self) -> dict:
        return {**asdict(self), "layers": list(self.layers)}

    @classmethod
    def from_json(cls, d: dict) -> "ShortConvSpec":
        return cls(**{**d, "layers": tuple(d["layers"])})


def ff_dim(config) -> int:
    """LFM2's MLP width exactly as transformers' Lfm2MLP computes it from intermediate_size: with
    block_auto_adjust_ff_dim, int(2/3 of it), then (block_ffn_dim_multiplier set) int(× it) rounded up to a
    multiple of block_multiple_of."""
    inter = getattr(config, "intermediate_size", None)
    if isinstance(inter, bool) or not isinstance(inter, int) or inter < 1:
        raise ConfigError(f"config field 'intermediate_size' must be a positive integer, got {inter!r}")
    if getattr(config, "block_auto_adjust_ff_dim", True):
        inter = int(2 * inter / 3)
        mult = getattr(config, "block_ffn_dim_multiplier", None)
        if mult is not None:
            of = getattr(config, "block_multiple_of", 256)
            if isinstance(of, bool) or not isinstance(of, int) or of < 1:
                raise ConfigError(f"config field 'block_multiple_of' must be a positive integer, got {of!r}")
            inter = int(mult * inter)
            inter = of * ((inter + of - 1) // of)
    if inter < 1:
        raise ConfigError(f"config fields 'intermediate_size' / 'block_ffn_dim_multiplier' give an MLP of {inter} "
                          f"channels (transformers' Lfm2MLP rule)")
    return inter


def read_fields(config) -> dict:
    """LFM2's spec fields beyond read_spec's (Family.extra_fields): the conv layers per config.layer_types,
    the MLP width (`ff_dim`), the norms' eps (config norm_eps) and the MLP's silu (fixed in its code).
    A layer type other than conv / full_attention, or no attention layer, is refused by name."""
    types = linear_attention.config_layer_types(config)
    for t in types:
        if t not in (CONV, FULL):
            raise UnsupportedModelError(f"config field 'layer_types' has {t!r}, which kvexport does not support in an "
                                        f"lfm2 model; supported values: {CONV}, {FULL}")
    layers = tuple(i for i, t in enumerate(types) if t == CONV)
    if len(layers) == len(types):
        raise UnsupportedModelError("config field 'layer_types' lists no full_attention layer; kvexport needs at "
                                    "least one (a hybrid's attention layers hold the paged KV cache)")
    eps = getattr(config, "norm_eps", None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ConfigError(f"config field 'norm_eps' must be a number > 0, got {eps!r}")
    spec = (ShortConvSpec(layers=layers, conv_dim=config.hidden_size, conv_kernel=getattr(config, "conv_L_cache", None),
                          conv_bias=getattr(config, "conv_bias", False)) if layers else None)
    return {"linear_attn": spec, "intermediate_size": ff_dim(config), "norm_eps": float(eps), "activation": "silu"}


# ---- weights ---------------------------------------------------------------------------------
@dataclass(slots=True)
class ShortConvWeights:
    """One short-conv layer, matmul weights [in, out]."""

    in_w: np.ndarray  # [hidden, 3 * hidden]: B | C | x
    in_b: np.ndarray | None  # [3 * hidden]
    conv_w: np.ndarray  # [K, hidden] float32: tap j multiplies the input K-1-j steps back (tap K-1: this token)
    conv_b: np.ndarray | None  # [hidden] float32
    out_w: np.ndarray  # [hidden, hidden]
    out_b: np.ndarray | None  # [hidden]


def read_weights(sd: dict[str, Any], prefix: str, sc: ShortConvSpec, np_: Any) -> ShortConvWeights:
    """Layer weights under `prefix` (model.layers.{i}.conv.): in_proj, conv (its [hidden, 1, K] taps), out_proj."""
    conv = np_(sd[prefix + "conv.weight"])
    if conv.shape != (sc.conv_dim, 1, sc.conv_kernel):
        raise ConfigError(f"weight {prefix}conv.weight is {list(conv.shape)}, but the config's hidden_size and "
                          f"conv_L_cache give [{sc.conv_dim}, 1, {sc.conv_kernel}]: inconsistent state dims")
    opt = lambda name: np_(sd[prefix + name]) if sc.conv_bias else None  # noqa: E731
    conv_b = opt("conv.bias")
    return ShortConvWeights(
        in_w=np.ascontiguousarray(np_(sd[prefix + "in_proj.weight"]).T), in_b=opt("in_proj.bias"),
        conv_w=np.ascontiguousarray(conv[:, 0, :].T.astype(np.float32)),
        conv_b=conv_b.astype(np.float32) if conv_b is not None else None,
        out_w=np.ascontiguousarray(np_(sd[prefix + "out_proj.weight"]).T), out_b=opt("out_proj.bias"))


def lfm2_weights(sd: dict, spec) -> ModelWeights:
    """LFM2 checkpoints (exporter/model_weights.py ModelWeights): conv layers (`read_weights`) or attention layers
    (q/k/v_proj, out_proj, per-head q_layernorm / k_layernorm), each with operator_norm before its mixer and
    ffn_norm before its SwiGLU feed_forward (w1 gate, w3 up, w2 down); the final norm is model.embedding_norm;
    lm_head tied to the embeddings unless the checkpoint has its own (and tie_word_embeddings is false)."""
    np_ = lambda t: t.detach().to("cpu").float().numpy()  # noqa: E731
    sc, inter = spec.linear_attn, spec.intermediate_size
    layers = []
    for i in range(spec.num_layers):
        p, f = f"model.layers.{i}.", f"model.layers.{i}.feed_forward."
        w1, w3 = np_(sd[f + "w1.weight"]), np_(sd[f + "w3.weight"])
        if w1.shape[0] != inter:
            raise ConfigError(f"weight {f}w1.weight has {w1.shape[0]} rows, but the config's intermediate_size and "
                              f"block_* fields give {inter} (transformers' Lfm2MLP rule): inconsistent MLP width")
        lw = LayerWeights(np_(sd[p + "operator_norm.weight"]), None, None, None, None, None,
                          np_(sd[p + "ffn_norm.weight"]), None,
                          np.ascontiguousarray(np.concatenate([w1, w3]).T), None,
                          np.ascontiguousarray(np_(sd[f + "w2.weight"]).T), None)
        if sc is not None and i in sc.layers:
            lw.linear = read_weights(sd, p + "conv.", sc, np_)
        else:
            a = p + "self_attn."
            lw.qkv_w = np.ascontiguousarray(np.concatenate([np_(sd[a + f"{x}_proj.weight"]) for x in "qkv"]).T)
            lw.o_w = np.ascontiguousarray(np_(sd[a + "out_proj.weight"]).T)
            lw.q_norm_w, lw.k_norm_w = np_(sd[a + "q_layernorm.weight"]), np_(sd[a + "k_layernorm.weight"])
        layers.append(lw)
    embed = np_(sd["model.embed_tokens.weight"])
    head = embed if spec.tie_embeddings or "lm_head.weight" not in sd else np_(sd["lm_head.weight"])
    return ModelWeights(embed, None, layers, np_(sd["model.embedding_norm.weight"]), None, head)


# ---- the graph -------------------------------------------------------------------------------
def layer(g, i: int, j: int, w: ShortConvWeights, hn: str, ctx: linear_attention.LinearContext,
          sc: ShortConvSpec) -> tuple[str, tuple[str]]:
    """Layer i (the j-th conv layer) on its normed input hn [T, hidden]: (output [T, hidden],
    (new conv state [S, K-1, hidden],)); the conv in float32.

        hn ─> in_proj ─> B, C, x [T, H] ─> B ∘ x ─> pad [S, L, H] ─> causal conv (+ bias) ─> unpad [T, H]
                            C ────────────────────────────────────────────────────────────> ∘ ─> out_proj
    """
    b = g.b
    b.scope = f"/layers.{i}/conv"
    p = f"model.layers.{i}.conv."
    h = sc.conv_dim
    proj = g.linear(hn, g.matrix(p + "in_proj.weight", w.in_w), g.matrix(p + "in_proj.bias", w.in_b))
    bb, cc, xx = b.op("Split", g.cast(proj, g.act, "float32"), b.const([h, h, h]), axis=-1, outputs=3)  # [T, H]
    bx = b.op("Gather", b.op("Mul", bb, xx), ctx.gather_idx, axis=0)  # [S*L, H]
    bx = b.op("Reshape", bx, b.op("Concat", ctx.pad_shape, b.const([h]), axis=0))  # [S, L, H]
    conv, new_conv = linear_attention.causal_conv(g, j, bx, p + "conv", w.conv_w, w.conv_b, ctx, silu=False)
    conv = b.op("Gather", b.op("Reshape", conv, b.const([-1, h])), ctx.unpad_idx, axis=0)  # [T, H]
    y = g.cast(b.op("Mul", cc, conv), "float32", g.act)
    return g.linear(y, g.matrix(p + "out_proj.weight", w.out_w), g.matrix(p + "out_proj.bias", w.out_b)), (new_conv,)
