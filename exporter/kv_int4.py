"""int4 KV rows (kvexport/io.py KV_INT4_FORMAT) written with standard ONNX ops, and the fixed
Hadamard rotation int4 graphs apply to q, k and v.

The `onnx` attention and contiguous builds quantize with `quantize_rows` and read pools back
with `dequantize_rows`; they store the same bytes as plugins/paged_attention/reference.py
quantize_int4 (tests/exporter/test_int4_kv_graphs.py). Opset 18 has no bit casts, so the
float16 bits of each scale are computed by exact arithmetic: the value is first rounded
to float16 by Cast (round to nearest even), its exponent field counted against the powers of
two 2^-14..2^15, and its mantissa is then an exact quotient by a power of two.

    x [.., D] ─ groups of 32 ─> lo, hi ─> e = hi if hi >= -lo else lo (the extreme)
      ─> scale = ∓f16(max(|e| / 8, 2^-14)) (negative for a positive extreme: e maps to -8)
      ─> code = clip(round(x / scale), -8, 7) + 8 ─> pairs ─> lo | hi << 4    [.., D/2] uint8
      scale ─> float16 bits ─> little-endian bytes                          [.., D/16] uint8
      ─> Concat ─> row [.., D/2 + D/16] uint8

The key transform (`key_transform`): int4 graphs store rotate((k - μ) / s) and attend with
rotate(q * s), μ and s [kv_heads, head_dim] per layer, calibrated (the calibration text, as int8
KV's scales): μ the mean post-RoPE key, s from each channel's spread about it (SMOOTH_ALPHA).
Exact for softmax attention: (q * s)·((k - μ) / s) = q·k - q·μ, and q·μ is the same for every
key a query reads, so the softmax (and the output) is unchanged; the op and the pool bytes are
the same as without.
Why: Qwen2's k bias puts a few channels tens of times above the rest at every token, and
per-token groups spent their 16 levels on them — μ takes the constant part away, s equalizes the
channels that move (RoPE pairs sharing theirs), as KIVI's per-channel key scales do, but static
(Qwen2.5-Coder-0.5B: +91.8% perplexity with neither; docs/QUANTIZATION.md "int4 KV").
NOTE: μ is not exact with a logit soft-cap (tanh of the shifted score) or learned attention
sinks (a sink logit is not shifted with the keys): such layers get μ = 0 (s stays: it is exact).
"""

from __future__ import annotations

import numpy as np

from kvexport import io

from .onnx_builder import GraphBuilder, onnx_dtype

F16_MAX = 65504.0
MIN_SCALE = 2.0 ** -14
# exponent field e -> the value of one mantissa unit, 2^(max(e, 1) - 25) (e = 31, inf/NaN: never stored)
_UNIT = np.array([2.0 ** (max(e, 1) - 25) for e in range(32)], np.float32)
_POW2 = np.array([2.0 ** k for k in range(-14, 16)], np.float32)  # a >= 2^k counts the exponent field


