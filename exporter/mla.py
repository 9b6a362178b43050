"""Multi-head latent attention (DeepSeek-V2/V3) in the graph, in its absorbed form, and the
checkpoint reader of its weights.

Per layer the KV cache holds ONE latent row per token (kvexport/io.py "MLA"): the normed KV
latent c [L] and the RoPE-rotated key shared by every head k_rope [R]. W_UK (the key half of
kv_b_proj) is folded into the query and W_UV (its value half) applied after attention, so no
per-head K/V ever exists, in prefill or decode:

    hn ─> q_a_proj ─> q_a_layernorm ─> q_b_proj (or one q_proj) ─> [T, H, N | R]
           q_nope [T, H, N] ─(per head @ W_UK_h [N, L])─> q_lat [T, H, L] ┐
           q_rope [T, H, R] ─RoPE────────────────────────────────────────┴─> query [T, H, W] (× scale)
    hn ─> kv_a_proj_with_mqa ─> [c | k_rope] ─> kv_a_layernorm(c) | RoPE(k_rope) ─> latent [T, W]
    query, latent, latent pool ─> attention: softmax_j(q_h · row_j) · row_j[:L] ─> [T, H, L]
        (`onnx`: standard ops over the rows gathered through the block table; `plugin`: kvexport::PagedMLA)
    ─(per head @ W_UV_h [L, V])─> [T, H * V] ─> o_proj

Quantized weights (`--weights int8|int4`, round-to-nearest): q_proj (or q_a_proj and q_b_proj),
kv_a_proj_with_mqa and o_proj are plain 2-D matmuls and take the block-wise DequantizeLinear ->
MatMul form of every other family (`linears`); W_UK / W_UV stay float32 (`linears` NOTE says why).

NOTE: DeepSeek's RoPE pairs channels (2i, 2i+1) (V2's complex form; V3's rope_interleave). The
reader permutes the RoPE columns of q_b_proj / q_proj and kv_a_proj_with_mqa to evens then odds,
after which rotate-half RoPE gives the same q·k: V3's interleaved output is exactly that, V2's
the same values in a channel order both q and k share (scores are permutation-invariant).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvexport import io
from kvexport.errors import ConfigError

from .attention import from_kv, to_kv
from .limits import CALIBRATED_METHODS
from .onnx_builder import GraphBuilder
from .spec import ModelSpec


@dataclass(slots=True)
class MLAWeights:
    """One layer's attention weights, matmul weights [in, out]; RoPE columns de-interleaved."""

    q_w: np.ndarray | None  # [hidden, H * (N + R)] q_proj (q_lora_rank None)
    q_a_w: np.ndarray | None  # [hidden, q_lora_rank] q_a_proj
    q_a_b: np.ndarray | None  # [q_lora_rank] (attention_bias)
    q_a_norm_w: np.ndarray | None  # [q_lora_rank] q_a_layernorm
    q_b_w: np.ndarray | None  # [q_lora_rank, H * (N + R)] q_b_proj
    kv_a_w: np.ndarray  # [hidden, L + R] kv_a_proj_with_mqa
    kv_a_b: np.ndarray | None  # [L + R] (attention_bias)
    kv_norm_w: np.ndarray  # [L] kv_a_layernorm
    w_uk: np.ndarray  # [H, N, L] key half of kv_b_proj, per head
    w_uv: np.ndarray  # [H, L, V] value half of kv_b_proj, per head (transposed)


# graph weight name suffixes (model.layers.{i}.<suffix>.weight) of an MLA layer's plain 2-D matmuls
# other than o_proj (attn.o, quantize.LINEARS), and the MLAWeights field each holds
LINEARS = (("attn.q", "q_w"), ("attn.q_a", "q_a_w"), ("attn.q_b", "q_b_w"), ("attn.kv_a", "kv_a_w"))
# what an int8/int4 MLA build keeps in float32, and why (the manifest's weights.quantization.kept)
KEPT = {"MLA W_UK / W_UV (kv_b_proj)": "absorbed, they are per-head batched matmuls [H, N, L] / [H, L, V] that no "
                                       "quantized 2-D matmul serves (exporter/mla.py linears NOTE); 0.15% of "
                                       "DeepSeek-V3's parameters"}


