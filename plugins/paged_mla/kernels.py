"""Triton kernels of `kvexport::PagedMLA` (semantics: spec.py, reference.py).

Owns the device code only; configurations live in configs.py, the Python launcher in launch.py,
the TensorRT ahead-of-time registration in trt.py.

    mla_kernel        any q_len: grid (T // BLOCK_Q + S, head chunks). One program = one tile of
                      BLOCK_Q new tokens of one sequence × HEADS query heads (rows r -> token
                      r // HEADS, head chunk * HEADS + r % HEADS). Every head reads the same rows,
                      so each tile of BLOCK_N rows is loaded once for all BLOCK_M query rows and
                      used twice: its latent part is the key (with the RoPE part) and the value.
                      The store of the tile's rows is fused in (head chunk 0): one launch, so it
                      is also the AOT kernel.
    mla_split_kernel  the same over a slice of the keys: grid (.., .., splits); split p attends to
                      positions [p * partition, (p + 1) * partition) and writes its partial (max,
                      sum, normalised out) — flash-decoding for few sequences with long contexts.
    mla_reduce_kernel combines the partials: grid (T, H).

A row [W] is two power-of-two tiles: the latent part [BLOCK_L] (L = kv_lora_rank channels) and the
RoPE part [BLOCK_R] (R channels at offset L), so s = q_lat · c + q_rope · k_rope is two dots and
out = p · c a third, all accumulated in float32 (DeepSeek: L 512, R 64, no padding at all).

NOTE (fused store without a grid barrier, as PagedAttention's kernels): positions < ctx are read
from the pool through the block table; the step's own positions from the latent input, rounded
exactly as the store rounds them (dtype cast, or int8 quantisation), which for valid inputs is
"store, then read the pool" bit for bit. Tokens with slot < 0 are not stored but still attend to
their own rows.

INT8: codes are exact small integers in the compute dtype; the per-channel scales [W] fold into
the query (both parts) and into the output (latent part); quantisation is div_rn + round half to
even + saturation, ONNX QuantizeLinear (paged_attention.kernels._quantize).
"""

import triton
import triton.language as tl

from ..paged_attention.kernels import LOG2E, _compute_dtype, _find_seq, _quantize


@triton.jit
def _rows(cache_ptr, lat_ptr, bt_row, sc_l, sc_r, pos, lim, ctx, q_start, cl, cr,
          FROM_POOL: tl.constexpr, KV_INT8: tl.constexpr, BLOCK_SIZE: tl.constexpr, LORA: tl.constexpr,
          ROPE: tl.constexpr, CDT: tl.constexpr):
    """The rows at positions `pos` [BLOCK_N] (< lim) of one sequence as (latent [BLOCK_N, BLOCK_L],
    rope [BLOCK_N, BLOCK_R]) in CDT, int8 codes unscaled. FROM_POOL: through the block table;
    else this step's latent input, rounded as the store rounds it."""
    WIDTH: tl.constexpr = LORA + ROPE
    ok = pos < lim
    ok_l = ok[:, None] & (cl < LORA)[None, :]
    ok_r = ok[:, None] & (cr < ROPE)[None, :]
    if FROM_POOL:
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=ok, other=0)  # [BLOCK_N] int64
        base = (blk * BLOCK_SIZE + pos % BLOCK_SIZE) * WIDTH
        c = tl.load(cache_ptr + base[:, None] + cl[None, :], mask=ok_l, other=0).to(CDT)
        r = tl.load(cache_ptr + base[:, None] + LORA + cr[None, :], mask=ok_r, other=0).to(CDT)
    else:
        base = (q_start + pos - ctx).to(tl.int64) * WIDTH  # this step's token index
        c = tl.load(lat_ptr + base[:, None] + cl[None, :], mask=ok_l, other=0.0)
        r = tl.load(lat_ptr + base[:, None] + LORA + cr[None, :], mask=ok_r, other=0.0)
        if KV_INT8:
            c = _quantize(c, sc_l[None, :]).to(CDT)
            r = _quantize(r, sc_r[None, :]).to(CDT)
        else:  # rounded as stored
            c = c.to(tl.float32).to(cache_ptr.dtype.element_ty).to(CDT)
            r = r.to(tl.float32).to(cache_ptr.dtype.element_ty).to(CDT)
    return c, r


