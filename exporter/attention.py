"""Attention subgraphs for both KV layouts, written with standard ONNX ops.

Both layouts reduce to one core (`_attend`): queries grouped by KV head, keys/values with
`kv_heads` heads (GQA stays GQA), an additive mask bias. They differ in where keys come
from: the contiguous layout concatenates past and present; the paged layout gathers the
sequence's blocks from the pool and appends this step's keys.

Masks and index tensors depend only on the step's metadata and the layer's window, so
`*_context()` builds them once per graph and window, and every layer with that window reuses
them. Per layer (spec.py): the window, the scale (q arrives scaled), the soft-cap and the learned
attention sinks (GPT-OSS: one logit per query head in the softmax denominator, with no value; the
layer's weights hold them, LayerWeights.attn_sinks; plugins/paged_attention/spec.py says the math).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvexport import io

from . import kv_int4
from .onnx_builder import GraphBuilder, onnx_dtype
from .spec import ModelSpec

NEG = -1e30  # additive bias for masked keys; finite so a fully masked pad row stays NaN-free


@dataclass(frozen=True, slots=True)
class AttnContext:
    bias: str  # contiguous: [B, 1, 1, Q, L]; paged: this step's keys [1, S, 1, Qmax, Qmax] (0 or NEG)
    # paged only
    gather_idx: str | None = None  # [S, Qmax] int64: packed token index of padded query (s, i)
    valid: str | None = None  # [S * Qmax] bool: which padded queries are real tokens
    cached_bias: str | None = None  # [1, S, Lc, G, Qmax]: keys read from the pool (Lc = blocks * bs)
    # NOTE: fully explicit Reshape targets used with allowzero=1: Lc is 0 when no sequence
    # has KV in the pool yet, and a 0 must then mean an empty axis, not "copy this dim"
    keys_shape: str | None = None  # [kvH, S, Lc, D]
    scores_shape: str | None = None  # [kvH, S, Lc, G, Qmax] (pool scores are kept key-major)
    probs_shape: str | None = None  # [kvH, S, Lc, G * Qmax]
    block_tables: str = io.BLOCK_TABLES  # the block-table input of the layers' KV cache group


def _window_ok(b: GraphBuilder, q_pos: str, k_pos: str, window: int | None) -> str | None:
    """q_pos - k_pos < window (HF's sliding window: the query and window-1 keys before it)."""
    if window is None:
        return None
    return b.op("Less", b.op("Sub", q_pos, k_pos), b.const(window))


def _and(b: GraphBuilder, *masks: str | None) -> str:
    masks = [m for m in masks if m is not None]
    out = masks[0]
    for m in masks[1:]:
        out = b.op("And", out, m)
    return out


def _to_bias(b: GraphBuilder, mask: str) -> str:
    # mask [N, Q, L] bool -> [N, 1, 1, Q, L] float32
    bias = b.op("Where", mask, b.const(0.0, "float32"), b.const(NEG, "float32"))
    return b.op("Unsqueeze", bias, b.const([1, 2]))


def contiguous_context(b: GraphBuilder, spec: ModelSpec, window: int | None) -> AttnContext:
    """Mask for left-padded batches: key j is visible to query i (absolute index P + i,
    P = past length) if attention_mask[j] = 1, j <= P + i and inside `window` (None: full)."""
    b.scope = "/attn_mask" if window is None else f"/attn_mask_w{window}"
    total = b.op("Gather", b.op("Shape", io.ATTENTION_MASK), b.const(1), axis=0)  # scalar L
    seq = b.op("Gather", b.op("Shape", io.INPUT_IDS), b.const(1), axis=0)  # scalar S
    past = b.op("Sub", total, seq)
    k_pos = b.op("Range", b.const(0), total, b.const(1))  # [L]
    q_pos = b.op("Unsqueeze", b.op("Range", past, total, b.const(1)), b.const([1]))  # [S, 1]
    causal = b.op("LessOrEqual", k_pos, q_pos)  # [S, L]
    window = _window_ok(b, q_pos, k_pos, window)
    keep = b.op("Unsqueeze", b.op("Cast", io.ATTENTION_MASK, to=9), b.const([1]))  # [B, 1, L]
    mask = _and(b, keep, causal, window)  # [B, S, L]
    return AttnContext(bias=_to_bias(b, mask))


def paged_context(b: GraphBuilder, spec: ModelSpec, block_size: int, window: int | None,
                  group: str = io.FULL_GROUP, kv_dtype: str = "float32") -> AttnContext:
    """Index tensors and mask for a packed ragged batch.

        query_start_loc ──> q_start, q_len ──> gather_idx [S, Qmax] (pads queries per seq)
        seq_lens - q_len ─> ctx_len (tokens already in the pool, per sequence)
        keys = [ pool blocks of the seq (Lc = max_blocks * block_size) | this step's Qmax ]
        cached key j visible  iff  j < ctx_len            (and inside the window)
        new key j' visible    iff  j' <= i                 (and inside the window)
    `window`: the layers' sliding window (None: full attention); `group`: their KV cache
    group (kvexport/io.py), whose block table they read; `kv_dtype`: the pools' (a numpy name;
    int4 rows are io.kv_row_width wide).
    """
    b.scope = "/attn_mask" if window is None else f"/attn_mask_w{window}"
    q_start = b.op("Slice", io.QUERY_START_LOC, b.const([0]), b.const([-1]))  # [S]
    q_end = b.op("Slice", io.QUERY_START_LOC, b.const([1]), b.const([np.iinfo(np.int64).max]))
    q_len = b.op("Sub", q_end, q_start)  # [S]
    ctx_len = b.op("Sub", io.SEQ_LENS, q_len)  # [S]
    q_max = b.op("ReduceMax", q_len, keepdims=0)  # scalar
    i = b.op("Range", b.const(0), q_max, b.const(1))  # [Qmax]
    tok = b.op("Add", b.op("Unsqueeze", q_start, b.const([1])), i)  # [S, Qmax]
    n_tok = b.op("Gather", b.op("Shape", io.INPUT_IDS), b.const(0), axis=0)
    gather_idx = b.op("Min", tok, b.op("Sub", n_tok, b.const(1)))
    valid = b.op("Less", i, b.op("Unsqueeze", q_len, b.const([1])))  # [S, Qmax]
    valid = b.op("Reshape", valid, b.const([-1]))

    tables = io.block_tables(group)
    n_blocks = b.op("Gather", b.op("Shape", tables), b.const(1), axis=0)
    lc = b.op("Mul", n_blocks, b.const(block_size))
    k_cached = b.op("Range", b.const(0), lc, b.const(1))  # [Lc]
    ctx3 = b.op("Unsqueeze", ctx_len, b.const([1, 2]))  # [S, 1, 1]
    q_pos = b.op("Add", ctx3, b.op("Unsqueeze", i, b.const([1])))  # [S, Qmax, 1]
    cached_ok = _and(b, b.op("Less", k_cached, ctx3),
                     _window_ok(b, q_pos, k_cached, window))  # [S, Qmax, Lc]
    i_col = b.op("Unsqueeze", i, b.const([1]))  # [Qmax, 1]
    new_ok = _and(b, b.op("LessOrEqual", i, i_col),
                  _window_ok(b, i_col, i, window))  # [Qmax, Qmax]
    s = b.op("Gather", b.op("Shape", io.SEQ_LENS), b.const(0), axis=0)
    new_ok = b.op("Expand", new_ok, b.op("Concat", b.op("Unsqueeze", s, b.const([0])),
                                         b.op("Shape", new_ok), axis=0))  # [S, Qmax, Qmax]
    # NOTE: without a window cached_ok is [S, 1, Lc]; expand it to every query row.
    cached_ok = b.op("Expand", cached_ok, b.op("Concat", b.op("Unsqueeze", s, b.const([0])),
                                               b.op("Unsqueeze", q_max, b.const([0])),
                                               b.op("Unsqueeze", lc, b.const([0])), axis=0))
    cached = b.op("Where", cached_ok, b.const(0.0, "float32"), b.const(NEG, "float32"))
    cached = b.op("Unsqueeze", b.op("Transpose", cached, perm=[0, 2, 1]), b.const([0, 3]))  # [1, S, Lc, 1, Qmax]
    q_max1 = b.op("Unsqueeze", q_max, b.const([0]))  # [1]
    lc1 = b.op("Unsqueeze", lc, b.const([0]))  # [1]
    g, d = spec.group_size, spec.head_dim
    gq = b.op("Mul", q_max1, b.const([g]))
    s1 = b.op("Unsqueeze", s, b.const([0]))  # [1] = S
    # NOTE: expanded over the query group once per graph, so each layer's bias Add only
    # broadcasts over the leading (head) axis, onnxruntime's fast path: 0.69 -> 0.13 ms per
    # layer on a 64 x 600-token decode (a size-1 inner axis takes its slow path)
    cached = b.op("Expand", cached, b.op("Concat", b.const([1]), s1, lc1, b.const([g]), q_max1, axis=0))
    return AttnContext(
        bias=b.op("Unsqueeze", b.op("Where", new_ok, b.const(0.0, "float32"), b.const(NEG, "float32")),
                  b.const([0, 2])),  # [1, S, 1, Qmax, Qmax]
        gather_idx=gather_idx, valid=valid, cached_bias=cached, block_tables=tables,
        keys_shape=b.op("Concat", b.const([spec.num_kv_heads]), s1, lc1, b.const([io.kv_row_width(d, kv_dtype)]),
                        axis=0),
        scores_shape=b.op("Concat", b.const([spec.num_kv_heads]), s1, lc1, b.const([g]), q_max1, axis=0),
        probs_shape=b.op("Concat", b.const([spec.num_kv_heads]), s1, lc1, gq, axis=0))


def _softcap(b: GraphBuilder, scores: str, cap: float | None) -> str:
    """cap * tanh(scores / cap) on scaled scores, before the mask (transformers' order)."""
    if cap is None:
        return scores
    return b.op("Mul", b.op("Tanh", b.op("Div", scores, b.const(cap, "float32"))), b.const(cap, "float32"))


def sink_logits(b: GraphBuilder, spec: ModelSpec, sinks: np.ndarray | None) -> str | None:
    """A layer's sinks [H] (query head h = kv head * G + g) as a [kvH, G, 1, 1] float32 constant
    that broadcasts against scores [.., kvH, G, Q, 1]; None without sinks."""
    if sinks is None:
        return None
    return b.const(np.asarray(sinks, np.float32).reshape(spec.num_kv_heads, spec.group_size, 1, 1), "float32")


def _attend(b: GraphBuilder, spec: ModelSpec, q: str, k: str, v: str, bias: str, sinks: str | None = None) -> str:
    """Core attention, GQA-aware; scores soft-capped by spec.attn_softcap; `sinks` (sink_logits)
    join each row's softmax denominator:

        q    [N, Q, H, D] float32 (already scaled)
        k, v [N, kvH, L, D] float32
        bias [N, 1, 1, Q, L]
        ->   [N, Q, H * D]
        with sinks: m = max(max_j s_j, sink), p_j = exp(s_j - m) / (exp(sink - m) + sum_k exp(s_k - m))
    """
    kvh, g, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    q = b.op("Reshape", q, b.const([0, 0, kvh, g, d]))  # [N, Q, kvH, G, D]
    q = b.op("Transpose", q, perm=[0, 2, 3, 1, 4])  # [N, kvH, G, Q, D]
    kt = b.op("Unsqueeze", b.op("Transpose", k, perm=[0, 1, 3, 2]), b.const([2]))  # [N, kvH, 1, D, L]
    scores = b.op("Add", _softcap(b, b.op("MatMul", q, kt), spec.attn_softcap), bias)  # [N, kvH, G, Q, L]
    if sinks is None:
        probs = b.op("Softmax", scores, axis=-1)
    else:
        m = b.op("Max", b.op("ReduceMax", scores, b.const([-1]), keepdims=1), sinks)  # [N, kvH, G, Q, 1]
        e = b.op("Exp", b.op("Sub", scores, m))
        denom = b.op("Add", b.op("ReduceSum", e, b.const([-1]), keepdims=1), b.op("Exp", b.op("Sub", sinks, m)))
        probs = b.op("Div", e, denom)  # [N, kvH, G, Q, L]
    out = b.op("MatMul", probs, b.op("Unsqueeze", v, b.const([2])))  # [N, kvH, G, Q, D]
    out = b.op("Transpose", out, perm=[0, 3, 1, 2, 4])  # [N, Q, kvH, G, D]
    return b.op("Reshape", out, b.const([0, 0, spec.num_heads * d]))  # [N, Q, H*D]


def contiguous_attention(b: GraphBuilder, spec: ModelSpec, layer: int, ctx: AttnContext,
                         q: str, k: str, v: str, *, has_past: bool, kv_dtype: str,
                         scales: tuple[str, str] | None = None,
                         sinks: np.ndarray | None = None) -> tuple[str, str, str]:
    """q [B, S, H, D], k/v [B, S, kvH, D] (float32, rotated) -> (out [B, S, H*D],
    present key, present value [B, kvH, total, D] in kv_dtype). sinks: the layer's [H] sink logits."""
    ks, vs = scales or (None, None)
    kvh = spec.num_kv_heads
    k = b.op("Transpose", k, perm=[0, 2, 1, 3])  # [B, kvH, S, D]
    v = b.op("Transpose", v, perm=[0, 2, 1, 3])
    k = to_kv(b, k, kv_dtype, ks, axis=1, heads=kvh, d=spec.head_dim, rank=4)
    v = to_kv(b, v, kv_dtype, vs, axis=1, heads=kvh, d=spec.head_dim, rank=4)
    if has_past:
        k = b.op("Concat", io.past_key(layer), k, axis=2)  # [B, kvH, P+S, D]
        v = b.op("Concat", io.past_value(layer), v, axis=2)
    out = _attend(b, spec, q, from_kv(b, k, kv_dtype, ks, axis=1, heads=kvh, d=spec.head_dim, rank=4),
                  from_kv(b, v, kv_dtype, vs, axis=1, heads=kvh, d=spec.head_dim, rank=4), ctx.bias,
                  sink_logits(b, spec, sinks))
    return out, k, v


def paged_attention(b: GraphBuilder, spec: ModelSpec, layer: int, ctx: AttnContext,
                    q: str, k: str, v: str, *, kv_dtype: str,
                    scales: tuple[str, str] | None = None,
                    sinks: np.ndarray | None = None, scores: list[str] | None = None) -> tuple[str, str, str]:
    """q [T, H, D], k/v [T, kvH, D] (float32, rotated) -> (out [T, H*D], new key, new value
    [T, kvH, D] in kv_dtype for the runtime to store at slot_mapping). sinks: the layer's [H]
    sink logits (GPT-OSS): m also covers them, and exp(sink - m) joins the denominator.
    scores: the layer's attention_scores output (`_attention_scores`) is appended to this list.

    Keys come in two parts that share one softmax: what earlier steps stored in the pool
    (gathered per head in token order, see io.paged_pool_shape) and this step's keys:

        q       [kvH, S, G*Qmax, D]
        pool    K,V [kvH, S, Lc, D]    --K·qᵀ--> [kvH, S, Lc, G, Qmax]   (+cached_bias)
        step    K,V [kvH, S, Qmax, D]  --QK^T--> [kvH, S, G, Qmax, Qmax] (+bias)
        m = max over both, e = exp(. - m), out = (e_c V_c + e_n V_n) / (sum e_c + sum e_n)
    """
    ks, vs = scales or (None, None)
    kvh, g, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    new_k = to_kv(b, k, kv_dtype, ks, axis=1, heads=kvh, d=spec.head_dim)  # [T, kvH, D]
    new_v = to_kv(b, v, kv_dtype, vs, axis=1, heads=kvh, d=spec.head_dim)
    idx = ctx.gather_idx
    q = b.op("Reshape", b.op("Gather", q, idx, axis=0), b.const([0, 0, kvh, g, d]))  # [S, Qmax, kvH, G, D]
    q5 = b.op("Transpose", q, perm=[2, 0, 3, 1, 4])  # [kvH, S, G, Qmax, D]
    q = b.op("Reshape", q5, b.const([kvh, 0, -1, d]))  # [kvH, S, G*Qmax, D]

    # the pool: each sequence's blocks, per head, in token order
    kc = b.op("Gather", io.key_cache(layer), ctx.block_tables, axis=1)  # [kvH, S, B, bs, D]
    vc = b.op("Gather", io.value_cache(layer), ctx.block_tables, axis=1)
    kc = from_kv(b, b.op("Reshape", kc, ctx.keys_shape, allowzero=1), kv_dtype, ks, axis=0, heads=kvh,
                 d=spec.head_dim, rank=4)  # [kvH, S, Lc, D]
    vc = from_kv(b, b.op("Reshape", vc, ctx.keys_shape, allowzero=1), kv_dtype, vs, axis=0, heads=kvh,
                 d=spec.head_dim, rank=4)
    # NOTE: K·qᵀ, not q·Kᵀ: the big operand is then the GEMM's A side, which MLAS reads in
    # place, instead of the B side it would pack (copy) on every call (1.46x measured)
    qt = b.op("Transpose", q, perm=[0, 1, 3, 2])  # [kvH, S, D, G*Qmax]
    sc = b.op("MatMul", kc, qt)  # [kvH, S, Lc, G*Qmax]
    sc = _softcap(b, b.op("Reshape", sc, ctx.scores_shape, allowzero=1), spec.attn_softcap)
    sc = b.op("Add", sc, ctx.cached_bias)  # [kvH, S, Lc, G, Qmax]
    # this step's keys
    # NOTE: this step's keys are read as stored (rounded to kv_dtype), as the plugin reads them
    kn = b.op("Gather", from_kv(b, new_k, kv_dtype, ks, axis=1, heads=kvh, d=spec.head_dim), idx, axis=0)  # [S, Qmax, kvH, D]
    vn = b.op("Gather", from_kv(b, new_v, kv_dtype, vs, axis=1, heads=kvh, d=spec.head_dim), idx, axis=0)
    kn = b.op("Unsqueeze", b.op("Transpose", kn, perm=[2, 0, 3, 1]), b.const([2]))  # [kvH, S, 1, D, Qmax]
    sn = b.op("Add", _softcap(b, b.op("MatMul", q5, kn), spec.attn_softcap), ctx.bias)  # [kvH, S, G, Qmax, Qmax]
    # one softmax over both key sets; [kvH, S, 1, G, Qmax] and [kvH, S, G, Qmax, 1] are the
    # same data, so moving between the two layouts is a free reshape
    to_col = b.const([kvh, 0, g, -1, 1])
    m = b.op("Max", b.op("Reshape", b.op("ReduceMax", sc, b.const([2]), keepdims=1), to_col),
             b.op("ReduceMax", sn, b.const([4]), keepdims=1))  # [kvH, S, G, Qmax, 1]
    sink = sink_logits(b, spec, sinks)  # [kvH, 1, G, 1, 1] after the Unsqueeze
    if sink is not None:
        sink = b.op("Unsqueeze", sink, b.const([1]))
        m = b.op("Max", m, sink)
    m_row = b.op("Reshape", m, b.const([kvh, 0, 1, g, -1]))  # [kvH, S, 1, G, Qmax]
    ec = b.op("Exp", b.op("Sub", sc, m_row))  # [kvH, S, Lc, G, Qmax]
    en = b.op("Exp", b.op("Sub", sn, m))  # [kvH, S, G, Qmax, Qmax]
    denom = b.op("Add", b.op("Reshape", b.op("ReduceSum", ec, b.const([2]), keepdims=1), to_col),
                 b.op("ReduceSum", en, b.const([4]), keepdims=1))  # [kvH, S, G, Qmax, 1]
    if sink is not None:
        denom = b.op("Add", denom, b.op("Exp", b.op("Sub", sink, m)))
    pc = b.op("Transpose", b.op("Reshape", ec, ctx.probs_shape, allowzero=1), perm=[0, 1, 3, 2])  # [kvH, S, G*Qmax, Lc]
    oc = b.op("MatMul", pc, vc)  # [kvH, S, G*Qmax, D]
    on = b.op("MatMul", b.op("Reshape", en, b.const([kvh, 0, -1, 0])),
              b.op("Transpose", vn, perm=[2, 0, 1, 3]))  # [kvH, S, G*Qmax, D]
    out = b.op("Div", b.op("Add", oc, on), b.op("Reshape", denom, b.const([kvh, 0, -1, 1])))
    out = b.op("Reshape", out, b.const([kvh, 0, g, -1, d]))  # [kvH, S, G, Qmax, D]
    out = b.op("Transpose", out, perm=[1, 3, 0, 2, 4])  # [S, Qmax, kvH, G, D]
    out = b.op("Reshape", out, b.const([-1, spec.num_heads * d]))  # [S*Qmax, H*D]
    out = b.op("Compress", out, ctx.valid, axis=0)  # [T, H*D]
    if scores is not None:
        scores.append(_attention_scores(b, spec, ctx, ec, en, denom))
    return out, new_k, new_v


def _attention_scores(b: GraphBuilder, spec: ModelSpec, ctx: AttnContext, ec: str, en: str, denom: str) -> str:
    """io.attention_scores(i) of the `onnx` form: the probabilities `paged_attention` computed, summed over
    each sequence's last min(observation_lens[s], q_len) queries and the G query heads of each KV head
    (plugins/paged_attention/spec.py "Attention scores"):

        obs[s, i] = q_len[s] - min(observation_lens[s], q_len[s]) <= i < q_len[s]      [S, Qmax]
        pool keys  ec / denom [kvH, S, Lc, G, Qmax] * obs ─ReduceSum(G, Q)─▶ [kvH, S, Lc]
        step keys  en / denom [kvH, S, G, Qmax, Qmax'] * obs ─ReduceSum(G, Q)─▶ [kvH, S, Qmax'],
                   added at positions ctx_len[s] + j' (ScatterElements)
        ─▶ [S, kvH, Lc + Qmax]: position j of the sequence at j (score_len = Lc + Qmax: this form's
           tables cover only earlier steps' blocks, kvexport/io.py)
    """
    kvh, g = spec.num_kv_heads, spec.group_size
    q_start = b.op("Slice", io.QUERY_START_LOC, b.const([0]), b.const([-1]))  # [S]
    q_end = b.op("Slice", io.QUERY_START_LOC, b.const([1]), b.const([np.iinfo(np.int64).max]))
    q_len = b.op("Sub", q_end, q_start)  # [S]
    ctx_len = b.op("Sub", io.SEQ_LENS, q_len)  # [S]
    first = b.op("Sub", q_len, b.op("Min", io.OBSERVATION_LENS, q_len))  # [S]
    q_max = b.op("ReduceMax", q_len, keepdims=0)
    i = b.op("Range", b.const(0), q_max, b.const(1))  # [Qmax]
    obs = b.op("And", b.op("GreaterOrEqual", i, b.op("Unsqueeze", first, b.const([1]))),
               b.op("Less", i, b.op("Unsqueeze", q_len, b.const([1]))))  # [S, Qmax]
    obs = b.op("Cast", obs, to=onnx_dtype("float32"))
    den_row = b.op("Reshape", denom, b.const([kvh, 0, 1, g, -1]))  # [kvH, S, 1, G, Qmax]
    pc = b.op("Mul", b.op("Div", ec, den_row), b.op("Unsqueeze", obs, b.const([0, 2, 3])))  # [kvH, S, Lc, G, Qmax]
    sc = b.op("ReduceSum", pc, b.const([3, 4]), keepdims=0)  # [kvH, S, Lc]
    pn = b.op("Mul", b.op("Div", en, denom), b.op("Unsqueeze", obs, b.const([0, 2, 4])))  # [kvH, S, G, Qmax, Qmax']
    sn = b.op("ReduceSum", pn, b.const([2, 3]), keepdims=0)  # [kvH, S, Qmax']
    sc = b.op("Transpose", sc, perm=[1, 0, 2])  # [S, kvH, Lc]
    sn = b.op("Transpose", sn, perm=[1, 0, 2])  # [S, kvH, Qmax']
    data = b.op("Concat", sc, b.op("Mul", sn, b.const(0.0, "float32")), axis=2)  # [S, kvH, Lc + Qmax]
    at = b.op("Add", b.op("Unsqueeze", ctx_len, b.const([1, 2])), b.op("Unsqueeze", i, b.const([0, 1])))  # [S, 1, Qmax]
    at = b.op("Expand", at, b.op("Shape", sn))  # [S, kvH, Qmax']
    return b.op("ScatterElements", data, at, sn, axis=2, reduction="add")  # [S, kvH, Lc + Qmax]


def plugin_attention(b: GraphBuilder, spec: ModelSpec, layer: int, q: str, k: str, v: str, *,
                     block_size: int, kv_dtype: str, scales: tuple[str, str] | None = None,
                     group: str = io.FULL_GROUP, sinks: np.ndarray | None = None,
                     reads: int | None = None, scores: list[str] | None = None) -> tuple[str, str, str]:
    """One kvexport::PagedAttention node (plugins/paged_attention/spec.py); `reads`: the layer whose
    pools it takes (Gemma 4's shared KV: its source's, with the source's k/v, rewriting the same rows);
    `scores`: the node also takes io.OBSERVATION_LENS and its attention_scores output (spec.py
    "Attention scores") is appended to this list:

        q [T, H, D], k/v [T, kvH, D] (activation dtype, rotated, q NOT scaled)
        key_cache.{i}, value_cache.{i}, block_tables, seq_lens, query_start_loc, slot_mapping
          (block_tables.local / slot_mapping.local for a layer of the local KV cache group)
        kv_scales.{i}.key/value (int8; float pools: unit scales, ignored)
        sinks [H] (GPT-OSS) -> the node's attention_sinks attribute
          ──> out [T, H, D], key_cache_out.{i}, value_cache_out.{i} (the pools, updated in place)
    """
    from kvexport.plugins.paged_attention.spec import PagedAttentionAttrs

    attrs = PagedAttentionAttrs(spec.num_heads, spec.num_kv_heads, spec.head_dim, block_size, spec.scale,
                                spec.window(layer) or 0, kv_dtype, logit_softcap=spec.attn_softcap or 0.0,
                                attention_sinks=() if sinks is None else tuple(np.asarray(sinks, np.float32).tolist()))
    # NOTE: float pools get ignored unit scales: the plugin has one 11-input signature (spec.py)
    ones = b.const(np.ones(spec.num_kv_heads), "float32")
    pools = layer if reads is None else reads
    inputs = [q, k, v, io.key_cache(pools), io.value_cache(pools), io.block_tables(group), io.SEQ_LENS,
              io.QUERY_START_LOC, io.slot_mapping(group), *(scales or (ones, ones))]
    if scores is not None:
        inputs.append(io.OBSERVATION_LENS)
    out, kc, vc, *sc = b.op(io.PLUGIN_OP, *inputs, outputs=3 if scores is None else 4, domain=io.PLUGIN_DOMAIN,
                            name=f"/layers.{layer}/attn/{io.PLUGIN_OP}", **attrs.onnx_attributes())
    if scores is not None:
        scores.extend(sc)  # [S, kvH, max_blocks * block_size] float32
    return out, kc, vc


def _scale_for(b: GraphBuilder, scale: str, axis: int, rank: int) -> str:
    """The per-channel scale [kvH, D] shaped to broadcast over x of `rank` dims whose KV-head
    axis is `axis` and whose last axis is head_dim: [kvH, 1, .., 1, D]."""
    between = rank - axis - 2  # axes between the head axis and head_dim
    return scale if between == 0 else b.op("Unsqueeze", scale, b.const(list(range(1, 1 + between))))


def to_kv(b: GraphBuilder, x: str, kv_dtype: str, scale: str | None, axis: int, heads: int, rank: int = 3,
          d: int = 0) -> str:
    """float32 x (`rank` dims, KV heads on `axis`, head_dim last) -> what the pool stores: a
    cast, or for int8 QuantizeLinear by the per-channel `scale` [kvH, D] (round half to even,
    saturate; zero point 0).

        x ──Div(scale [kvH, 1.., D])──> x / scale ──QuantizeLinear(1, 0)──> int8

    NOTE: Div then QuantizeLinear with a unit scale is QuantizeLinear(x, scale) bit for bit
    (onnxruntime divides in float32, IEEE-rounded, as Div does; y / 1 is exact), and works for
    any broadcast, which per-axis QuantizeLinear (one axis) does not. `heads` is unused since
    per-channel scales; kept for the callers' signature. int4: `d` = head_dim, rows of
    io.KV_INT4_FORMAT (exporter/kv_int4.py), `scale` unused (the scales are per token, in the row)."""
    if kv_dtype == "int4":  # rows of codes and per-token group scales (exporter/kv_int4.py)
        return kv_int4.quantize_rows(b, x, d, rank)
    if kv_dtype != "int8":
        return _cast(b, x, "float32", kv_dtype)
    y = b.op("Div", x, _scale_for(b, scale, axis, rank))
    return b.op("QuantizeLinear", y, b.const(1.0, "float32"), b.const(0, "int8"))


def from_kv(b: GraphBuilder, x: str, kv_dtype: str, scale: str | None, axis: int, heads: int, rank: int = 3,
            d: int = 0) -> str:
    """What the pool stores -> float32 (int8: code * scale, the per-channel `scale` [kvH, D]
    broadcast as in to_kv; float32 products, as DequantizeLinear's)."""
    if kv_dtype == "int4":
        return kv_int4.dequantize_rows(b, x, d, rank)
    if kv_dtype != "int8":
        return _cast(b, x, kv_dtype, "float32")
    return b.op("Mul", b.op("Cast", x, to=onnx_dtype("float32")), _scale_for(b, scale, axis, rank))


def _cast(b: GraphBuilder, x: str, src: str, dst: str) -> str:
    return x if src == dst else b.op("Cast", x, to=onnx_dtype(dst))