def hadamard(d: int) -> np.ndarray:
    """The rotation of int4 graphs: [d, d] float32, block-diagonal with normalized Sylvester
    Hadamard blocks of n = the largest power of two dividing d (64 for head_dim 64, 32 for 96).
    Orthogonal and symmetric, so q·H·(k·H)ᵀ = q·kᵀ and (p·v·H)·H = p·v.
    NOTE: one matrix for q, k and v of every layer: it spreads a channel outlier over n
    channels, so a group's scale no longer spends its 16 levels on one channel."""
    n = d & -d
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(d // n), h / np.sqrt(n)).astype(np.float32)


SMOOTH_ALPHA = 0.5  # s = (sd / mean sd) ** alpha (docs/QUANTIZATION.md "int4 KV": 0.5 measured best of 0, 0.5, 1, clip)


def key_transform(model, ids: list[int], exact: list[bool], rotary_dim: int, chunk: int = 512) -> np.ndarray:
    """The int4 key transform calibrated on `ids`: [layers, 2, kv_heads, head_dim] float32 holding
    μ (the mean post-RoPE key; zeros for the layers where `exact[i]` is False) and s (per channel
    (sd / the head's mean sd) ** SMOOTH_ALPHA, sd its standard deviation about μ, RoPE pairs
    c, c + rotary_dim / 2 sharing theirs: wide channels are narrowed, quiet ones widened, halfway
    to equal). One sequence fed in chunks that continue transformers' cache, as
    exporter/calibrate.py compute_scales (the module docstring says why)."""
    import torch

    total, squares, count, cache = 0.0, 0.0, 0, None
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            cache = model(torch.tensor([piece]), cache=cache, use_cache=True).cache
            # keys [1, kv_heads, seq, head_dim]: this chunk's are the last len(piece) (a sliding
            # window layer may keep fewer: its count is what it kept)
            keys = [layer.keys[0, :, -len(piece):].double() for layer in cache.layers]
            total = total + np.stack([k.sum(1).numpy() for k in keys])
            squares = squares + np.stack([(k ** 2).sum(1).numpy() for k in keys])
            count = count + np.array([k.shape[1] for k in keys], np.float64)[:, None, None]
    mean = total / count
    var = np.maximum(squares / count - mean ** 2, 0.0)
    half = rotary_dim // 2
    if half:  # NOTE: RoPE moves a key's energy between c and c + half: the pair shares one scale
        pair = (var[..., :half] + var[..., half:rotary_dim]) / 2
        var = np.concatenate([pair, pair, var[..., rotary_dim:]], axis=-1)
    sd = np.sqrt(var)
    sd = np.maximum(sd, 1e-3 * sd.mean(-1, keepdims=True) + 1e-30)  # a constant channel: no division by 0
    scale = (sd / sd.mean(-1, keepdims=True)) ** SMOOTH_ALPHA
    mu = mean.astype(np.float32)
    mu[~np.asarray(exact, bool)] = 0.0
    return np.stack([mu, scale.astype(np.float32)], axis=1)


def transform_entry(t: np.ndarray, text: str, ids: list[int]) -> dict:
    """The manifest's kv.quantization["key_transform"] record (the values are the graphs'
    kvexport/io.py k_offset / k_channel_scale initializers)."""
    import hashlib

    return {"kind": "calibrated", "applied": "post-RoPE, before the rotation: k' = (k - offset) / scale, "
                                             "q' = q * scale (q'·k' = q·k - q·offset)",
            "calibration": {"text": text, "tokens": len(ids),
                            "ids_sha256": hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()},
            "layers_without_offset": [i for i in range(t.shape[0]) if not t[i, 0].any()],
            "offsets": t[:, 0].tolist(), "scales": t[:, 1].tolist()}  # [layers][kv_heads][head_dim]


def rotate(b: GraphBuilder, x: str, d: int) -> str:
    """x [.., d] times the Hadamard matrix (one constant per graph: constants are shared by value)."""
    return b.op("MatMul", x, b.const(hadamard(d), "float32"))


def _f16_bits(b: GraphBuilder, v: str) -> str:
    """float32 values that are exact float16 values -> their IEEE float16 bits as float32
    integers (sign of -0 kept: 1 / -0 = -inf)."""
    a = b.op("Abs", v)
    neg = b.op("Less", b.op("Div", b.const(1.0, "float32"), v), b.const(0.0, "float32"))
    e = b.op("ReduceSum", b.op("Cast", b.op("GreaterOrEqual", b.op("Unsqueeze", a, b.const([-1])),
                                            b.const(_POW2, "float32")), to=onnx_dtype("float32")),
             b.const([-1]), keepdims=0)  # exponent field 0..30
    unit = b.op("Gather", b.const(_UNIT, "float32"), b.op("Cast", e, to=onnx_dtype("int64")), axis=0)
    implicit = b.op("Mul", b.op("Min", e, b.const(1.0, "float32")), b.const(1024.0, "float32"))
    mant = b.op("Sub", b.op("Div", a, unit), implicit)  # exact: a = (implicit + mant) * unit
    bits = b.op("Add", b.op("Mul", e, b.const(1024.0, "float32")), mant)
    return b.op("Add", bits, b.op("Mul", b.op("Cast", neg, to=onnx_dtype("float32")), b.const(32768.0, "float32")))


def _f16_round(b: GraphBuilder, x: str) -> str:
    """float32 -> the nearest float16 value (ties to even, saturating at ±65504), as float32."""
    x = b.op("Clip", x, b.const(-F16_MAX, "float32"), b.const(F16_MAX, "float32"))
    return b.op("Cast", b.op("Cast", x, to=onnx_dtype("float16")), to=onnx_dtype("float32"))


def quantize_rows(b: GraphBuilder, x: str, d: int, rank: int) -> str:
    """x [.., d] float32 (`rank` dims) -> int4 rows [.., io.kv_row_width(d, "int4")] uint8."""
    g = d // io.KV_INT4_GROUP
    keep = [0] * (rank - 1)  # leading axes copied (allowzero 0)
    xg = b.op("Reshape", x, b.const(keep + [g, io.KV_INT4_GROUP]))  # [.., G, 32]
    lo = b.op("ReduceMin", xg, b.const([-1]), keepdims=1)  # [.., G, 1]
    hi = b.op("ReduceMax", xg, b.const([-1]), keepdims=1)
    neg_lo = b.op("Neg", lo)
    pos = b.op("GreaterOrEqual", hi, neg_lo)  # the extreme is the maximum (ties: the maximum)
    mag = b.op("Div", b.op("Where", pos, hi, neg_lo), b.const(8.0, "float32"))
    mag = _f16_round(b, b.op("Max", mag, b.const(MIN_SCALE, "float32")))
    scale = b.op("Where", pos, b.op("Neg", mag), mag)  # [.., G, 1]
    code = b.op("Round", b.op("Div", xg, scale))  # half to even
    code = b.op("Add", b.op("Clip", code, b.const(-8.0, "float32"), b.const(7.0, "float32")), b.const(8.0, "float32"))
    pairs = b.op("Reshape", code, b.const(keep + [d // 2, 2]))
    even, odd = b.op("Split", pairs, b.const([1, 1]), axis=-1, outputs=2)  # [.., D/2, 1]
    packed = b.op("Squeeze", b.op("Add", even, b.op("Mul", odd, b.const(16.0, "float32"))), b.const([-1]))
    bits = _f16_bits(b, scale)  # [.., G, 1]
    high = b.op("Floor", b.op("Div", bits, b.const(256.0, "float32")))
    low = b.op("Sub", bits, b.op("Mul", high, b.const(256.0, "float32")))
    sm = b.op("Reshape", b.op("Concat", low, high, axis=-1), b.const(keep + [2 * g]))  # [.., G * 2]: scale LE
    row = b.op("Concat", packed, sm, axis=-1)
    return b.op("Cast", row, to=onnx_dtype("uint8"))


def dequantize_rows(b: GraphBuilder, rows: str, d: int, rank: int) -> str:
    """int4 rows [.., row] uint8 (`rank` dims) -> [.., d] float32: (nibble - 8) * scale."""
    g = d // io.KV_INT4_GROUP
    keep = [0] * (rank - 1)
    codes = b.op("Slice", rows, b.const([0]), b.const([d // 2]), b.const([-1]))  # [.., D/2]
    sm = b.op("Slice", rows, b.const([d // 2]), b.const([d // 2 + 2 * g]), b.const([-1]))  # [.., 2G]
    low = b.op("BitwiseAnd", codes, b.const(15, "uint8"))
    high = b.op("BitShift", codes, b.const(4, "uint8"), direction="RIGHT")
    code = b.op("Concat", b.op("Unsqueeze", low, b.const([-1])), b.op("Unsqueeze", high, b.const([-1])), axis=-1)
    code = b.op("Cast", b.op("Reshape", code, b.const(keep + [g, io.KV_INT4_GROUP])), to=onnx_dtype("float32"))
    code = b.op("Sub", code, b.const(8.0, "float32"))
    sm = b.op("Cast", b.op("Reshape", sm, b.const(keep + [g, 2])), to=onnx_dtype("float32"))  # [.., G, 2]
    lb, hb = b.op("Split", sm, b.const([1, 1]), axis=-1, outputs=2)  # [.., G, 1]
    bits = b.op("Add", lb, b.op("Mul", hb, b.const(256.0, "float32")))  # [.., G, 1] float16 bits
    neg = b.op("GreaterOrEqual", bits, b.const(32768.0, "float32"))
    u = b.op("Sub", bits, b.op("Mul", b.op("Cast", neg, to=onnx_dtype("float32")), b.const(32768.0, "float32")))
    e = b.op("Floor", b.op("Div", u, b.const(1024.0, "float32")))
    mant = b.op("Sub", u, b.op("Mul", e, b.const(1024.0, "float32")))
    unit = b.op("Gather", b.const(_UNIT, "float32"), b.op("Cast", e, to=onnx_dtype("int64")), axis=0)
    val = b.op("Mul", b.op("Add", mant, b.op("Mul", b.op("Min", e, b.const(1.0, "float32")),
                                               b.const(1024.0, "float32"))), unit)
    scale = b.op("Where", neg, b.op("Neg", val), val)  # [.., G, 1]
    x = b.op("Mul", code, scale)  # [.., G, 32]; exact
    return b.op("Reshape", x, b.const(keep + [d]))