def linears(layer: int, w: MLAWeights) -> dict[str, np.ndarray]:
    """Graph weight name -> float [K, N] of layer `layer`'s plain 2-D MLA matmuls (q_proj or
    q_a_proj + q_b_proj, kv_a_proj_with_mqa), quantized like any matmul (exporter/quantize.py
    float_linears; o_proj is the layer's attn.o there).

    NOTE: the two halves of kv_b_proj stay float32 in int8/int4 builds. Absorbed, they are not
    matmuls of the [T, K] @ [K, N] form the quantized path serves: W_UK folds into the query as a
    per-head batched MatMul [H, T, N] @ [H, N, L], W_UV the same after attention. onnxruntime fuses
    DequantizeLinear -> MatMul into MatMulNBits only for a 2-D weight (a 3-D one is dequantized in
    full on every step) and TensorRT's weight-only quantization is 2-D too; vLLM's MLA backend
    likewise dequantizes kv_b_proj and runs W_UK / W_UV as 16-bit bmm's. They are small: H * L *
    (N + V) per layer, 61 x 16.8M = 1.0B of DeepSeek-V3's 671B (0.15%; its routed experts ~97%).
    The MoE router stays float32 too (exporter/moe.py route, as transformers computes it): a
    rounded router changes which experts a token gets, not just their outputs, and it is
    hidden x experts per layer."""
    out = {}
    for suffix, field in LINEARS:
        arr = getattr(w, field)
        if arr is not None:  # q_proj, or q_a_proj + q_b_proj (q_lora_rank)
            out[f"model.layers.{layer}.{suffix}.weight"] = arr
    return out


def _deinterleave(w: np.ndarray, start: int, stride: int, rope: int, groups: int) -> np.ndarray:
    """Columns [g * stride + start, + rope) of each of `groups` groups reordered evens then odds."""
    w = w.copy()
    for g in range(groups):
        lo = g * stride + start
        block = w[:, lo:lo + rope]
        w[:, lo:lo + rope] = np.concatenate([block[:, 0::2], block[:, 1::2]], axis=1)
    return w


def read_weights(sd: dict, prefix: str, spec: ModelSpec, to_np) -> MLAWeights:
    """The attention weights under `prefix` (model.layers.{i}.self_attn.) of a DeepSeek checkpoint;
    `to_np`: tensor -> float32 numpy."""
    m = spec.mla
    assert m is not None
    h, n, r, v, lat = spec.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    opt = lambda k: to_np(sd[prefix + k]) if prefix + k in sd else None  # noqa: E731
    t = lambda k: np.ascontiguousarray(to_np(sd[prefix + k]).T)  # noqa: E731  [in, out]
    fix = (lambda w, start, stride, groups: _deinterleave(w, start, stride, r, groups)) if m.rope_interleave \
        else (lambda w, *_: w)
    q_w = q_a_w = q_a_b = q_a_norm_w = q_b_w = None
    if m.q_lora_rank is None:
        q_w = fix(t("q_proj.weight"), n, n + r, h)
    else:
        q_a_w, q_a_b = t("q_a_proj.weight"), opt("q_a_proj.bias")
        q_a_norm_w = to_np(sd[prefix + "q_a_layernorm.weight"])
        q_b_w = fix(t("q_b_proj.weight"), n, n + r, h)
    kv_a_w = fix(t("kv_a_proj_with_mqa.weight"), lat, lat + r, 1)
    kv_a_b = opt("kv_a_proj_with_mqa.bias")
    if kv_a_b is not None and m.rope_interleave:
        kv_a_b = _deinterleave(kv_a_b[None], lat, lat + r, r, 1)[0]
    kv_b = to_np(sd[prefix + "kv_b_proj.weight"]).reshape(h, n + v, lat)  # torch [out, in]
    return MLAWeights(q_w, q_a_w, q_a_b, q_a_norm_w, q_b_w, kv_a_w, kv_a_b,
                      to_np(sd[prefix + "kv_a_layernorm.weight"]),
                      np.ascontiguousarray(kv_b[:, :n, :]), np.ascontiguousarray(kv_b[:, n:, :].transpose(0, 2, 1)))


