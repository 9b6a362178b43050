"""Triton kernels of `kvexport::PagedAttention` (semantics: spec.py, reference.py).

Owns the device code only; configurations live in configs.py, the Python launcher in
launch.py, the TensorRT ahead-of-time registration in trt.py.

    prefill_kernel  any q_len (decode included): grid (T // BLOCK_Q + S, kv_heads). One
                    program = one tile of BLOCK_Q new tokens of one sequence × the GROUP query
                    heads of one KV head (rows r -> token r // GROUP, head r % GROUP), so each
                    KV tile is loaded once for the whole query group (GQA/MQA). The store of
                    this tile's K/V is fused in: one launch, so it is also the AOT kernel.
    decode_kernel   q_len <= 1: grid (S, kv_heads, splits). Split-K / flash-decoding: split
                    p attends to context positions [p * partition, (p + 1) * partition) and,
                    when SPLIT, writes its partial (max, sum, normalised out); split 0 stores
                    the new token's K/V.
    reduce_kernel   combines the decode partials: grid (S, num_heads).

NOTE (fused store without a grid barrier): positions < ctx are read from the pool through
the block table; the step's own positions [ctx, seq_len) are read from the key/value
inputs, rounded exactly as the store rounds them (dtype cast, or int8 quantisation). For
valid inputs (slot_mapping[t] is the block-table slot of token t) this equals "store, then
read the pool" bit for bit, with no ordering between programs. Tokens with slot < 0 are not
stored but still attend to their own K/V (the `onnx` attention does the same).

INT8 KV: attention reads the int8 codes as exact small integers in the compute dtype and
folds the per-channel scales [kv_heads, head_dim] into the query (k: s = sum_d (q_d k_scale_d)
code_d) and into the output (v: out_d = v_scale_d sum_j p_j code_jd). Legacy per-head scales
[kv_heads] load as the same vector, broadcast (SCALES_PER_CHANNEL False). Quantisation is
x / scale divided in float32 with IEEE rounding (div_rn, as onnxruntime's QuantizeLinear
does), then rounded half to even and saturated to [-128, 127], so pools match the reference
and the `onnx` attention bit for bit.

INT4 KV (KV_INT4): pool rows of ROW = HEAD_DIM / 2 + HEAD_DIM / 16 bytes (kvexport/io.py
KV_INT4_FORMAT). The store quantizes each (token, KV head) row in registers: per group of 32
lanes the extreme (max if max >= -min else min) / 8 rounded to float16, negated for a positive
extreme (it maps to -8), codes div_rn(x, scale) rounded half to even into -8..7, packed + 8 two
per byte, the float16 bits stored as little-endian bytes — the reference's bytes. Reads
dequantize (nibble - 8) * scale in float32 (exact) before the dot's operand cast.

Soft-capping (SOFTCAP > 0, Gemma 2): scores s = SCALE q·k become SOFTCAP tanh(s / SOFTCAP)
before the mask and softmax; in the log2 domain the kernels work in that is
C tanh(s' / C) with s' = s log2(e), C = SOFTCAP log2(e).

Attention sinks (SINKS, GPT-OSS): a constexpr tuple of num_heads float32 logits (None: none).
Each row's sink joins its softmax denominator once, after the key loop (`_add_sinks`: the
running max becomes max(m, sink log2 e), acc and l rescaled to it, l += 2^(sink' - max)); the
split-K decode leaves it to the reduce kernel, so it is counted once, not once per split.
NOTE: a constexpr, not a tensor: the AOT plugin's kernel arguments are the 11 inputs, int32
scalars and the 3 outputs (no device buffer of attributes), so each layer's sinks are compiled
into its own kernel; the row's value is picked by a static loop over the heads (selects, once
per program).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _quantize(x, scale):
    """x / scale (float32, correctly rounded) rounded half to even and saturated to
    [-128, 127], as float64 integers."""
    # NOTE: div_rn, not `/`: Triton's fp32 `/` is an approximate division on GPUs
    y = tl.math.div_rn(x.to(tl.float32), scale.to(tl.float32)).to(tl.float64)
    y = tl.minimum(tl.maximum(y, -128.0), 127.0)
    r = tl.floor(y + 0.5)  # exact: |y| <= 128 leaves float64 bits to spare
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.constexpr_function
def _row(head_dim, kv_int4):
    """Elements of one pool row: HEAD_DIM, or int4's bytes (io.kv_row_width)."""
    return head_dim // 2 + head_dim // 16 if kv_int4 else head_dim


