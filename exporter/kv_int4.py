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