@dataclass(frozen=True, slots=True)
class _PoolShape:
    """What attention.paged_context reads of a spec, for the latent pool: one "KV head" of
    row-wide rows shared by all H query heads."""

    num_kv_heads: int
    group_size: int
    head_dim: int


def context_shape(spec: ModelSpec) -> _PoolShape:
    assert spec.mla is not None
    return _PoolShape(1, spec.num_heads, spec.mla.row_width)


def attention(dg, i: int, lw, hn: str, cos: str | None, sin: str | None, ctx) -> tuple[str, tuple[str]]:
    """One MLA layer's attention on its normed input `hn` [T, hidden] through o_proj (the
    module docstring): (output [T, hidden], (new_latent.{i} | latent_cache_out.{i},))."""
    b, spec = dg.b, dg.spec
    m, w = spec.mla, lw.mla
    h, n, r, lat, v = spec.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
    p = f"model.layers.{i}.attn."
    if m.q_lora_rank is None:
        q = dg.linear(hn, dg.matrix(p + "q.weight", w.q_w), None)
    else:
        qa = dg.linear(hn, dg.matrix(p + "q_a.weight", w.q_a_w), dg.matrix(p + "q_a.bias", w.q_a_b))
        qa = dg.norm(qa, w.q_a_norm_w, None, p + "q_a_norm")
        q = dg.linear(qa, dg.matrix(p + "q_b.weight", w.q_b_w), None)
    q = b.op("Reshape", dg.cast(q, dg.act, "float32"), b.const([0, h, n + r]))  # [T, H, N + R]
    q_nope, q_rope = b.op("Split", q, b.const([n, r]), axis=-1, outputs=2)
    # absorbed: q_lat_h = q_nope_h @ W_UK_h, per head as one batched MatMul
    q_lat = b.op("MatMul", b.op("Transpose", q_nope, perm=[1, 0, 2]), dg.f32(p + "w_uk", w.w_uk))  # [H, T, L]
    ckv = dg.linear(hn, dg.matrix(p + "kv_a.weight", w.kv_a_w), dg.matrix(p + "kv_a.bias", w.kv_a_b))
    c, k_rope = b.op("Split", dg.cast(ckv, dg.act, "float32"), b.const([lat, r]), axis=-1, outputs=2)
    c = dg.norm_f32(c, w.kv_norm_w, None, p + "kv_a_norm")  # [T, L]
    k_rope = b.op("Unsqueeze", k_rope, b.const([1]))  # [T, 1, R]
    if cos is not None:
        q_rope, k_rope = dg.apply_rope(q_rope, cos, sin), dg.apply_rope(k_rope, cos, sin)
    query = b.op("Concat", b.op("Transpose", q_lat, perm=[1, 0, 2]), q_rope, axis=-1)  # [T, H, W]
    latent = b.op("Concat", b.op("Unsqueeze", c, b.const([1])), k_rope, axis=-1)  # [T, 1, W]
    scale = None  # int8: static per-channel scales [W] (calibrate_latent)
    if dg.opts.kv_scales is not None:
        scale = b.named_const(io.latent_scale(i), np.asarray(dg.opts.kv_scales[i], np.float32).reshape(-1))
    if dg.plugin:
        out, kv = plugin_attention(b, spec, i, dg.cast(query, "float32", dg.act),
                                   dg.cast(b.op("Squeeze", latent, b.const([1])), "float32", dg.act),
                                   block_size=dg.opts.block_size, kv_dtype=dg.kv, scale=scale,
                                   scores=dg.score_out if dg.opts.scores else None)
        out = dg.cast(out, dg.act, "float32")  # [T, H, L]
    else:
        if dg.opts.scores:  # exporter/build.py scores_declared never asks it
            raise ValueError("MLA onnx attention does not return attention scores: build with --attention plugin")
        query = b.op("Mul", query, b.const(spec.scale, "float32"))
        out, kv = paged_attention(b, spec, i, ctx, query, latent, kv_dtype=dg.kv, scale=scale)  # [T, H, L]
    # W_UV after attention: [H, T, L] @ [H, L, V] -> [T, H * V]
    o = b.op("MatMul", b.op("Transpose", out, perm=[1, 0, 2]), dg.f32(p + "w_uv", w.w_uv))  # [H, T, V]
    o = b.op("Reshape", b.op("Transpose", o, perm=[1, 0, 2]), b.const([0, h * v]))  # [T, H*V]
    o = dg.linear(dg.cast(o, "float32", dg.act), dg.matrix(p + "o.weight", lw.o_w), dg.matrix(p + "o.bias", lw.o_b))
    return o, (kv,)


