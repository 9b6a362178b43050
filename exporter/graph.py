"""Builds one decoder graph (prefill or decode, either layout) from a ModelSpec and the
model's canonical weights.

    input_ids ─> embed (+ learned positions) ─> [ layer ] x N ─> final norm ─> lm_head ─> logits
    layer:  x ─> norm1 ─> qkv ─> rope ─> attention (layout) ─> o_proj ─(+x)─> norm2 ─> mlp ─(+)─>

Matmul weights are stored in the activation dtype; norms, RoPE and attention run in
float32 (as transformers upcasts them), so fp16 builds only halve the matmul traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvexport import io

from . import attention as attn
from .families import LayerWeights, ModelWeights
from .onnx_builder import GraphBuilder, WeightStore, onnx_dtype
from .spec import ModelSpec


@dataclass(frozen=True, slots=True)
class GraphOptions:
    layout: io.KVLayout
    phase: io.Phase
    dtype: io.DType  # weights/activations
    kv_dtype: io.DType
    block_size: int  # tokens per KV block (paged)
    max_seq_len: int  # longest context the build serves; sizes the RoPE tables
    all_logits: bool  # prefill returns logits for every token, not just the last
    attention: io.Attention = io.Attention.ONNX  # paged only: standard ops or PagedAttention nodes
    kv_scales: np.ndarray | None = None  # int8 KV: [layers, 2 (key, value), kv_heads] float32


def rope_tables(spec: ModelSpec, inv_freq: torch.Tensor, scaling: float, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_len, rotary_dim / 2] from transformers' own inverse frequencies, computed
    the way its rotary embedding does (float32 outer product)."""
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq.float())  # [max_len, rot/2]
    return (freqs.cos() * scaling).numpy(), (freqs.sin() * scaling).numpy()