@triton.jit
def _round_half_even(y):
    """float64 y (|y| small) rounded half to even, exactly."""
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _f16_value(x):
    """float32 -> the nearest float16 (ties to even, saturating at ±65504), as float32."""
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16).to(tl.float32)


@triton.jit
def _int4_quantize(x, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """x [ROWS, BLOCK_D] float32 -> (codes [ROWS, BLOCK_D] float32 in -8..7, scale [ROWS,
    BLOCK_D // 32] float32 holding float16 values), io.KV_INT4_FORMAT. Lanes past HEAD_DIM are
    whole groups of their own (HEAD_DIM % 32 == 0), never stored."""
    xg = tl.reshape(x, (ROWS, BLOCK_D // 32, 32))
    lo = tl.min(xg, 2)
    hi = tl.max(xg, 2)
    pos = hi >= -lo  # the extreme is the maximum (ties: the maximum); it maps to -8
    mag = _f16_value(tl.maximum(tl.where(pos, hi, -lo) * 0.125, 6.103515625e-05))  # / 8: exact
    scale = tl.where(pos, -mag, mag)
    y = tl.math.div_rn(xg, tl.broadcast_to(scale[:, :, None], xg.shape)).to(tl.float64)
    codes = _round_half_even(tl.minimum(tl.maximum(y, -8.0), 7.0)).to(tl.float32)
    return tl.reshape(codes, (ROWS, BLOCK_D)), scale


@triton.jit
def _int4_dequantize(codes, scale, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """codes [ROWS, BLOCK_D], scale [ROWS, BLOCK_D // 32] -> [ROWS, BLOCK_D] float32."""
    cg = tl.reshape(codes, (ROWS, BLOCK_D // 32, 32))
    return tl.reshape(cg * scale[:, :, None], (ROWS, BLOCK_D))


@triton.jit
def _int4_store(ptr, row_base, x, ok, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows x [ROWS, BLOCK_D] float32 -> int4 pool rows at byte offsets row_base [ROWS] (rows with ok)."""
    codes, scale = _int4_quantize(x, ROWS, BLOCK_D)
    even, odd = tl.split(tl.reshape(codes.to(tl.int32) + 8, (ROWS, BLOCK_D // 2, 2)))
    c = tl.arange(0, BLOCK_D // 2)
    tl.store(ptr + row_base[:, None] + c[None, :], (even | (odd << 4)).to(tl.uint8),
             mask=ok[:, None] & (c < HEAD_DIM // 2)[None, :])
    g = tl.arange(0, BLOCK_D // 32)
    at = row_base[:, None] + HEAD_DIM // 2 + 2 * g[None, :]  # [ROWS, groups]
    gm = ok[:, None] & (g < HEAD_DIM // 32)[None, :]
    sb = scale.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
    tl.store(ptr + at, (sb & 255).to(tl.uint8), mask=gm)
    tl.store(ptr + at + 1, (sb >> 8).to(tl.uint8), mask=gm)


@triton.jit
def _f16_at(ptr, off, mask):
    """The float16 stored little-endian at byte offsets `off`, as float32 (0 where masked)."""
    lo = tl.load(ptr + off, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + off + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _int4_load(ptr, row_base, ok, d, HEAD_DIM: tl.constexpr):
    """int4 pool rows at byte offsets row_base [N] -> [N, BLOCK_D] float32 (lanes d)."""
    byte = tl.load(ptr + row_base[:, None] + (d // 2)[None, :], mask=ok, other=0).to(tl.int32)
    code = ((byte >> ((d % 2) * 4)[None, :]) & 15) - 8
    at = row_base[:, None] + (HEAD_DIM // 2 + 2 * (d // 32))[None, :]
    return code.to(tl.float32) * _f16_at(ptr, at, ok)


@triton.jit
def _tanh(x):
    """tanh in float32 from exp2 (no libdevice: the interpreter runs it too); |error| < 1e-7."""
    t = tl.exp2(-2.0 * LOG2E * tl.abs(x))  # in (0, 1]
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -r, r)


@triton.jit
def _sink_logits(head, SINKS: tl.constexpr, NUM_HEADS: tl.constexpr):
    """SINKS[head] * log2(e) for an int tensor (or scalar) of query heads, float32."""
    sk = tl.zeros_like(head).to(tl.float32)
    for i in tl.static_range(NUM_HEADS):
        sk = tl.where(head == i, SINKS[i] * LOG2E, sk)
    return sk


@triton.jit
def _add_sinks(acc, m_i, l_i, head, SINKS: tl.constexpr, NUM_HEADS: tl.constexpr):
    """(acc [BLOCK_M, BLOCK_D], m_i, l_i [BLOCK_M]) with each row's sink in the denominator
    (log2 domain; rows that saw no key get l = 1 and acc = 0)."""
    sk = _sink_logits(head, SINKS, NUM_HEADS)
    m_new = tl.maximum(m_i, sk)
    alpha = tl.exp2(m_i - m_new)  # 0 where m_i = -inf
    return acc * alpha[:, None], m_new, l_i * alpha + tl.exp2(sk - m_new)


@triton.jit
def _store_rows(k_ptr, v_ptr, slot_ptr, kc_out_ptr, vc_out_ptr, k_scale, v_scale, tok, row_ok, kvh,
                head_base, d, d_ok, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                KV_INT8: tl.constexpr, KV_INT4: tl.constexpr = False, ROWS: tl.constexpr = 0,
                BLOCK_D: tl.constexpr = 0):
    """Pools <- this step's K/V of tokens `tok` [ROWS] (rows with row_ok) for KV head kvh;
    k_scale / v_scale [BLOCK_D] (int8)."""
    ROW: tl.constexpr = _row(HEAD_DIM, KV_INT4)
    slot = tl.load(slot_ptr + tok, mask=row_ok, other=-1)  # [ROWS] int64
    ok = (row_ok & (slot >= 0))[:, None] & d_ok[None, :]
    src = (tok * NUM_KV_HEADS + kvh)[:, None] * HEAD_DIM + d[None, :]  # [ROWS, BLOCK_D]
    dst = head_base + slot[:, None] * ROW + d[None, :]  # slot = block * bs + offset
    kx = tl.load(k_ptr + src, mask=ok, other=0.0)
    vx = tl.load(v_ptr + src, mask=ok, other=0.0)
    if KV_INT4:
        row_base = head_base + slot * ROW  # [ROWS]
        _int4_store(kc_out_ptr, row_base, kx.to(tl.float32), row_ok & (slot >= 0), HEAD_DIM, ROWS, BLOCK_D)
        _int4_store(vc_out_ptr, row_base, vx.to(tl.float32), row_ok & (slot >= 0), HEAD_DIM, ROWS, BLOCK_D)
    else:
        if KV_INT8:
            kx = _quantize(kx, k_scale[None, :])
            vx = _quantize(vx, v_scale[None, :])
        tl.store(kc_out_ptr + dst, kx.to(tl.float32).to(kc_out_ptr.dtype.element_ty), mask=ok)
        tl.store(vc_out_ptr + dst, vx.to(tl.float32).to(vc_out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _kv_tile(cache_ptr, new_ptr, bt_row_ptr, scale, pos, lim, ctx, q_start, kvh, head_base, d, d_ok,
             FROM_POOL: tl.constexpr, KV_INT8: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, CDT: tl.constexpr,
             KV_INT4: tl.constexpr = False, BLOCK_N: tl.constexpr = 0, BLOCK_D: tl.constexpr = 0):
    """K or V at positions `pos` [BLOCK_N] (< lim) of one sequence: [BLOCK_N, BLOCK_D] in CDT,
    int8 codes unscaled, int4 rows dequantized. FROM_POOL: through the block table; else this
    step's input (rounded as the store rounds it)."""
    ROW: tl.constexpr = _row(HEAD_DIM, KV_INT4)
    ok = (pos < lim)[:, None] & d_ok[None, :]
    if FROM_POOL:
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos < lim, other=0)  # [BLOCK_N] int64
        off = head_base + (blk * BLOCK_SIZE + pos % BLOCK_SIZE) * ROW
        if KV_INT4:
            x = _int4_load(cache_ptr, off, ok, d, HEAD_DIM).to(CDT)
        else:
            x = tl.load(cache_ptr + off[:, None] + d[None, :], mask=ok, other=0).to(CDT)
    else:
        tok = q_start + pos - ctx  # [BLOCK_N] token index of this step
        src = (tok * NUM_KV_HEADS + kvh)[:, None] * HEAD_DIM + d[None, :]
        x = tl.load(new_ptr + src, mask=ok, other=0.0)
        if KV_INT4:
            codes, sc = _int4_quantize(x.to(tl.float32), BLOCK_N, BLOCK_D)
            x = tl.where(ok, _int4_dequantize(codes, sc, BLOCK_N, BLOCK_D), 0.0).to(CDT)
        elif KV_INT8:
            x = _quantize(x, scale[None, :]).to(CDT)
        else:
            x = x.to(tl.float32).to(cache_ptr.dtype.element_ty).to(CDT)  # rounded as stored
    return x


@triton.jit
def _attend_step(acc, m_i, l_i, q, j0, kc_ptr, vc_ptr, k_ptr, v_ptr, bt_row_ptr, k_scale, v_scale, hi,
                 ctx, q_start, qpos, kvh, head_base, d, d_ok, qk_scale,
                 FROM_POOL: tl.constexpr, KV_INT8: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr, KV_INT4: tl.constexpr = False,
                 BLOCK_D: tl.constexpr = 0):
    """Online-softmax update of (acc [BLOCK_M, BLOCK_D], m_i, l_i [BLOCK_M]) with the keys at
    positions [j0, j0 + BLOCK_N) ∩ [.., hi); scores in the log2 domain (qk_scale has log2 e)."""
    pos = j0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    k = _kv_tile(kc_ptr, k_ptr, bt_row_ptr, k_scale, pos, hi, ctx, q_start, kvh, head_base, d, d_ok,
                 FROM_POOL, KV_INT8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, CDT, KV_INT4, BLOCK_N, BLOCK_D)
    v = _kv_tile(vc_ptr, v_ptr, bt_row_ptr, v_scale, pos, hi, ctx, q_start, kvh, head_base, d, d_ok,
                 FROM_POOL, KV_INT8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, CDT, KV_INT4, BLOCK_N, BLOCK_D)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    if SOFTCAP > 0:
        s = (SOFTCAP * LOG2E) * _tanh(s / (SOFTCAP * LOG2E))
    vis = (pos[None, :] <= qpos[:, None]) & (pos < hi)[None, :]
    if WINDOW > 0:
        vis = vis & (qpos[:, None] - pos[None, :] < WINDOW)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(CDT), v, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _attend(acc, m_i, l_i, q, kc_ptr, vc_ptr, k_ptr, v_ptr, bt_row_ptr, k_scale, v_scale, lo, hi,
            ctx, q_start, qpos, kvh, head_base, d, d_ok, qk_scale,
            FROM_POOL: tl.constexpr, KV_INT8: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_N: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
            KV_INT4: tl.constexpr = False, BLOCK_D: tl.constexpr = 0):
    """`_attend_step` over the keys at positions [lo, hi).
    NOTE: a `for` loop (software-pipelined by the compiler) on the GPU; a `while` loop under
    TRITON_INTERPRET=1, whose `range()` over device scalars fails with numpy >= 2.3
    (triton 3.6 interpreter: int() of a 1-element array)."""
    if INTERPRET:
        j0 = lo
        while j0 < hi:
            acc, m_i, l_i = _attend_step(acc, m_i, l_i, q, j0, kc_ptr, vc_ptr, k_ptr, v_ptr, bt_row_ptr,
                                         k_scale, v_scale, hi, ctx, q_start, qpos, kvh, head_base, d, d_ok,
                                         qk_scale, FROM_POOL, KV_INT8, WINDOW, SOFTCAP, BLOCK_SIZE,
                                         NUM_KV_HEADS, HEAD_DIM, BLOCK_N, CDT, PREC, KV_INT4, BLOCK_D)
            j0 += BLOCK_N
    else:
        for j0 in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _attend_step(acc, m_i, l_i, q, j0, kc_ptr, vc_ptr, k_ptr, v_ptr, bt_row_ptr,
                                         k_scale, v_scale, hi, ctx, q_start, qpos, kvh, head_base, d, d_ok,
                                         qk_scale, FROM_POOL, KV_INT8, WINDOW, SOFTCAP, BLOCK_SIZE,
                                         NUM_KV_HEADS, HEAD_DIM, BLOCK_N, CDT, PREC, KV_INT4, BLOCK_D)
    return acc, m_i, l_i


@triton.constexpr_function
def _compute_dtype(act, interpret):
    """Dot operand dtype: the activation dtype (fp32 dots run in IEEE fp32). NOTE: bf16 runs
    as fp32 under TRITON_INTERPRET=1: triton 3.6's interpreter multiplies bf16 as raw uint16."""
    return tl.float32 if (interpret and act == tl.bfloat16) else act


@triton.jit
def _find_seq(qsl_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence owning q-tile `q_block`: the last s with qsl[s] // BLOCK_Q + s <= q_block
    (sequence s owns the tiles from qsl[s] // BLOCK_Q + s on; T // BLOCK_Q + S tiles in all)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _kv_head(ks_ptr, vs_ptr, kvh, num_blocks, KV_INT8: tl.constexpr, SCALES_PER_CHANNEL: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
             KV_INT4: tl.constexpr = False):
    """What a program needs of its KV head: the head_dim lanes and their mask, the head's
    offset in the pool, and its int8 scales as [BLOCK_D] float32 vectors (ones for float
    pools and masked lanes; a per-head scale repeated when not SCALES_PER_CHANNEL)."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    head_base = kvh.to(tl.int64) * num_blocks * BLOCK_SIZE * _row(HEAD_DIM, KV_INT4)
    k_scale = tl.full([BLOCK_D], 1.0, dtype=tl.float32)
    v_scale = tl.full([BLOCK_D], 1.0, dtype=tl.float32)
    if KV_INT8:
        if SCALES_PER_CHANNEL:
            at = kvh * HEAD_DIM + d  # [kv_heads, head_dim] row-major
        else:
            at = kvh + d * 0
        k_scale = tl.load(ks_ptr + at, mask=d_ok, other=1.0)
        v_scale = tl.load(vs_ptr + at, mask=d_ok, other=1.0)
    return d, d_ok, head_base, k_scale, v_scale


@triton.jit
def _fold_k_scale(q, k_scale, KV_INT8: tl.constexpr):
    """int8: q [BLOCK_M, BLOCK_D] times the per-channel key scales, in float32 (the key
    codes then stay exact integers in the dot)."""
    if KV_INT8:
        q = q.to(tl.float32) * k_scale[None, :]
    return q


@triton.jit
def _attend_pool_then_step(q, kc_ptr, vc_ptr, k_ptr, v_ptr, bt_row, k_scale, v_scale, lo, hi, ctx, q_start, qpos,
                           kvh, head_base, d, d_ok, qk_scale, KV_INT8: tl.constexpr, WINDOW: tl.constexpr,
                           SOFTCAP: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           CDT: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
                           KV_INT4: tl.constexpr = False):
    """Online softmax over keys [lo, hi): those before `ctx` from the pool, the rest (this
    step's) from the step's own K/V. Returns (acc, m_i, l_i) unnormalised."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, kc_ptr, vc_ptr, k_ptr, v_ptr, bt_row, k_scale, v_scale,
                            lo, tl.minimum(hi, ctx), ctx, q_start, qpos, kvh, head_base, d, d_ok,
                            qk_scale, True, KV_INT8, WINDOW, SOFTCAP, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                            BLOCK_N, CDT, PREC, INTERPRET, KV_INT4, BLOCK_D)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, kc_ptr, vc_ptr, k_ptr, v_ptr, bt_row, k_scale, v_scale,
                            tl.maximum(lo, ctx), hi, ctx, q_start, qpos, kvh, head_base, d, d_ok,
                            qk_scale, False, KV_INT8, WINDOW, SOFTCAP, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                            BLOCK_N, CDT, PREC, INTERPRET, KV_INT4, BLOCK_D)
    return acc, m_i, l_i


@triton.jit
def prefill_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, slot_ptr,
                   ks_ptr, vs_ptr, num_seqs, max_blocks, num_blocks, out_ptr, kc_out_ptr, vc_out_ptr,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, SCALE: tl.constexpr, WINDOW: tl.constexpr,
                   KV_INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr = 0.0, SCALES_PER_CHANNEL: tl.constexpr = True,
                   INTERPRET: tl.constexpr = False, KV_INT4: tl.constexpr = False, SINKS: tl.constexpr = None):
    """Argument order = the AOT plugin's: the 11 inputs, the int32 extras, the 3 outputs."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    CDT: tl.constexpr = _compute_dtype(q_ptr.dtype.element_ty, INTERPRET)
    PREC: tl.constexpr = "ieee" if CDT == tl.float32 else "tf32"
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    s = _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(qsl_ptr + s).to(tl.int32)
    q_len = tl.load(qsl_ptr + s + 1).to(tl.int32) - q_start
    tile0 = (pid - (q_start // BLOCK_Q + s)) * BLOCK_Q  # first new token of this tile
    if tile0 < q_len:
        ctx = tl.load(seq_lens_ptr + s).to(tl.int32) - q_len  # tokens already in the pool
        rows = tl.arange(0, BLOCK_M)
        tok_i = tile0 + rows // GROUP  # [BLOCK_M] token index within the sequence
        row_ok = (rows < BLOCK_Q * GROUP) & (tok_i < q_len)
        tok = q_start + tok_i
        head = kvh * GROUP + rows % GROUP
        d, d_ok, head_base, k_scale, v_scale = _kv_head(ks_ptr, vs_ptr, kvh, num_blocks, KV_INT8,
                                                        SCALES_PER_CHANNEL, BLOCK_SIZE, HEAD_DIM, BLOCK_D, KV_INT4)
        _store_rows(k_ptr, v_ptr, slot_ptr, kc_out_ptr, vc_out_ptr, k_scale, v_scale, tok,
                    row_ok & (rows % GROUP == 0), kvh, head_base, d, d_ok, NUM_KV_HEADS, HEAD_DIM, KV_INT8,
                    KV_INT4, BLOCK_M, BLOCK_D)
        q_off = (tok * (NUM_KV_HEADS * GROUP) + head)[:, None] * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        q = _fold_k_scale(q, k_scale, KV_INT8).to(CDT)
        qpos = ctx + tok_i  # [BLOCK_M] absolute positions
        hi = ctx + tl.minimum(q_len, tile0 + BLOCK_Q)  # keys after the tile's last token are invisible
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(ctx + tile0 - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        qk_scale = SCALE * LOG2E
        bt_row = bt_ptr + s.to(tl.int64) * max_blocks
        acc, m_i, l_i = _attend_pool_then_step(q, kc_ptr, vc_ptr, k_ptr, v_ptr, bt_row, k_scale, v_scale, lo, hi, ctx,
                                               q_start, qpos, kvh, head_base, d, d_ok, qk_scale, KV_INT8, WINDOW,
                                               SOFTCAP, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, CDT,
                                               PREC, INTERPRET, KV_INT4)
        if SINKS is not None:
            acc, m_i, l_i = _add_sinks(acc, m_i, l_i, head, SINKS, NUM_KV_HEADS * GROUP)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc * (1.0 / l_i)[:, None] * v_scale[None, :]  # [BLOCK_M, BLOCK_D]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def decode_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, slot_ptr,
                  ks_ptr, vs_ptr, max_blocks, num_blocks, partition, out_ptr, kc_out_ptr, vc_out_ptr,
                  part_out_ptr, part_m_ptr, part_l_ptr,
                  NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, SCALE: tl.constexpr, WINDOW: tl.constexpr,
                  KV_INT8: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
                  SCALES_PER_CHANNEL: tl.constexpr = True, INTERPRET: tl.constexpr = False,
                  KV_INT4: tl.constexpr = False, SINKS: tl.constexpr = None):
    """One new token per sequence (q_len 0: nothing to do). `partition` (a multiple of
    BLOCK_N) context positions per split; part_* [S, H, splits(, D)] float32 when SPLIT."""
    CDT: tl.constexpr = _compute_dtype(q_ptr.dtype.element_ty, INTERPRET)
    PREC: tl.constexpr = "ieee" if CDT == tl.float32 else "tf32"
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    q_start = tl.load(qsl_ptr + s).to(tl.int32)
    q_len = tl.load(qsl_ptr + s + 1).to(tl.int32) - q_start
    if q_len > 0:
        total = tl.load(seq_lens_ptr + s).to(tl.int32)
        ctx = total - 1
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < GROUP
        head = kvh * GROUP + rows  # [BLOCK_M]
        d, d_ok, head_base, k_scale, v_scale = _kv_head(ks_ptr, vs_ptr, kvh, num_blocks, KV_INT8,
                                                        SCALES_PER_CHANNEL, BLOCK_SIZE, HEAD_DIM, BLOCK_D, KV_INT4)
        tok = q_start + rows * 0  # [BLOCK_M] all rows are the same token
        if split == 0:
            _store_rows(k_ptr, v_ptr, slot_ptr, kc_out_ptr, vc_out_ptr, k_scale, v_scale, tok, rows == 0,
                        kvh, head_base, d, d_ok, NUM_KV_HEADS, HEAD_DIM, KV_INT8, KV_INT4, BLOCK_M, BLOCK_D)
        q_off = (tok * (NUM_KV_HEADS * GROUP) + head)[:, None] * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        q = _fold_k_scale(q, k_scale, KV_INT8).to(CDT)
        qpos = ctx + rows * 0
        lo = split * partition
        hi = tl.minimum(lo + partition, total)
        if WINDOW > 0:
            lo = tl.maximum(lo, tl.maximum(total - WINDOW, 0) // BLOCK_N * BLOCK_N)
        qk_scale = SCALE * LOG2E
        bt_row = bt_ptr + s.to(tl.int64) * max_blocks
        acc, m_i, l_i = _attend_pool_then_step(q, kc_ptr, vc_ptr, k_ptr, v_ptr, bt_row, k_scale, v_scale, lo, hi, ctx,
                                               q_start, qpos, kvh, head_base, d, d_ok, qk_scale, KV_INT8, WINDOW,
                                               SOFTCAP, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, CDT,
                                               PREC, INTERPRET, KV_INT4)
        if SINKS is not None and not SPLIT:  # split-K: the reduce kernel adds them, once
            acc, m_i, l_i = _add_sinks(acc, m_i, l_i, head, SINKS, NUM_KV_HEADS * GROUP)
        out = acc * (1.0 / tl.where(l_i == 0.0, 1.0, l_i))[:, None] * v_scale[None, :]  # [BLOCK_M, BLOCK_D]
        if SPLIT:
            idx = (s * (NUM_KV_HEADS * GROUP) + head) * num_splits + split  # [BLOCK_M]
            tl.store(part_m_ptr + idx, m_i, mask=row_ok)
            tl.store(part_l_ptr + idx, l_i, mask=row_ok)
            tl.store(part_out_ptr + idx[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        else:
            tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def reduce_kernel(part_out_ptr, part_m_ptr, part_l_ptr, qsl_ptr, out_ptr, num_splits,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  MAX_SPLITS: tl.constexpr, SINKS: tl.constexpr = None):
    """out[token of s, h] = the decode partials of (s, h) merged: weights 2^(m_p - max) * l_p
    (with SINKS, the head's sink 2^(sink' - max) joins the denominator)."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(qsl_ptr + s).to(tl.int32)
    q_len = tl.load(qsl_ptr + s + 1).to(tl.int32) - q_start
    if q_len > 0:
        sp = tl.arange(0, MAX_SPLITS)
        ok = sp < num_splits
        idx = (s * NUM_HEADS + h) * num_splits + sp  # [MAX_SPLITS]
        m = tl.load(part_m_ptr + idx, mask=ok, other=float("-inf"))
        l_p = tl.load(part_l_ptr + idx, mask=ok, other=0.0)
        m_max = tl.max(m, 0)
        if SINKS is not None:
            sk = _sink_logits(h, SINKS, NUM_HEADS)
            m_max = tl.maximum(m_max, sk)
        w = tl.where(l_p > 0.0, tl.exp2(m - m_max) * l_p, 0.0)  # [MAX_SPLITS]
        d = tl.arange(0, BLOCK_D)
        o = tl.load(part_out_ptr + idx[:, None] * HEAD_DIM + d[None, :],
                    mask=ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # [MAX_SPLITS, BLOCK_D]
        denom = tl.sum(w, 0)
        if SINKS is not None:
            denom = denom + tl.exp2(sk - m_max)
        res = tl.sum(w[:, None] * o, 0) / denom  # [BLOCK_D]
        tl.store(out_ptr + (q_start * NUM_HEADS + h) * HEAD_DIM + d, res.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)


@triton.jit
def _score_tile(q, j0, kc_ptr, bt_row, k_scale, hi, qpos, kvh, head_base, d, d_ok, qk_scale,
                KV_INT8: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CDT: tl.constexpr,
                PREC: tl.constexpr, KV_INT4: tl.constexpr, BLOCK_D: tl.constexpr):
    """(scores [BLOCK_M, BLOCK_N] in the log2 domain, -inf where invisible; positions [BLOCK_N]) of
    the pool's keys at [j0, j0 + BLOCK_N) ∩ [.., hi), as `_attend_step` computes them."""
    pos = j0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    k = _kv_tile(kc_ptr, kc_ptr, bt_row, k_scale, pos, hi, 0, 0, kvh, head_base, d, d_ok, True, KV_INT8,
                 BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, CDT, KV_INT4, BLOCK_N, BLOCK_D)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    if SOFTCAP > 0:
        s = (SOFTCAP * LOG2E) * _tanh(s / (SOFTCAP * LOG2E))
    vis = (pos[None, :] <= qpos[:, None]) & (pos < hi)[None, :]
    if WINDOW > 0:
        vis = vis & (qpos[:, None] - pos[None, :] < WINDOW)
    return tl.where(vis, s, float("-inf")), pos


@triton.jit
def scores_kernel(q_ptr, kc_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, ks_ptr, obs_ptr, max_blocks, num_blocks,
                  score_len, scores_ptr,
                  NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, SCALE: tl.constexpr, WINDOW: tl.constexpr,
                  KV_INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr = 0.0, SCALES_PER_CHANNEL: tl.constexpr = True,
                  INTERPRET: tl.constexpr = False, KV_INT4: tl.constexpr = False, SINKS: tl.constexpr = None):
    """The optional attention_scores output (spec.py "Attention scores"): grid (S, kv_heads), run
    after the attention (the pool holds this step's keys). Program (s, kvh) zeroes its row
    scores[s, kvh, :score_len] (so the output needs no zeroing: an AOT plugin's is not), then adds the
    probabilities of sequence s's last min(obs_lens[s], q_len) tokens
    × the GROUP query heads of kvh, BLOCK_M rows at a time: pass 1 over the keys gives each row's
    max and denominator (sinks included), pass 2 recomputes the scores and adds each key tile's
    column sums. NOTE: `while` loops (the interpreter's `range` over device scalars fails, see
    `_attend`; this kernel runs once per completed prompt, unpipelined is fine); a barrier after
    each row tile orders its read-modify-write of the row before the next tile's."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    # NOTE: dots in IEEE float32 whatever the activation dtype: half queries and pools convert
    # exactly, int8 queries × scales and int4 dequantized keys stay unrounded, so the scores are the
    # reference's to SCORE_TOLERANCE (half dots would round them; scoring runs once per prompt)
    CDT: tl.constexpr = tl.float32
    PREC: tl.constexpr = "ieee"
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    q_start = tl.load(qsl_ptr + s).to(tl.int32)
    q_len = tl.load(qsl_ptr + s + 1).to(tl.int32) - q_start
    obs = tl.minimum(tl.load(obs_ptr + s).to(tl.int32), q_len)
    out_row = scores_ptr + (s * NUM_KV_HEADS + kvh).to(tl.int64) * score_len
    z0 = 0
    while z0 < score_len:
        at = z0 + tl.arange(0, BLOCK_N)
        tl.store(out_row + at, tl.zeros([BLOCK_N], dtype=tl.float32), mask=at < score_len)
        z0 += BLOCK_N
    tl.debug_barrier()
    if obs > 0:
        total = tl.load(seq_lens_ptr + s).to(tl.int32)
        d, d_ok, head_base, k_scale, v_scale = _kv_head(ks_ptr, ks_ptr, kvh, num_blocks, KV_INT8,
                                                        SCALES_PER_CHANNEL, BLOCK_SIZE, HEAD_DIM, BLOCK_D, KV_INT4)
        bt_row = bt_ptr + s.to(tl.int64) * max_blocks
        qk_scale = SCALE * LOG2E
        rows = tl.arange(0, BLOCK_M)
        head = kvh * GROUP + rows % GROUP
        i0 = 0
        while i0 < obs:
            tok_i = i0 + rows // GROUP  # [BLOCK_M] index among the observation tokens
            row_ok = (rows < BLOCK_Q * GROUP) & (tok_i < obs)
            tok = q_start + q_len - obs + tok_i
            q_off = (tok * (NUM_KV_HEADS * GROUP) + head)[:, None] * HEAD_DIM + d[None, :]
            q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
            q = _fold_k_scale(q, k_scale, KV_INT8).to(CDT)
            qpos = total - obs + tok_i  # [BLOCK_M] absolute positions
            hi = total - obs + tl.minimum(obs, i0 + BLOCK_Q)  # keys after the tile's last row are invisible
            lo = 0
            if WINDOW > 0:
                lo = tl.maximum(total - obs + i0 - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            j0 = lo
            while j0 < hi:  # pass 1: each row's max and denominator (online)
                sc, pos = _score_tile(q, j0, kc_ptr, bt_row, k_scale, hi, qpos, kvh, head_base, d, d_ok, qk_scale,
                                      KV_INT8, WINDOW, SOFTCAP, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, CDT,
                                      PREC, KV_INT4, BLOCK_D)
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(sc - m_safe[:, None]), 1)
                m_i = m_new
                j0 += BLOCK_N
            if SINKS is not None:
                sk = _sink_logits(head, SINKS, NUM_KV_HEADS * GROUP)
                m_new = tl.maximum(m_i, sk)
                l_i = l_i * tl.exp2(m_i - m_new) + tl.exp2(sk - m_new)
                m_i = m_new
            inv = tl.where(row_ok & (l_i > 0.0), 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)  # [BLOCK_M]
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
            j0 = lo
            while j0 < hi:  # pass 2: probabilities, summed over the rows (queries × heads of the group)
                sc, pos = _score_tile(q, j0, kc_ptr, bt_row, k_scale, hi, qpos, kvh, head_base, d, d_ok, qk_scale,
                                      KV_INT8, WINDOW, SOFTCAP, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, CDT,
                                      PREC, KV_INT4, BLOCK_D)
                col = tl.sum(tl.exp2(sc - m_safe[:, None]) * inv[:, None], 0)  # [BLOCK_N]
                ok = pos < hi
                prev = tl.load(out_row + pos, mask=ok, other=0.0)
                tl.store(out_row + pos, prev + col, mask=ok)
                j0 += BLOCK_N
            tl.debug_barrier()
            i0 += BLOCK_Q