def paged_attention(b: GraphBuilder, spec: ModelSpec, layer: int, ctx, query: str, latent: str, *,
                    kv_dtype: str, scale: str | None = None) -> tuple[str, str]:
    """Absorbed attention over the latent pool with standard ops (exporter/attention.py's
    paged_attention with one KV head of W-wide rows whose first L channels are the values):

        query  [T, H, W] float32, scaled         latent [T, 1, W] float32 (this step's rows)
        pool   [1, S, Lc, W]  --row·qᵀ--> [1, S, Lc, H, Qmax]  (+cached_bias)
        step   [1, S, Qmax, W] -q·rowᵀ-> [1, S, H, Qmax, Qmax] (+bias)
        one softmax over both; out = p · row[:L]  ->  [T, H, L], new_latent [T, 1, W] in kv_dtype
    int8: rows are QuantizeLinear(x / scale) codes, read back as code * scale (`scale` [W])
    """
    if kv_dtype not in ("float32", "float16", "bfloat16", "int8"):
        raise ValueError(f"MLA onnx attention: kv dtype {kv_dtype} not implemented")
    m = spec.mla
    h, w, lat = spec.num_heads, m.row_width, m.kv_lora_rank
    scale = b.op("Unsqueeze", scale, b.const([0])) if scale is not None else None  # [1 "head", W]
    new = to_kv(b, latent, kv_dtype, scale, axis=1, heads=1)  # [T, 1, W] as stored
    idx = ctx.gather_idx
    q = b.op("Reshape", b.op("Gather", query, idx, axis=0), b.const([0, 0, 1, h, w]))  # [S, Qmax, 1, H, W]
    q5 = b.op("Transpose", q, perm=[2, 0, 3, 1, 4])  # [1, S, H, Qmax, W]
    q = b.op("Reshape", q5, b.const([1, 0, -1, w]))  # [1, S, H*Qmax, W]
    rows = b.op("Gather", io.latent_cache(layer), ctx.block_tables, axis=1)  # [1, S, B, bs, W]
    rows = from_kv(b, b.op("Reshape", rows, ctx.keys_shape, allowzero=1), kv_dtype, scale, axis=0, heads=1,
                   rank=4)  # [1, S, Lc, W]
    sc = b.op("MatMul", rows, b.op("Transpose", q, perm=[0, 1, 3, 2]))  # [1, S, Lc, H*Qmax]
    sc = b.op("Add", b.op("Reshape", sc, ctx.scores_shape, allowzero=1), ctx.cached_bias)  # [1, S, Lc, H, Qmax]
    kn = b.op("Gather", from_kv(b, new, kv_dtype, scale, axis=1, heads=1), idx, axis=0)  # [S, Qmax, 1, W]
    kn = b.op("Transpose", kn, perm=[2, 0, 1, 3])  # [1, S, Qmax, W]
    sn = b.op("Add", b.op("MatMul", q5, b.op("Unsqueeze", b.op("Transpose", kn, perm=[0, 1, 3, 2]), b.const([2]))),
              ctx.bias)  # [1, S, H, Qmax, Qmax]
    to_col = b.const([1, 0, h, -1, 1])
    mx = b.op("Max", b.op("Reshape", b.op("ReduceMax", sc, b.const([2]), keepdims=1), to_col),
              b.op("ReduceMax", sn, b.const([4]), keepdims=1))  # [1, S, H, Qmax, 1]
    ec = b.op("Exp", b.op("Sub", sc, b.op("Reshape", mx, b.const([1, 0, 1, h, -1]))))  # [1, S, Lc, H, Qmax]
    en = b.op("Exp", b.op("Sub", sn, mx))  # [1, S, H, Qmax, Qmax]
    denom = b.op("Add", b.op("Reshape", b.op("ReduceSum", ec, b.const([2]), keepdims=1), to_col),
                 b.op("ReduceSum", en, b.const([4]), keepdims=1))  # [1, S, H, Qmax, 1]
    values = lambda x: b.op("Slice", x, b.const([0]), b.const([lat]), b.const([-1]))  # noqa: E731  [.., L]
    pc = b.op("Transpose", b.op("Reshape", ec, ctx.probs_shape, allowzero=1), perm=[0, 1, 3, 2])  # [1, S, H*Qmax, Lc]
    oc = b.op("MatMul", pc, values(rows))  # [1, S, H*Qmax, L]
    on = b.op("MatMul", b.op("Reshape", en, b.const([1, 0, -1, 0])), values(kn))  # [1, S, H*Qmax, L]
    out = b.op("Div", b.op("Add", oc, on), b.op("Reshape", denom, b.const([1, 0, -1, 1])))
    out = b.op("Reshape", out, b.const([1, 0, h, -1, lat]))  # [1, S, H, Qmax, L]
    out = b.op("Reshape", b.op("Transpose", out, perm=[1, 3, 0, 2, 4]), b.const([-1, h, lat]))  # [S*Qmax, H, L]
    return b.op("Compress", out, ctx.valid, axis=0), new  # [T, H, L]