@triton.jit
def _attend_step(acc, m_i, l_i, q_l, q_r, j0, cache_ptr, lat_ptr, bt_row, sc_l, sc_r, hi, ctx, q_start, qpos,
                 cl, cr, qk_scale, FROM_POOL: tl.constexpr, KV_INT8: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr, CDT: tl.constexpr,
                 PREC: tl.constexpr):
    """Online-softmax update of (acc [BLOCK_M, BLOCK_L], m_i, l_i [BLOCK_M]) with the rows at
    positions [j0, j0 + BLOCK_N) ∩ [.., hi); scores in the log2 domain (qk_scale has log2 e)."""
    pos = j0 + tl.arange(0, BLOCK_N)
    c, r = _rows(cache_ptr, lat_ptr, bt_row, sc_l, sc_r, pos, hi, ctx, q_start, cl, cr, FROM_POOL, KV_INT8,
                 BLOCK_SIZE, LORA, ROPE, CDT)
    s = tl.dot(q_l, tl.trans(c), input_precision=PREC)
    s = tl.dot(q_r, tl.trans(r), s, input_precision=PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    vis = (pos[None, :] <= qpos[:, None]) & (pos < hi)[None, :]
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(CDT), c, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _attend(acc, m_i, l_i, q_l, q_r, lo, hi, cache_ptr, lat_ptr, bt_row, sc_l, sc_r, ctx, q_start, qpos,
            cl, cr, qk_scale, FROM_POOL: tl.constexpr, KV_INT8: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
            INTERPRET: tl.constexpr):
    """`_attend_step` over positions [lo, hi). NOTE: a `while` loop under TRITON_INTERPRET=1
    (triton 3.6's interpreter cannot `range()` over device scalars with numpy >= 2.3), a `for`
    loop (software-pipelined) on the GPU — as paged_attention.kernels._attend."""
    if INTERPRET:
        j0 = lo
        while j0 < hi:
            acc, m_i, l_i = _attend_step(acc, m_i, l_i, q_l, q_r, j0, cache_ptr, lat_ptr, bt_row, sc_l, sc_r, hi, ctx,
                                         q_start, qpos, cl, cr, qk_scale, FROM_POOL, KV_INT8, BLOCK_SIZE, LORA, ROPE,
                                         BLOCK_N, CDT, PREC)
            j0 += BLOCK_N
    else:
        for j0 in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _attend_step(acc, m_i, l_i, q_l, q_r, j0, cache_ptr, lat_ptr, bt_row, sc_l, sc_r, hi, ctx,
                                         q_start, qpos, cl, cr, qk_scale, FROM_POOL, KV_INT8, BLOCK_SIZE, LORA, ROPE,
                                         BLOCK_N, CDT, PREC)
    return acc, m_i, l_i


@triton.jit
def _program(q_ptr, lat_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, slot_ptr, scale_ptr, num_seqs, max_blocks,
             cache_out_ptr, split, partition, NUM_HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, SCALE: tl.constexpr, KV_INT8: tl.constexpr, HEADS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
             SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """One program's rows: stores the tile's rows (head chunk 0, split 0), then attends over the
    keys of its split (all of them unless SPLIT). Returns (active, acc, m_i, l_i, tok, head,
    row_ok, cl, sc_l): acc unnormalised, in the log2 domain."""
    BLOCK_Q: tl.constexpr = BLOCK_M // HEADS
    WIDTH: tl.constexpr = LORA + ROPE
    CDT: tl.constexpr = _compute_dtype(q_ptr.dtype.element_ty, INTERPRET)
    PREC: tl.constexpr = "ieee" if CDT == tl.float32 else "tf32"
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    s = _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(qsl_ptr + s).to(tl.int32)
    q_len = tl.load(qsl_ptr + s + 1).to(tl.int32) - q_start
    tile0 = (pid - (q_start // BLOCK_Q + s)) * BLOCK_Q  # first new token of this tile
    rows = tl.arange(0, BLOCK_M)
    tok_i = tile0 + rows // HEADS  # [BLOCK_M] token index within the sequence
    head = chunk * HEADS + rows % HEADS
    row_ok = (tok_i < q_len) & (head < NUM_HEADS)
    tok = q_start + tok_i
    cl = tl.arange(0, BLOCK_L)
    cr = tl.arange(0, BLOCK_R)
    sc_l = tl.full([BLOCK_L], 1.0, dtype=tl.float32)
    sc_r = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
    if KV_INT8:
        sc_l = tl.load(scale_ptr + cl, mask=cl < LORA, other=1.0)
        sc_r = tl.load(scale_ptr + LORA + cr, mask=cr < ROPE, other=1.0)
    acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    active = tile0 < q_len
    if active:
        ctx = tl.load(seq_lens_ptr + s).to(tl.int32) - q_len  # rows already in the pool
        if (chunk == 0) & (split == 0):  # store this tile's rows, once
            st_ok = row_ok & (rows % HEADS == 0)
            slot = tl.load(slot_ptr + tok, mask=st_ok, other=-1)  # [BLOCK_M] int64
            st_ok = st_ok & (slot >= 0)
            src = tok.to(tl.int64) * WIDTH
            dst = slot * WIDTH
            ok_l = st_ok[:, None] & (cl < LORA)[None, :]
            ok_r = st_ok[:, None] & (cr < ROPE)[None, :]
            x_l = tl.load(lat_ptr + src[:, None] + cl[None, :], mask=ok_l, other=0.0)
            x_r = tl.load(lat_ptr + src[:, None] + LORA + cr[None, :], mask=ok_r, other=0.0)
            if KV_INT8:
                x_l = _quantize(x_l, sc_l[None, :])
                x_r = _quantize(x_r, sc_r[None, :])
            tl.store(cache_out_ptr + dst[:, None] + cl[None, :],
                     x_l.to(tl.float32).to(cache_out_ptr.dtype.element_ty), mask=ok_l)
            tl.store(cache_out_ptr + dst[:, None] + LORA + cr[None, :],
                     x_r.to(tl.float32).to(cache_out_ptr.dtype.element_ty), mask=ok_r)
        q_base = (tok.to(tl.int64) * NUM_HEADS + head) * WIDTH  # [BLOCK_M]
        q_l = tl.load(q_ptr + q_base[:, None] + cl[None, :], mask=row_ok[:, None] & (cl < LORA)[None, :], other=0.0)
        q_r = tl.load(q_ptr + q_base[:, None] + LORA + cr[None, :], mask=row_ok[:, None] & (cr < ROPE)[None, :],
                      other=0.0)
        if KV_INT8:  # k = code * scale: the scales fold into the query, in float32
            q_l = q_l.to(tl.float32) * sc_l[None, :]
            q_r = q_r.to(tl.float32) * sc_r[None, :]
        q_l = q_l.to(CDT)
        q_r = q_r.to(CDT)
        qpos = ctx + tok_i
        hi = ctx + tl.minimum(q_len, tile0 + BLOCK_Q)  # rows after the tile's last token are invisible
        lo = 0
        if SPLIT:
            lo = split * partition
            hi = tl.minimum(hi, lo + partition)
        qk_scale = SCALE * LOG2E
        bt_row = bt_ptr + s.to(tl.int64) * max_blocks
        acc, m_i, l_i = _attend(acc, m_i, l_i, q_l, q_r, lo, tl.minimum(hi, ctx), cache_ptr, lat_ptr, bt_row, sc_l,
                                sc_r, ctx, q_start, qpos, cl, cr, qk_scale, True, KV_INT8, BLOCK_SIZE, LORA, ROPE,
                                BLOCK_N, CDT, PREC, INTERPRET)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q_l, q_r, tl.maximum(lo, ctx), hi, cache_ptr, lat_ptr, bt_row, sc_l,
                                sc_r, ctx, q_start, qpos, cl, cr, qk_scale, False, KV_INT8, BLOCK_SIZE, LORA, ROPE,
                                BLOCK_N, CDT, PREC, INTERPRET)
    return active, acc, m_i, l_i, tok, head, row_ok, cl, sc_l


@triton.jit
def mla_kernel(q_ptr, lat_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, slot_ptr, scale_ptr,
               num_seqs, max_blocks, num_blocks, out_ptr, cache_out_ptr,
               NUM_HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               SCALE: tl.constexpr, KV_INT8: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, INTERPRET: tl.constexpr = False):
    """Argument order = the AOT plugin's: the 8 inputs, the int32 extras, the 2 outputs.
    num_blocks is unused (the pool's leading axis is 1: no head offset) but kept, so the
    plugin's extras match PagedAttention's."""
    active, acc, m_i, l_i, tok, head, row_ok, cl, sc_l = _program(
        q_ptr, lat_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, slot_ptr, scale_ptr, num_seqs, max_blocks,
        cache_out_ptr, 0, 0, NUM_HEADS, LORA, ROPE, BLOCK_SIZE, SCALE, KV_INT8, HEADS, BLOCK_M, BLOCK_N, BLOCK_L,
        BLOCK_R, False, INTERPRET)
    if active:
        out = acc * (1.0 / tl.where(l_i == 0.0, 1.0, l_i))[:, None] * sc_l[None, :]
        o_base = (tok.to(tl.int64) * NUM_HEADS + head) * LORA
        tl.store(out_ptr + o_base[:, None] + cl[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cl < LORA)[None, :])


@triton.jit
def mla_split_kernel(q_ptr, lat_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, slot_ptr, scale_ptr,
                     num_seqs, max_blocks, partition, cache_out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
                     NUM_HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     SCALE: tl.constexpr, KV_INT8: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                     INTERPRET: tl.constexpr = False):
    """Split p of the keys (`partition`, a multiple of BLOCK_N, positions each); part_* are
    [T, H, splits(, L)] float32: the split's max and sum (log2 domain) and normalised output."""
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    active, acc, m_i, l_i, tok, head, row_ok, cl, sc_l = _program(
        q_ptr, lat_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, slot_ptr, scale_ptr, num_seqs, max_blocks,
        cache_out_ptr, split, partition, NUM_HEADS, LORA, ROPE, BLOCK_SIZE, SCALE, KV_INT8, HEADS, BLOCK_M, BLOCK_N,
        BLOCK_L, BLOCK_R, True, INTERPRET)
    if active:
        out = acc * (1.0 / tl.where(l_i == 0.0, 1.0, l_i))[:, None] * sc_l[None, :]
        idx = (tok.to(tl.int64) * NUM_HEADS + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_m_ptr + idx, m_i, mask=row_ok)
        tl.store(part_l_ptr + idx, l_i, mask=row_ok)
        tl.store(part_out_ptr + idx[:, None] * LORA + cl[None, :], out, mask=row_ok[:, None] & (cl < LORA)[None, :])


@triton.jit
def mla_reduce_kernel(part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, num_splits, NUM_HEADS: tl.constexpr,
                      LORA: tl.constexpr, BLOCK_L: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """out[t, h] = the partials of (t, h) merged: weights 2^(m_p - max) * l_p."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, MAX_SPLITS)
    ok = sp < num_splits
    idx = (t.to(tl.int64) * NUM_HEADS + h) * num_splits + sp
    m = tl.load(part_m_ptr + idx, mask=ok, other=float("-inf"))
    l_p = tl.load(part_l_ptr + idx, mask=ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(l_p > 0.0, tl.exp2(m - m_max) * l_p, 0.0)
    cl = tl.arange(0, BLOCK_L)
    o = tl.load(part_out_ptr + idx[:, None] * LORA + cl[None, :], mask=ok[:, None] & (cl < LORA)[None, :], other=0.0)
    denom = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + (t.to(tl.int64) * NUM_HEADS + h) * LORA + cl, res.to(out_ptr.dtype.element_ty), mask=cl < LORA)


@triton.jit
def _score_tile(q_l, q_r, j0, cache_ptr, bt_row, sc_l, sc_r, hi, qpos, cl, cr, qk_scale, KV_INT8: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr,
                CDT: tl.constexpr, PREC: tl.constexpr):
    """(scores [BLOCK_M, BLOCK_N] in the log2 domain, -inf where invisible; positions [BLOCK_N]) of
    the pool's rows at [j0, j0 + BLOCK_N) ∩ [.., hi), as `_attend_step` computes them."""
    pos = j0 + tl.arange(0, BLOCK_N)
    c, r = _rows(cache_ptr, cache_ptr, bt_row, sc_l, sc_r, pos, hi, 0, 0, cl, cr, True, KV_INT8, BLOCK_SIZE,
                 LORA, ROPE, CDT)
    s = tl.dot(q_l, tl.trans(c), input_precision=PREC)
    s = tl.dot(q_r, tl.trans(r), s, input_precision=PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    vis = (pos[None, :] <= qpos[:, None]) & (pos < hi)[None, :]
    return tl.where(vis, s, float("-inf")), pos


@triton.jit
def mla_scores_kernel(q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, scale_ptr, obs_ptr, max_blocks, score_len,
                      part_ptr, NUM_HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, SCALE: tl.constexpr, KV_INT8: tl.constexpr, HEADS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                      INTERPRET: tl.constexpr = False):
    """The optional attention_scores output (spec.py "Attention scores"): grid (S, head chunks), run
    after the attention (the pool holds this step's rows). Program (s, chunk) adds, to its zeroed
    partial row part[s, chunk, :score_len], the probabilities of sequence s's last
    min(obs_lens[s], q_len) tokens × its HEADS query heads, BLOCK_M rows at a time: pass 1 over the
    rows gives each query row's max and denominator, pass 2 recomputes the scores and adds each key
    tile's column sums. The launcher sums the chunks (deterministic: no atomics). NOTE: `while` loops
    and a barrier after each row tile, as paged_attention.kernels.scores_kernel."""
    BLOCK_Q: tl.constexpr = BLOCK_M // HEADS
    # NOTE: dots in IEEE float32 whatever the activation dtype: half queries and pools convert
    # exactly, int8 queries × scales and int4 dequantized keys stay unrounded, so the scores are the
    # reference's to SCORE_TOLERANCE (half dots would round them; scoring runs once per prompt)
    CDT: tl.constexpr = tl.float32
    PREC: tl.constexpr = "ieee"
    WIDTH: tl.constexpr = LORA + ROPE
    s = tl.program_id(0)
    chunk = tl.program_id(1)
    q_start = tl.load(qsl_ptr + s).to(tl.int32)
    q_len = tl.load(qsl_ptr + s + 1).to(tl.int32) - q_start
    obs = tl.minimum(tl.load(obs_ptr + s).to(tl.int32), q_len)
    if obs > 0:
        total = tl.load(seq_lens_ptr + s).to(tl.int32)
        cl = tl.arange(0, BLOCK_L)
        cr = tl.arange(0, BLOCK_R)
        sc_l = tl.full([BLOCK_L], 1.0, dtype=tl.float32)
        sc_r = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
        if KV_INT8:
            sc_l = tl.load(scale_ptr + cl, mask=cl < LORA, other=1.0)
            sc_r = tl.load(scale_ptr + LORA + cr, mask=cr < ROPE, other=1.0)
        bt_row = bt_ptr + s.to(tl.int64) * max_blocks
        out_row = part_ptr + (s * tl.num_programs(1) + chunk).to(tl.int64) * score_len
        qk_scale = SCALE * LOG2E
        rows = tl.arange(0, BLOCK_M)
        head = chunk * HEADS + rows % HEADS
        i0 = 0
        while i0 < obs:
            tok_i = i0 + rows // HEADS  # [BLOCK_M] index among the observation tokens
            row_ok = (rows < BLOCK_Q * HEADS) & (tok_i < obs) & (head < NUM_HEADS)
            tok = q_start + q_len - obs + tok_i
            q_base = (tok.to(tl.int64) * NUM_HEADS + head) * WIDTH  # [BLOCK_M]
            q_l = tl.load(q_ptr + q_base[:, None] + cl[None, :], mask=row_ok[:, None] & (cl < LORA)[None, :],
                          other=0.0)
            q_r = tl.load(q_ptr + q_base[:, None] + LORA + cr[None, :], mask=row_ok[:, None] & (cr < ROPE)[None, :],
                          other=0.0)
            if KV_INT8:
                q_l = q_l.to(tl.float32) * sc_l[None, :]
                q_r = q_r.to(tl.float32) * sc_r[None, :]
            q_l = q_l.to(CDT)
            q_r = q_r.to(CDT)
            qpos = total - obs + tok_i
            hi = total - obs + tl.minimum(obs, i0 + BLOCK_Q)  # rows after the tile's last token are invisible
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            j0 = 0
            while j0 < hi:  # pass 1: each query row's max and denominator (online)
                sc, pos = _score_tile(q_l, q_r, j0, cache_ptr, bt_row, sc_l, sc_r, hi, qpos, cl, cr, qk_scale,
                                      KV_INT8, BLOCK_SIZE, LORA, ROPE, BLOCK_N, CDT, PREC)
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(sc - m_safe[:, None]), 1)
                m_i = m_new
                j0 += BLOCK_N
            inv = tl.where(row_ok & (l_i > 0.0), 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)  # [BLOCK_M]
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
            j0 = 0
            while j0 < hi:  # pass 2: probabilities summed over the rows (observation tokens × heads)
                sc, pos = _score_tile(q_l, q_r, j0, cache_ptr, bt_row, sc_l, sc_r, hi, qpos, cl, cr, qk_scale,
                                      KV_INT8, BLOCK_SIZE, LORA, ROPE, BLOCK_N, CDT, PREC)
                col = tl.sum(tl.exp2(sc - m_safe[:, None]) * inv[:, None], 0)  # [BLOCK_N]
                ok = pos < hi
                prev = tl.load(out_row + pos, mask=ok, other=0.0)
                tl.store(out_row + pos, prev + col, mask=ok)
                j0 += BLOCK_N
            tl.debug_barrier()
            i0 += BLOCK_Q
