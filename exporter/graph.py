"""Builds one decoder graph (prefill or decode, either layout) from a ModelSpec and the
model's canonical weights.

    input_ids ─> embed (× embed_scale) (+ learned positions) ─> [ layer ] x N ─> final norm ─> lm_head
        ─> (final soft-cap) ─> logits
    layer ("pre" norms; "post" puts the norm after attention / MLP instead, "sandwich" both):
        x ─> norm1 ─> qkv ─> (q/k norm) ─> rope of the layer's kind ─> attention (layout; the layer's
        window, scale, soft-cap) ─> o_proj ─> (post norm) ─(+x)─> norm2 ─> mlp ─> (post norm) ─(+)─>

Matmul weights are stored in the activation dtype; norms, RoPE and attention run in
float32 (as transformers upcasts them), so fp16 builds only halve the matmul traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvexport import io

from . import attention as attn
from . import gemma4, kv_int4, linear_attention, lora, mla, moe, short_conv
from .model_weights import LayerWeights, ModelWeights
from .onnx_builder import GraphBuilder, WeightStore, onnx_dtype
from .quantize import CHANNEL, QUANTIZED_EMBED, QUANTIZED_HEAD, QuantizedMatrix, stored_codes
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
    # int8 KV: [KV layers, 2 (key, value), kv_heads, head_dim] float32, a row per layer of spec.kv_layers
    # (every layer; a hybrid's attention layers, its linear layers hold no KV)
    kv_scales: np.ndarray | None = None
    # int4 KV: [KV layers, 2 (offset μ, channel scale s), kv_heads, head_dim] float32 (exporter/kv_int4.py
    # calibrate_transform), rows as kv_scales'; None: none
    kv_offsets: np.ndarray | None = None
    # quantized matmul weights by graph weight name (exporter/quantize.py); None: all in `dtype`
    qweights: dict[str, QuantizedMatrix] | None = None
    # paged: each layer's KV cache group (io.kv_groups) when the build has a local group; None: one group
    layer_groups: tuple[str, ...] | None = None
    # MoE layers (exporter/moe.py MOE_FORMS): "grouped" runs each expert on its tokens; "dense" every
    # expert on every token (measurement: bench/moe_speed.py)
    moe_form: str = "grouped"
    # paged: the prefill graph takes io.LOGITS_INDICES and returns the logits of those rows only
    # (speculative decoding's 1 + k rows, echo's prompt rows); False: builds made before it
    logits_indices: bool = False
    # paged: the graphs take io.OBSERVATION_LENS and return io.attention_scores(i) per KV layer
    # (importance eviction, runtime/core/importance.py); False: builds made before it
    scores: bool = False
    # paged: the graphs return io.HIDDEN_STATES at these layer boundaries (io.hidden_state_layers); (): none
    hidden_layers: tuple[int, ...] = ()
    # paged: the adapters the graphs take at serve time (exporter/lora.py serve_plan: io.LORA_INDEX); None: none
    lora_plan: dict | None = None


RopeTables = dict[str, tuple[np.ndarray, np.ndarray]]  # spec.ROPE_KINDS kind -> (cos, sin) [max_len, rot/2]


def rope_tables(spec: ModelSpec, inv_freq: torch.Tensor, scaling: float, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_len, rotary_dim / 2] from transformers' own inverse frequencies, computed
    the way its rotary embedding does (float32 outer product)."""
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq.float())  # [max_len, rot/2]
    return (freqs.cos() * scaling).numpy(), (freqs.sin() * scaling).numpy()


# RoPE kind -> the transformers layer type whose buffers hold it, for rotary embeddings that keep
# one set per layer type (gemma3: full_attention_inv_freq, sliding_attention_inv_freq)
HF_ROPE_LAYER_TYPE = {"global": "full_attention", "local": "sliding_attention"}


def model_rope_tables(spec: ModelSpec, rotary_emb, max_len: int) -> RopeTables:
    """The cos/sin tables of every RoPE kind the spec's layers use, from the transformers
    model's rotary embedding (`model.model.rotary_emb`) buffers."""
    tables: RopeTables = {}
    for kind in sorted({spec.rope_kind(i) for i in range(spec.num_layers)} - {"none"}):
        layer_type = HF_ROPE_LAYER_TYPE[kind]
        prefix = layer_type + "_"
        if getattr(rotary_emb, prefix + "inv_freq", None) is None:
            prefix, layer_type = "", None  # one set for all layers
        # NOTE: the short set: the buffers as initialized (`original_inv_freq`, which a forward
        # pass of a longrope model never overwrites; `inv_freq` may hold the long set after one)
        inv = getattr(rotary_emb, prefix + "original_inv_freq", None)
        inv = inv if inv is not None else getattr(rotary_emb, prefix + "inv_freq")
        scaling = float(getattr(rotary_emb, prefix + "attention_scaling"))
        tables[kind] = rope_tables(spec, inv, scaling, max_len)
        rope = spec.rope_local if kind == "local" else spec.rope
        if rope is not None and rope.rope_type == "longrope":
            # the long set, as transformers' dynamic_rope_update computes it (same attention factor)
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            kw = {"layer_type": layer_type} if layer_type else {}
            long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](rotary_emb.config, None,
                                                          seq_len=rope.original_max_positions + 1, **kw)
            tables[kind + "_long"] = rope_tables(spec, long_inv, scaling, max_len)
    return tables