def plugin_attention(b: GraphBuilder, spec: ModelSpec, layer: int, query: str, latent: str, *,
                     block_size: int, kv_dtype: str, scale: str | None = None,
                     scores: list[str] | None = None) -> tuple[str, str]:
    """One kvexport::PagedMLA node (plugins/paged_mla/spec.py); `scores`: the node also takes
    io.OBSERVATION_LENS and its attention_scores output [S, 1, max_blocks * block_size] (spec.py
    "Attention scores") is appended to this list:

        query [T, H, W], latent [T, W] (activation dtype, q NOT scaled), latent_cache.{i},
        block_tables, seq_lens, query_start_loc, slot_mapping, kv_scale [W] (float pools: ones)
          (+ observation_lens [S])
          ──> out [T, H, L], latent_cache_out.{i} (the pool, updated in place) (+ attention_scores)
    """
    from kvexport.plugins.paged_mla.spec import PagedMLAAttrs

    m = spec.mla
    attrs = PagedMLAAttrs(spec.num_heads, m.kv_lora_rank, m.qk_rope_head_dim, block_size, spec.scale, kv_dtype)
    scale = scale or b.const(np.ones(m.row_width), "float32")
    inputs = [query, latent, io.latent_cache(layer), io.BLOCK_TABLES, io.SEQ_LENS, io.QUERY_START_LOC,
              io.SLOT_MAPPING, scale]
    if scores is not None:
        inputs.append(io.OBSERVATION_LENS)
    out, pool, *sc = b.op(io.MLA_PLUGIN_OP, *inputs, outputs=2 if scores is None else 3, domain=io.PLUGIN_DOMAIN,
                          name=f"/layers.{layer}/attn/{io.MLA_PLUGIN_OP}", **attrs.onnx_attributes())
    if scores is not None:
        scores.extend(sc)  # [S, 1, max_blocks * block_size] float32
    return out, pool