class DecoderGraph:
    """Emits the nodes of one graph into a GraphBuilder."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, rope: tuple[np.ndarray, np.ndarray] | None,
                 opts: GraphOptions, store: WeightStore):
        self.spec, self.w, self.rope, self.opts = spec, weights, rope, opts
        self.b = GraphBuilder(f"kvexport_{opts.phase.value}", store)
        self.act = opts.dtype.numpy_name
        self.kv = opts.kv_dtype.numpy_name
        self.paged = opts.layout is io.KVLayout.PAGED
        self.io = io.graph_io(layout=opts.layout, phase=opts.phase, num_layers=spec.num_layers,
                              num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                              vocab_size=spec.vocab_size, block_size=opts.block_size,
                              act_dtype=self.act, kv_dtype=self.kv, all_logits=opts.all_logits,
                              attention=opts.attention)
        self.plugin = self.paged and opts.attention is io.Attention.PLUGIN
        if (opts.kv_dtype is io.DType.INT8) != (opts.kv_scales is not None):
            raise ValueError("int8 KV needs kv_scales, and only int8 KV takes them")

    # ---- weights -------------------------------------------------------------------
    def _weight(self, name: str, arr: np.ndarray | None, dtype: str) -> str | None:
        """A weight converted once to `dtype`, stored once per build and shared by both graphs."""
        if arr is None:
            return None
        if name not in self.b.weights.arrays:
            self.b.weights.add(name, arr.astype(dtype, copy=False))
        return self.b.weight(name, self.b.weights.arrays[name])

    def _mat(self, name: str, arr: np.ndarray | None) -> str | None:
        """Matmul weights and biases run in the activation dtype."""
        return self._weight(name, arr, self.act)

    def _f32(self, name: str, arr: np.ndarray | None) -> str | None:
        """Norm weights and RoPE tables stay float32."""
        return self._weight(name, arr, "float32")

    # ---- building blocks -------------------------------------------------------------
    def linear(self, x: str, w: str, bias: str | None) -> str:
        y = self.b.op("MatMul", x, w)
        return self.b.op("Add", y, bias) if bias else y

    def norm(self, x: str, w: np.ndarray, bias: np.ndarray | None, name: str) -> str:
        """float32 normalization; returns the activation dtype."""
        b = self.b
        x = self._to(x, self.act, "float32")
        wn, bn = self._f32(name + ".weight", w), self._f32(name + ".bias", bias)
        if self.spec.norm == "layernorm":
            y = b.op("LayerNormalization", x, wn, bn, axis=-1, epsilon=self.spec.norm_eps)
        else:  # x / sqrt(mean(x^2) + eps) * w — the pattern onnxruntime fuses to SimplifiedLayerNorm
            var = b.op("ReduceMean", b.op("Pow", x, b.const(2.0, "float32")), b.const([-1]), keepdims=1)
            y = b.op("Div", x, b.op("Sqrt", b.op("Add", var, b.const(self.spec.norm_eps, "float32"))))
            y = b.op("Mul", y, wn)
        return self._to(y, "float32", self.act)

    def activation(self, x: str) -> str:
        b, a = self.b, self.spec.activation
        if a == "silu":
            return b.op("Mul", x, b.op("Sigmoid", x))
        c = lambda v: b.const(v, self.act)  # noqa: E731
        if a == "gelu":
            erf = b.op("Erf", b.op("Div", x, c(np.sqrt(2.0))))
            return b.op("Mul", b.op("Mul", x, c(0.5)), b.op("Add", erf, c(1.0)))
        # tanh approximation (gelu_new, gelu_pytorch_tanh)
        inner = b.op("Add", x, b.op("Mul", b.op("Pow", x, c(3.0)), c(0.044715)))
        t = b.op("Tanh", b.op("Mul", inner, c(np.sqrt(2.0 / np.pi))))
        return b.op("Mul", b.op("Mul", x, c(0.5)), b.op("Add", t, c(1.0)))

    def _to(self, x: str, src: str, dst: str) -> str:
        return x if src == dst else self.b.op("Cast", x, to=onnx_dtype(dst))

    def apply_rope(self, x: str, cos: str, sin: str) -> str:
        """x [..., heads, D] float32; cos/sin broadcastable to [..., 1, rot/2]."""
        b, rot, d = self.b, self.spec.rotary_dim, self.spec.head_dim
        if rot < d:
            x_rot, x_pass = b.op("Split", x, b.const([rot, d - rot]), axis=-1, outputs=2)
        else:
            x_rot, x_pass = x, None
        x1, x2 = b.op("Split", x_rot, b.const([rot // 2, rot // 2]), axis=-1, outputs=2)
        y1 = b.op("Sub", b.op("Mul", x1, cos), b.op("Mul", x2, sin))
        y2 = b.op("Add", b.op("Mul", x2, cos), b.op("Mul", x1, sin))
        parts = [y1, y2] + ([x_pass] if x_pass else [])
        return b.op("Concat", *parts, axis=-1)

    # ---- the graph -------------------------------------------------------------------
    def build(self):
        b, spec, o = self.b, self.spec, self.opts
        for t in self.io.inputs:
            b.input(t)
        pos = io.POSITIONS if self.paged else io.POSITION_IDS
        b.scope = "/embed"
        h = b.op("Gather", self._mat("model.embed_tokens.weight", self.w.embed), io.INPUT_IDS, axis=0)
        if spec.position == "learned":
            h = b.op("Add", h, b.op("Gather", self._mat("model.embed_positions.weight", self.w.pos_embed), pos, axis=0))
            cos = sin = None
        else:
            cos_t, sin_t = self.rope
            cos = b.op("Unsqueeze", b.op("Gather", self._f32("rope.cos", cos_t), pos, axis=0), b.const([-2]))
            sin = b.op("Unsqueeze", b.op("Gather", self._f32("rope.sin", sin_t), pos, axis=0), b.const([-2]))
        if self.plugin:
            ctx = None  # the plugin node reads the step's metadata itself
        elif self.paged:
            ctx = attn.paged_context(b, spec, o.block_size)
        else:
            ctx = attn.contiguous_context(b, spec)

        kv_out: list[tuple[str, str]] = []
        for i, lw in enumerate(self.w.layers):
            h, k, v = self.layer(i, lw, h, cos, sin, ctx)
            kv_out.append((k, v))

        b.scope = "/lm_head"
        h = self.select_logit_rows(h)
        h = self.norm(h, self.w.final_norm_w, self.w.final_norm_b, "model.norm")
        logits = self.lm_head(h)
        outputs = iter(self.io.outputs)
        b.output(logits, next(outputs))
        for k, v in kv_out:
            b.output(k, next(outputs))
            b.output(v, next(outputs))
        return b

    def layer(self, i: int, lw: LayerWeights, x: str, cos, sin, ctx) -> tuple[str, str, str]:
        b, spec = self.b, self.spec
        b.scope = f"/layers.{i}"
        p = f"model.layers.{i}."
        hn = self.norm(x, lw.ln1_w, lw.ln1_b, p + "input_layernorm")
        qkv = self.linear(hn, self._mat(p + "attn.qkv.weight", lw.qkv_w), self._mat(p + "attn.qkv.bias", lw.qkv_b))
        qkv = self._to(qkv, self.act, "float32")
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q, k, v = b.op("Split", qkv, b.const([h * d, kvh * d, kvh * d]), axis=-1, outputs=3)
        lead = [0] if self.paged else [0, 0]  # [T] or [B, S] leading axes
        q = b.op("Reshape", q, b.const(lead + [h, d]))
        k = b.op("Reshape", k, b.const(lead + [kvh, d]))
        v = b.op("Reshape", v, b.const(lead + [kvh, d]))
        if cos is not None:
            q, k = self.apply_rope(q, cos, sin), self.apply_rope(k, cos, sin)
        scales = None
        if self.opts.kv_scales is not None:
            scales = (b.named_const(io.k_scale(i), self.opts.kv_scales[i, 0].astype(np.float32)),
                      b.named_const(io.v_scale(i), self.opts.kv_scales[i, 1].astype(np.float32)))
        if self.plugin:  # the node takes activation-dtype q/k/v, q unscaled (scale is an attribute)
            q, k, v = (self._to(t, "float32", self.act) for t in (q, k, v))
            a, k_out, v_out = attn.plugin_attention(b, spec, i, q, k, v, block_size=self.opts.block_size,
                                                    kv_dtype=self.kv, scales=scales)
            a = b.op("Reshape", a, b.const([0, h * d]))  # [T, H*D]
        else:
            q = b.op("Mul", q, b.const(1.0 / np.sqrt(d), "float32"))
            if self.paged:
                a, k_out, v_out = attn.paged_attention(b, spec, i, ctx, q, k, v, kv_dtype=self.kv, scales=scales)
            else:
                a, k_out, v_out = attn.contiguous_attention(b, spec, i, ctx, q, k, v,
                                                            has_past=self.opts.phase is io.Phase.DECODE,
                                                            kv_dtype=self.kv, scales=scales)
            a = self._to(a, "float32", self.act)
        a = self.linear(a, self._mat(p + "attn.o.weight", lw.o_w), self._mat(p + "attn.o.bias", lw.o_b))
        x = b.op("Add", x, a)
        hn = self.norm(x, lw.ln2_w, lw.ln2_b, p + "post_attention_layernorm")
        up = self.linear(hn, self._mat(p + "mlp.up.weight", lw.up_w), self._mat(p + "mlp.up.bias", lw.up_b))
        if spec.gated_mlp:
            inter = spec.intermediate_size
            gate, up = b.op("Split", up, b.const([inter, inter]), axis=-1, outputs=2)
            m = b.op("Mul", self.activation(gate), up)
        else:
            m = self.activation(up)
        m = self.linear(m, self._mat(p + "mlp.down.weight", lw.down_w), self._mat(p + "mlp.down.bias", lw.down_b))
        return b.op("Add", x, m), k_out, v_out

    def select_logit_rows(self, h: str) -> str:
        """Keep only the rows whose logits are returned (the last token of each sequence
        unless all_logits, or the decode graph where every row is a last token)."""
        b = self.b
        if self.opts.all_logits or self.opts.phase is io.Phase.DECODE:
            return h
        if self.paged:
            last = b.op("Sub", b.op("Slice", io.QUERY_START_LOC, b.const([1]),
                                    b.const([np.iinfo(np.int64).max])), b.const(1))  # [S]
            return b.op("Gather", h, last, axis=0)  # [S, hidden]
        return b.op("Slice", h, b.const([-1]), b.const([np.iinfo(np.int64).max]), b.const([1]))  # [B, 1, hidden]

    def lm_head(self, h: str) -> str:
        """[..., hidden] -> [..., vocab] with Gemm(transB) so a tied head reuses the embedding."""
        b = self.b
        name = "model.embed_tokens.weight" if self.spec.tie_embeddings else "lm_head.weight"
        w = self._mat(name, self.w.lm_head)
        if self.paged:
            return b.op("Gemm", h, w, transB=1)
        flat = b.op("Reshape", h, b.const([-1, self.spec.hidden_size]))
        logits = b.op("Gemm", flat, w, transB=1)
        shape = b.op("Concat", b.op("Slice", b.op("Shape", h), b.const([0]), b.const([2])),
                     b.const([self.spec.vocab_size]), axis=0)
        return b.op("Reshape", logits, shape)