class DecoderGraph:
    """Emits the nodes of one graph into a GraphBuilder."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights,
                 rope: RopeTables | tuple[np.ndarray, np.ndarray] | None, opts: GraphOptions, store: WeightStore):
        if isinstance(rope, tuple):  # one table: every RoPE layer's
            rope = {"global": rope}
        self.spec, self.w, self.rope, self.opts = spec, weights, rope or {}, opts
        self.b = GraphBuilder(f"kvexport_{opts.phase.value}", store)
        self.act = opts.dtype.numpy_name
        self.kv = opts.kv_dtype.numpy_name
        self.paged = opts.layout is io.KVLayout.PAGED
        mla_row = spec.mla.row_width if spec.mla is not None else None  # MLA: one latent pool per layer
        self.io = io.graph_io(layout=opts.layout, phase=opts.phase, num_layers=spec.num_layers,
                              num_kv_heads=1 if mla_row else spec.num_kv_heads, head_dim=mla_row or spec.head_dim,
                              vocab_size=spec.vocab_size, block_size=opts.block_size,
                              act_dtype=self.act, kv_dtype=self.kv, all_logits=opts.all_logits,
                              attention=opts.attention, layer_groups=opts.layer_groups, latent=mla_row is not None,
                              logits_indices=opts.logits_indices, **gemma4.graph_io_fields(spec, opts.kv_dtype),
                              **linear_attention.graph_io_fields(spec, opts),
                              scores=opts.scores, hidden_layers=opts.hidden_layers, hidden_size=spec.hidden_size,
                              lora=lora.graph_layers(opts.lora_plan))
        self._lora = {(i, m) for i, m, _, _ in lora.graph_layers(opts.lora_plan)}  # the (layer, module) pairs reached
        self.score_out: list[str] = []  # attention_scores of each KV layer, in graph_io's order
        self.kv_rows: dict[int, tuple[str, str]] = {}  # layer -> this step's float32 (k, v), for layers sharing it
        self.groups = opts.layer_groups or (io.FULL_GROUP,) * spec.num_layers
        self.plugin = self.paged and opts.attention is io.Attention.PLUGIN
        if (opts.kv_dtype is io.DType.INT8) != (opts.kv_scales is not None):
            raise ValueError("int8 KV needs kv_scales, and only int8 KV takes them")
        if opts.kv_offsets is not None and opts.kv_dtype is not io.DType.INT4:
            raise ValueError("only int4 KV takes kv_offsets")
        # layer -> its row of kv_scales / kv_offsets (calibrated per layer holding KV: a hybrid's attention layers)
        self.kv_row = {layer: r for r, layer in enumerate(spec.kv_layers)}
        for consts in (opts.kv_scales, opts.kv_offsets):
            if consts is not None and len(consts) != len(self.kv_row):
                raise ValueError(f"KV constants for {len(consts)} layers, {len(self.kv_row)} hold KV")
        self.qweights = opts.qweights or {}
        self._offsets: dict[str, tuple[str, int]] = {}  # dequantized weight -> (block offsets, block size)
        if self.qweights:
            self.b.opset = io.QDQ_OPSET

    # ---- weights -------------------------------------------------------------------
    def weight(self, name: str, arr: np.ndarray | None, dtype: str) -> str | None:
        """A weight converted once to `dtype`, stored once per build and shared by both graphs."""
        if arr is None:
            return None
        if name not in self.b.weights.arrays:
            self.b.weights.add(name, arr.astype(dtype, copy=False))
        return self.b.weight(name, self.b.weights.arrays[name])

    def matrix(self, name: str, arr: np.ndarray | None) -> str | None:
        """Matmul weights and biases run in the activation dtype; a quantized weight is its
        block-wise DequantizeLinear's output (the portable QDQ form MatMul consumes)."""
        if name in self.qweights:
            return self._dequantized(name, self.qweights[name])
        return self.weight(name, arr, self.act)

    def _dequantized(self, name: str, qm: QuantizedMatrix) -> str:
        """codes [K, N] int4/int8 ─> DequantizeLinear(axis=0, block_size=B) ─> [K, N] act dtype;
        per-channel codes (CHANNEL) ─> DequantizeLinear(axis=1, scale [N]) ─> [K, N].
        NOTE: onnxruntime fuses block-wise DQ -> MatMul into MatMulNBits; the per-channel int8
        form is rewritten at session load (runtime/execution/ort_quant.py); TensorRT reads both as
        weight-only quantization."""
        ins = self._codes(name, qm)
        if qm.block_size == CHANNEL:
            return self.b.op("DequantizeLinear", *ins, axis=1)  # [K, N]
        w = self.b.op("DequantizeLinear", *ins, axis=0, block_size=qm.block_size)  # [K, N]
        if qm.offset is not None:
            store = self.b.weights
            self._offsets[w] = (self.b.weight(name + ".offset", store.arrays[name + ".offset"]), qm.block_size)
        return w

    def _codes(self, name: str, qm: QuantizedMatrix) -> list[str]:
        """[codes, scales(, zero points)] of a quantized weight, stored once per build."""
        store = self.b.weights
        if name + ".q" not in store.arrays:
            codes, dt = stored_codes(qm.q, qm.bits)
            store.add(name + ".q", codes, (dt, qm.q.shape))
            per_channel = qm.block_size == CHANNEL  # per-axis DQ: scale (zero point) [N]
            scale = qm.scale[0] if per_channel else qm.scale
            store.add(name + ".scale", scale.astype(self.act))
            if qm.zero_point is not None:
                zpq = qm.zero_point[0] if per_channel else qm.zero_point
                zp, zdt = stored_codes(zpq, qm.bits)
                store.add(name + ".zero_point", zp, (zdt, zpq.shape))
            if qm.offset is not None:
                store.add(name + ".offset", qm.offset.astype(self.act))
        ins = [self.b.weight(name + ".q", store.arrays[name + ".q"]),
               self.b.weight(name + ".scale", store.arrays[name + ".scale"])]
        if qm.zero_point is not None:
            ins.append(self.b.weight(name + ".zero_point", store.arrays[name + ".zero_point"]))
        return ins

    def f32(self, name: str, arr: np.ndarray | None) -> str | None:
        """Norm weights and RoPE tables stay float32."""
        return self.weight(name, arr, "float32")

    # ---- building blocks -------------------------------------------------------------
    def linear(self, x: str, w: str, bias: str | None) -> str:
        """x [..., K] @ w [K, N] (+ bias). A weight with per-block offsets (GGUF Q4_1 minimums)
        adds them exactly as a second, 1/B-sized product of the input's block sums:

            x [T, K] ─> MatMul ones [K, K/B] ─> sums [T, K/B] ─> Gemm(sums, offset [K/B, N], C = x @ w) ─>
            (contiguous, x [B, S, K]: the sums ─> MatMul offset ─> Add)

        NOTE: two nodes per matmul where Reshape ─> ReduceSum ─> MatMul ─> Add took four; on the
        CPU a decode step is mostly per-node cost (docs/BENCHMARKS.md "Fewer nodes per step")."""
        b = self.b
        y = b.op("MatMul", x, w)
        if w in self._offsets:
            offset, block = self._offsets[w]
            k = b.weights.arrays[offset].shape[0] * block
            ones = np.kron(np.eye(k // block, dtype=self.act), np.ones((block, 1), self.act))  # [K, K/B]
            sums = b.op("MatMul", x, b.const(ones, self.act))
            y = b.op("Gemm", sums, offset, y) if self.paged else b.op("Add", y, b.op("MatMul", sums, offset))
        return b.op("Add", y, bias) if bias else y

    def lora(self, i: int, module: str, x: str, y: str) -> str:
        """y + layer i's `module` LoRA delta per token (exporter/lora.py graph_delta); y where no adapter reaches."""
        if (i, module) not in self._lora:
            return y
        return lora.graph_delta(self, i, module, x, y, lora.module_rank(self.opts.lora_plan, module))

    def norm(self, x: str, w: np.ndarray, bias: np.ndarray | None, name: str) -> str:
        """float32 normalization; returns the activation dtype."""
        return self.cast(self.norm_f32(self.cast(x, self.act, "float32"), w, bias, name), "float32", self.act)

    def norm_f32(self, x: str, w: np.ndarray, bias: np.ndarray | None, name: str) -> str:
        """Normalization over the last axis, float32 in and out (w already holds norm_offset)."""
        b = self.b
        wn, bn = self.f32(name + ".weight", w), self.f32(name + ".bias", bias)
        if self.spec.norm == "layernorm":
            return b.op("LayerNormalization", x, wn, bn, axis=-1, epsilon=self.spec.norm_eps)
        # x / sqrt(mean(x^2) + eps) * w — the pattern onnxruntime fuses to SimplifiedLayerNorm
        var = b.op("ReduceMean", b.op("Pow", x, b.const(2.0, "float32")), b.const([-1]), keepdims=1)
        y = b.op("Div", x, b.op("Sqrt", b.op("Add", var, b.const(self.spec.norm_eps, "float32"))))
        return b.op("Mul", y, wn)

    def softcap(self, x: str, cap: float | None, dtype: str) -> str:
        """cap * tanh(x / cap) (Gemma's soft-capping); x unchanged when cap is None."""
        if cap is None:
            return x
        b = self.b
        return b.op("Mul", b.op("Tanh", b.op("Div", x, b.const(cap, dtype))), b.const(cap, dtype))

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

    def cast(self, x: str, src: str, dst: str) -> str:
        return x if src == dst else self.b.op("Cast", x, to=onnx_dtype(dst))

    def rope_rows(self, cos: str, sin: str, spec: ModelSpec | None = None) -> tuple[str, str]:
        """A step's cos/sin [.., rot/2] as apply_rope takes them, once for every layer (of a
        kind: `spec` its layers' spec.layer_view where heads differ per layer):
        [.., 1, D] = [cos, cos, 1..] and [-sin, sin, 0..] (the dims past rot pass through)."""
        spec = spec or self.spec
        b, rot, d = self.b, spec.rotary_dim, spec.head_dim
        cos2 = b.op("Concat", cos, cos, axis=-1)
        sin2 = b.op("Concat", b.op("Neg", sin), sin, axis=-1)
        if rot < d:
            lead = [0] * (1 if self.paged else 2)
            pads = b.const(lead + [0] + lead + [d - rot])
            cos2 = b.op("Pad", cos2, pads, b.const(1.0, "float32"))
            sin2 = b.op("Pad", sin2, pads, b.const(0.0, "float32"))
        return tuple(b.op("Unsqueeze", c, b.const([-2])) for c in (cos2, sin2))

    def apply_rope(self, x: str, cos: str, sin: str, spec: ModelSpec | None = None) -> str:
        """x [..., heads, D] float32 rotated by rope_rows' cos/sin [..., 1, D]:
        x * cos + [x2, x1, x_pass] * sin, which is [x1 cos - x2 sin, x2 cos + x1 sin, x_pass]
        exactly (the same products and sums as rotate_half's form, in five nodes instead of eight)."""
        spec = spec or self.spec
        b, rot, d = self.b, spec.rotary_dim, spec.head_dim
        parts = b.op("Split", x, b.const([rot // 2, rot // 2] + ([d - rot] if rot < d else [])), axis=-1,
                     outputs=2 if rot == d else 3)
        swapped = b.op("Concat", parts[1], parts[0], *parts[2:], axis=-1)
        return b.op("Add", b.op("Mul", x, cos), b.op("Mul", swapped, sin))

    # ---- the graph -------------------------------------------------------------------
    def build(self):
        b, spec, o = self.b, self.spec, self.opts
        for t in self.io.inputs:
            b.input(t)
        pos = io.POSITIONS if self.paged else io.POSITION_IDS
        b.scope = "/embed"
        h = self.embed(io.INPUT_IDS)
        if spec.embed_scale is not None:  # in the activation dtype, as transformers scales it
            h = b.op("Mul", h, b.const(spec.embed_scale, self.act))
        ple = gemma4.per_layer_inputs(self, io.INPUT_IDS, h) if spec.per_layer_input else None  # [.., L, P]
        if spec.position == "learned":
            h = b.op("Add", h, b.op("Gather", self.matrix("model.embed_positions.weight", self.w.pos_embed), pos, axis=0))
        # cos/sin [.., 1, D] per RoPE kind the layers use ("global" keeps the old weight names)
        rope: dict[str, tuple[str, str]] = {}
        for kind in sorted({spec.rope_kind(i) for i in range(spec.num_layers)} - {"none"}):
            pre = "rope" if kind == "global" else f"rope.{kind}"
            cs = [b.op("Gather", self.f32(f"{pre}.{n}", t), pos, axis=0)
                  for n, t in zip(("cos", "sin"), self.rope[kind])]  # [.., rot/2]
            if kind + "_long" in self.rope:  # longrope: per sequence, the short or the long set
                omax = (spec.rope_local if kind == "local" else spec.rope).original_max_positions
                use_long = self.longrope_select(omax)
                cs = [b.op("Where", use_long, b.op("Gather", self.f32(f"{pre}.long.{n}", t), pos, axis=0), c)
                      for n, t, c in zip(("cos", "sin"), self.rope[kind + "_long"], cs)]
            first = next(i for i in range(spec.num_layers) if spec.rope_kind(i) == kind)
            rope[kind] = self.rope_rows(*cs, spec=spec.layer_view(first))  # [.., 1, D]
        # masks per distinct window (the plugin node reads the step's metadata itself)
        ctxs: dict[int | None, attn.AttnContext] = {}
        if not self.plugin:
            group_of = {spec.window(i): self.groups[i] for i in range(spec.num_layers)}  # one group per window
            for w in sorted(group_of, key=lambda w: w or 0):
                first = next(i for i in range(spec.num_layers) if spec.window(i) == w)
                # MLA: one latent "KV head"; else the window's layers' heads (Gemma 4: per layer type)
                shape = mla.context_shape(spec) if spec.mla is not None else spec.layer_view(first)
                ctxs[w] = (attn.paged_context(b, shape, o.block_size, w, group_of[w], kv_dtype=self.kv) if self.paged
                           else attn.contiguous_context(b, spec, w))

        kv_out: list[tuple[str, ...]] = []  # per layer its KV outputs, in graph_io's order
        # gated DeltaNet / short-conv layers (exporter/linear_attention.py, short_conv.py): their index tensors
        # (the conv's state comes first in a sequence's padded rows), their new states
        self.linear_ctx = linear_attention.context(self, spec.linear_attn) if spec.linear_attn is not None else None
        self.state_out: list[tuple[str, ...]] = []  # per state layer: (conv,) or (conv, recurrent)
        hidden: list[str] = []  # io.HIDDEN_STATES: the residual stream entering each listed layer, float32
        for i, lw in enumerate(self.w.layers):
            if i in o.hidden_layers:
                hidden.append(self.cast(h, self.act, "float32"))
            cos, sin = rope.get(spec.rope_kind(i), (None, None))
            h, kv = self.layer(i, lw, h, cos, sin, ctxs.get(spec.window(i)))
            if lw.extra is not None:  # Gemma 4: per-layer input, layer scalar
                h = gemma4.layer_tail(self, i, lw, h, ple)
            kv_out.append(kv)

        b.scope = "/lm_head"
        if spec.num_layers in o.hidden_layers:  # the final normed state of every token (the LM head's input)
            hidden.append(self.norm_f32(self.cast(h, self.act, "float32"), self.w.final_norm_w, self.w.final_norm_b,
                                        "model.norm"))
        h = self.select_logit_rows(h)
        h = self.norm(h, self.w.final_norm_w, self.w.final_norm_b, "model.norm")
        logits = self.softcap(self.lm_head(h), spec.final_softcap, self.act)
        outputs = iter(self.io.outputs)
        b.output(logits, next(outputs))
        for kv in kv_out:
            for t in kv:
                b.output(t, next(outputs))
        for st in self.state_out:  # after the KV outputs (kvexport/io.py "Recurrent state")
            for t in st:
                b.output(t, next(outputs))
        for t in self.score_out:  # importance eviction (GraphOptions.scores)
            b.output(t, next(outputs))
        if hidden:  # [T, hidden] each ─> [T, 1, hidden] ─> Concat ─> [T, boundaries, hidden]: the last output
            rows = [b.op("Unsqueeze", t, b.const([1])) for t in hidden]
            b.output(rows[0] if len(rows) == 1 else b.op("Concat", *rows, axis=1), next(outputs))
        return b

    def longrope_select(self, original_max: int) -> str:
        """Which rows take longrope's long factors: those of sequences that hold more than
        `original_max` tokens after this step (transformers' rule, max(position_ids) + 1 >
        original_max_position_embeddings, applied per sequence). Keys already in the cache keep
        the rotation they were stored with, as in transformers (docs/ARCHITECTURE.md "longrope").

            paged:      token t ─> its sequence s (query_start_loc) ─> seq_lens[s] > original_max   [T, 1]
            contiguous: row b ─> sum(attention_mask[b]) > original_max                              [B, 1, 1]
        """
        b = self.b
        if not self.paged:
            total = b.op("ReduceSum", io.ATTENTION_MASK, b.const([1]), keepdims=1)  # [B, 1]
            return b.op("Unsqueeze", b.op("Greater", total, b.const(original_max)), b.const([2]))  # [B, 1, 1]
        n_tok = b.op("Gather", b.op("Shape", io.INPUT_IDS), b.const(0), axis=0)
        tok = b.op("Unsqueeze", b.op("Range", b.const(0), n_tok, b.const(1)), b.const([1]))  # [T, 1]
        q_end = b.op("Unsqueeze", b.op("Slice", io.QUERY_START_LOC, b.const([1]),
                                       b.const([np.iinfo(np.int64).max])), b.const([0]))  # [1, S]
        seq = b.op("ReduceSum", b.op("Cast", b.op("GreaterOrEqual", tok, q_end), to=onnx_dtype("int64")),
                   b.const([1]), keepdims=0)  # [T]: sequences that end at or before t
        last = b.op("Sub", b.op("Gather", b.op("Shape", io.SEQ_LENS), b.const(0), axis=0), b.const(1))
        seq = b.op("Min", seq, last)  # NOTE: tokens past the last sequence (none today) read its flag
        long_seq = b.op("Greater", io.SEQ_LENS, b.const(original_max))  # [S]
        return b.op("Unsqueeze", b.op("Gather", long_seq, seq, axis=0), b.const([1]))  # [T, 1]

    def layer(self, i: int, lw: LayerWeights, x: str, cos, sin, ctx) -> tuple[str, tuple[str, ...]]:
        """One decoder layer: (its output, its KV outputs: key and value, or an MLA layer's latent)."""
        b, spec = self.b, self.spec
        b.scope = f"/layers.{i}"
        p = f"model.layers.{i}."
        pre = spec.norms_at(i) != "post"  # a hybrid's linear layers pre, its attention layers as the family's
        hn = self.norm(x, lw.ln1_w, lw.ln1_b, p + "input_layernorm") if pre else x
        if spec.mla is not None:  # multi-head latent attention: one latent pool (exporter/mla.py)
            a, kv = mla.attention(self, i, lw, hn, cos, sin, ctx)
        elif lw.linear is not None:  # gated DeltaNet or LFM2's short conv: state, no KV (their modules)
            mixer = short_conv if isinstance(lw.linear, short_conv.ShortConvWeights) else linear_attention
            a, state = mixer.layer(self, i, len(self.state_out), lw.linear, hn, self.linear_ctx, spec.linear_attn)
            self.state_out.append(state)
            kv = ()
        else:
            a, kv = self.attention(i, lw, hn, cos, sin, ctx)
        if lw.post_attn_w is not None:
            a = self.norm(a, lw.post_attn_w, None, p + "post_attn_norm")
        x = b.op("Add", x, a)
        hn = self.norm(x, lw.ln2_w, lw.ln2_b, p + "post_attention_layernorm") if pre else x
        m = self.mlp(i, lw, hn)
        if lw.post_mlp_w is not None:
            m = self.norm(m, lw.post_mlp_w, None, p + "post_mlp_norm")
        return b.op("Add", x, m), kv

    def mlp(self, i: int, lw: LayerWeights, hn: str) -> str:
        """The layer's MLP on its normed input: dense, or (lw.moe) the routed experts (exporter/moe.py)
        plus the shared expert(s) in the dense slots (× sigmoid(x @ shared_expert_gate) where it has one)."""
        b, spec = self.b, self.spec
        p = f"model.layers.{i}."
        routed = moe.moe_block(self, hn, i, lw.moe, self.opts.moe_form) if lw.moe is not None else None
        if lw.up_w is None:  # a sparse layer without shared experts
            return routed
        up = self.lora(i, "mlp.up", hn, self.linear(hn, self.matrix(p + "mlp.up.weight", lw.up_w),
                                                    self.matrix(p + "mlp.up.bias", lw.up_b)))
        if spec.gated_mlp:
            inter = lw.up_w.shape[1] // 2  # NOTE: the weight's, not the spec's: a shared expert has its own width
            gate, up = b.op("Split", up, b.const([inter, inter]), axis=-1, outputs=2)
            m = b.op("Mul", self.activation(gate), up)
        else:
            m = self.activation(up)
        m = self.lora(i, "mlp.down", m, self.linear(m, self.matrix(p + "mlp.down.weight", lw.down_w),
                                                    self.matrix(p + "mlp.down.bias", lw.down_b)))
        if routed is None:
            return m
        if lw.moe.shared_gate_w is not None:  # qwen2_moe: sigmoid(x @ gate [H, 1]) scales the shared expert
            gate = b.op("MatMul", hn, self.matrix(p + "mlp.shared_expert_gate.weight", lw.moe.shared_gate_w))
            m = b.op("Mul", b.op("Sigmoid", gate), m)
        return b.op("Add", routed, m)

    def attention(self, i: int, lw: LayerWeights, hn: str, cos, sin, ctx) -> tuple[str, tuple[str, str]]:
        """The layer's attention on its normed input, through o_proj: (output [.., hidden],
        its (key, value) outputs: this step's new rows, the updated pools, or the presents; none for
        a layer that reads another layer's KV, src (Gemma 4: exporter/gemma4.py, kvexport/io.py "Shared KV"))."""
        b, spec, src = self.b, self.spec.layer_view(i), self.spec.kv_source(i)
        p = f"model.layers.{i}."
        qkv = self.lora(i, "attn.qkv", hn, self.linear(hn, self.matrix(p + "attn.qkv.weight", lw.qkv_w),
                                                       self.matrix(p + "attn.qkv.bias", lw.qkv_b)))
        qkv = self.cast(qkv, self.act, "float32")
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        lead = [0] if self.paged else [0, 0]  # [T] or [B, S] leading axes
        if src != i:  # only q: k and v are those layer src made in this step (and its pools the cache)
            q = self.norm_f32(b.op("Reshape", qkv, b.const(lead + [h, d])), lw.q_norm_w, None, p + "attn.q_norm")
            q = self.apply_rope(q, cos, sin, spec) if cos is not None else q
            k, v = self.kv_rows[src]
        elif spec.qk_norm is None:  # q and k as one [.., H + kvH, D] through RoPE: half the nodes
            qk, v = b.op("Split", qkv, b.const([(h + kvh) * d, kvh * d]), axis=-1, outputs=2)
            qk = b.op("Reshape", qk, b.const(lead + [h + kvh, d]))
            if cos is not None:
                qk = self.apply_rope(qk, cos, sin, spec)
            q, k = b.op("Split", qk, b.const([h, kvh]), axis=-2, outputs=2)
        else:
            q, k, v = b.op("Split", qkv, b.const([h * d, kvh * d, kvh * d]), axis=-1, outputs=3)
            if spec.qk_norm == "all":  # olmo2: over all heads' q (k) at once, before the head split
                q = self.norm_f32(q, lw.q_norm_w, None, p + "attn.q_norm")
                k = self.norm_f32(k, lw.k_norm_w, None, p + "attn.k_norm")
            q = b.op("Reshape", q, b.const(lead + [h, d]))
            k = b.op("Reshape", k, b.const(lead + [kvh, d]))
            if spec.qk_norm == "head":  # qwen3, gemma3: per head, over head_dim
                q = self.norm_f32(q, lw.q_norm_w, None, p + "attn.q_norm")  # [.., H, D]
                k = self.norm_f32(k, lw.k_norm_w, None, p + "attn.k_norm")  # [.., kvH, D]
            if cos is not None:
                q, k = self.apply_rope(q, cos, sin, spec), self.apply_rope(k, cos, sin, spec)
        if src == i:
            v = b.op("Reshape", v, b.const(lead + [kvh, d]))
            v = gemma4.rms(self, v, None, "") if spec.v_norm else v  # Gemma 4: per head, no weight
            self.kv_rows[i] = (k, v)
        if self.opts.kv_offsets is not None:  # int4: (k - μ) / s and q * s, exact (kv_int4.py calibrate_transform)
            mu, sc = self.opts.kv_offsets[self.kv_row[i]].astype(np.float32)
            if mu.any():
                k = b.op("Sub", k, b.named_const(io.k_offset(i), mu))
            # NOTE: s's nodes even where s = 1 (exact: x / 1), as `kvexport calibrate` writes constants,
            # not nodes, and another text may give that layer channel scales
            k = b.op("Div", k, b.named_const(io.k_channel_scale(i), sc))
            q = b.op("Mul", q, b.named_const(io.q_channel_scale(i), np.repeat(sc, h // kvh, axis=0)))
        rotated = self.kv == "int4"  # NOTE: int4 KV stores q, k, v rotated (exporter/kv_int4.py hadamard)
        if rotated:  # after RoPE, in float32: q·kᵀ unchanged, the output rotated back below
            q, k, v = (kv_int4.rotate(b, t, d) for t in (q, k, v))
        scales = None
        if self.opts.kv_scales is not None:  # per channel [kvH, D]; per-head [kvH] broadcast to it
            row = self.opts.kv_scales[self.kv_row[i]]
            sc = np.broadcast_to(row.reshape(2, kvh, -1), (2, kvh, d)).astype(np.float32)
            scales = (b.named_const(io.k_scale(i), sc[0]), b.named_const(io.v_scale(i), sc[1]))
        if self.plugin:  # the node takes activation-dtype q/k/v, q unscaled (scale is an attribute)
            q, k, v = (self.cast(t, "float32", self.act) for t in (q, k, v))
            a, k_out, v_out = attn.plugin_attention(b, spec, i, q, k, v, block_size=self.opts.block_size,
                                                    kv_dtype=self.kv, scales=scales, group=self.groups[i],
                                                    sinks=lw.attn_sinks, reads=src,
                                                    scores=self.score_out if self.opts.scores and src == i else None)
            if rotated:  # [T, H, D]
                a = self.cast(kv_int4.rotate(b, self.cast(a, self.act, "float32"), d), "float32", self.act)
            a = b.op("Reshape", a, b.const([0, h * d]))  # [T, H*D]
        else:
            q = b.op("Mul", q, b.const(spec.scale, "float32"))
            if self.paged:
                a, k_out, v_out = attn.paged_attention(b, spec, src, ctx, q, k, v, kv_dtype=self.kv, scales=scales,
                                                     sinks=lw.attn_sinks,
                                                     scores=self.score_out if self.opts.scores and src == i else None)
            else:
                a, k_out, v_out = attn.contiguous_attention(b, spec, src, ctx, q, k, v,
                                                            has_past=self.opts.phase is io.Phase.DECODE,
                                                            kv_dtype=self.kv, scales=scales, sinks=lw.attn_sinks)
            if rotated:  # [.., H*D] -> per head, rotated back
                a = b.op("Reshape", kv_int4.rotate(b, b.op("Reshape", a, b.const(lead + [h, d])), d),
                         b.const(lead + [h * d]))
            a = self.cast(a, "float32", self.act)
        if lw.attn_gate_w is not None:  # Qwen3.5 / Qwen3-Next: the output × sigmoid(x @ gate) [.., H*D]
            a = b.op("Mul", a, b.op("Sigmoid", self.linear(hn, self.matrix(p + "attn.gate.weight", lw.attn_gate_w), None)))
        a = self.lora(i, "attn.o", a, self.linear(a, self.matrix(p + "attn.o.weight", lw.o_w),
                                                  self.matrix(p + "attn.o.bias", lw.o_b)))
        return a, ((k_out, v_out) if src == i else ())

    def select_logit_rows(self, h: str) -> str:
        """Keep only the rows whose logits are returned: those io.LOGITS_INDICES asks for (a
        paged prefill graph that takes it), else the last token of each sequence unless
        all_logits, or the decode graph where every row is a last token.

            h [T, hidden] ─> Gather(logits_indices [L]) ─> [L, hidden] ─> norm ─> lm_head ─> [L, vocab]
        """
        b = self.b
        if any(t.name == io.LOGITS_INDICES for t in self.io.inputs):
            return b.op("Gather", h, io.LOGITS_INDICES, axis=0)  # [L, hidden]
        if self.opts.all_logits or self.opts.phase is io.Phase.DECODE:
            return h
        if self.paged:
            last = b.op("Sub", b.op("Slice", io.QUERY_START_LOC, b.const([1]),
                                    b.const([np.iinfo(np.int64).max])), b.const(1))  # [S]
            return b.op("Gather", h, last, axis=0)  # [S, hidden]
        return b.op("Slice", h, b.const([-1]), b.const([np.iinfo(np.int64).max]), b.const([1]))  # [B, 1, hidden]

    def embed(self, ids: str) -> str:
        """Token embeddings [..., hidden]. In quantized builds the rows are read from int8 codes
        [hidden, vocab] (QUANTIZED_EMBED: tied, the head's under a second name, the same bytes):

            codes, scales ─> Gather(axis=1) ─> DequantizeLinear(axis=0) [hidden, ...] ─> Transpose
            per-channel:     Gather(axis=1) ─> Cast × Gather(scale [vocab]) [hidden, ...] ─> Transpose
        """
        b = self.b
        qm = self.qweights.get(QUANTIZED_HEAD if self.spec.tie_embeddings else QUANTIZED_EMBED)
        if qm is None:
            return b.op("Gather", self.matrix("model.embed_tokens.weight", self.w.embed), ids, axis=0)
        # NOTE: the codes under a second name: onnxruntime fuses DQ -> MatMul into MatMulNBits only
        # when the codes feed nothing else (shared with this Gather, the head was dequantized in full
        # on every step). The alias shares the head's bytes in the weights file (WeightStore.alias):
        # Qwen2.5-0.5B's int4 file held its 151936 x 896 table twice (0.36x of fp32)
        if self.spec.tie_embeddings:
            self._codes(QUANTIZED_HEAD, qm)
            for part in (".q", ".scale"):
                self.b.weights.alias(QUANTIZED_EMBED + part, QUANTIZED_HEAD + part)
        codes, scales = self._codes(QUANTIZED_EMBED, qm)[:2]  # symmetric int8: no zero point
        q = b.op("Gather", codes, ids, axis=1)  # [hidden, ...ids]
        rank = 1 if self.paged else 2
        if qm.block_size == CHANNEL:
            s = b.op("Gather", scales, ids, axis=0)  # [...ids]
            w = b.op("Mul", self.cast(q, "int8", self.act), s)  # [hidden, ...ids]
        else:
            s = b.op("Gather", scales, ids, axis=1)  # [hidden / B, ...ids]
            w = b.op("DequantizeLinear", q, s, axis=0, block_size=qm.block_size)  # [hidden, ...ids]
        return b.op("Transpose", w, perm=list(range(1, rank + 1)) + [0])  # [...ids, hidden]

    def lm_head(self, h: str) -> str:
        """[..., hidden] -> [..., vocab] with Gemm(transB) so a tied head reuses the embedding;
        a quantized head (its own [hidden, vocab] codes, QUANTIZED_HEAD) is a linear."""
        b = self.b
        if QUANTIZED_HEAD in self.qweights:
            return self.linear(h, self.matrix(QUANTIZED_HEAD, None), None)
        name = "model.embed_tokens.weight" if self.spec.tie_embeddings else "lm_head.weight"
        w = self.matrix(name, self.w.lm_head)
        if self.paged:
            return b.op("Gemm", h, w, transB=1)
        flat = b.op("Reshape", h, b.const([-1, self.spec.hidden_size]))
        logits = b.op("Gemm", flat, w, transB=1)
        shape = b.op("Concat", b.op("Slice", b.op("Shape", h), b.const([0]), b.const([2])),
                     b.const([self.spec.vocab_size]), axis=0)
        return b.op("Reshape", logits, shape)