def check_build(spec: ModelSpec, layout: io.KVLayout, weights) -> None:
    """Refuse (ConfigError naming the option) what MLA builds do not implement; `weights`: the
    build's exporter/quantize.py WeightQuantization. (Its KV dtypes: the latent entries of
    exporter/kv_forms.py KV_FORMS.)"""
    if layout is not io.KVLayout.PAGED:
        raise ConfigError(f"--layout {layout.value} is not implemented for multi-head latent attention "
                          f"({spec.family}): its KV cache is a latent pool; use --layout paged")
    if weights.quantized and weights.method in CALIBRATED_METHODS:
        # NOTE: awq.py captures and folds scales into llama-style modules (q_proj reading the input
        # norm, gate_proj, down_proj); MLA's q_a / kv_a projections and the experts are not covered
        raise ConfigError(f"--quant-method {weights.method} is not implemented for multi-head latent attention "
                          f"({spec.family}): its scale search covers llama-style attention and dense MLPs, not the "
                          f"MLA projections or the experts; use --quant-method rtn (e.g. --weights "
                          f"{weights.precision} --quant-method rtn)"
                          + ("; --weights int8 without --quant-method means smoothquant"
                             if weights.method == "smoothquant" else ""))


def calibrate_latent(model, ids: list[int], spec: ModelSpec, chunk: int = 512) -> np.ndarray:
    """int8 latent scales [layers, L + R] float32: the absmax per channel of the rows transformers
    caches for `ids` (its DeepSeek cache holds the normed latent as keys, the rotated RoPE key as
    values), / 127; each RoPE pair shares its max (RoPE mixes the pair), in the pool's evens | odds
    order. One sequence in chunks that continue the cache (the RoPE key's range moves with position)."""
    import torch

    m = spec.mla
    half = m.qk_rope_head_dim // 2
    absmax, cache = None, None
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            cache = model(torch.tensor([ids[start:start + chunk]]), cache=cache, use_cache=True).cache
            rows = []
            for layer in cache.layers:  # keys [1, 1, seq, L], values [1, 1, seq, R]
                c = layer.keys.float().abs().amax(dim=(0, 1, 2)).numpy()
                r = layer.values.float().abs().amax(dim=(0, 1, 2)).numpy()
                # NOTE: V3 (rope_interleave) caches [evens' | odds'] of each pair, V2 the pairs interleaved
                pair = np.maximum(r[0::2], r[1::2]) if not _v3_order(model) else np.maximum(r[:half], r[half:])
                rows.append(np.concatenate([c, pair, pair]))
            cur = np.stack(rows)
            absmax = cur if absmax is None else np.maximum(absmax, cur)
    return np.maximum(absmax / io.KV_INT8_QMAX, 1e-8).astype(np.float32)


def _v3_order(model) -> bool:
    """Whether transformers' attention caches the RoPE key evens-then-odds (V3's interleave form,
    or no interleave at all) rather than in interleaved pairs (V2's complex form)."""
    return model.config.model_type != "deepseek_v2"


def quantization_entry(scales: np.ndarray, text: str, ids: list[int]) -> dict:
    """The manifest's kv.quantization record of an int8 MLA build: scales [layers][L + R]."""
    import hashlib

    return {"scheme": "static-per-channel-symmetric-latent", "qmax": io.KV_INT8_QMAX,
            "calibration": {"text": text, "tokens": len(ids),
                            "ids_sha256": hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()},
            "scales": scales.tolist()}
