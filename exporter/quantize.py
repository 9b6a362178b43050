"""Quantized matmul weights: the block-wise integer form every quantized build stores, how float
weights are rounded into it (round-to-nearest here; activation-aware scales in awq.py), and how it
is packed for ONNX.

A matmul weight W [K, N] (in, out) is stored as integer codes q [K, N] with one float32 scale (and
optionally an integer zero point) per block of `block_size` consecutive rows of K in each column:

    W[k, n] ≈ (q[k, n] - zp[k // B, n]) * scale[k // B, n]  (+ offset[k // B, n])

which is exactly ONNX's opset-21 block-wise DequantizeLinear(axis=0, block_size=B) on the [K, N]
weight; `offset` (a per-block additive term, GGUF Q4_1's block minimum) is not expressible by
DequantizeLinear with an integer zero point, so the graph adds it as a small second product of
the per-block sums of the activations (exporter/graph.py `linear`), which keeps it exact.

NOTE: blocks run along K (the reduction axis) so that the same codes feed onnxruntime's
MatMulNBits fusion (DQ(axis=0) -> MatMul) and TensorRT's weight-only block quantization, and so
that GGUF blocks (32 consecutive input features of one output row) map onto them unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from kvexport.errors import ConfigError
from kvexport.manifest_weights import CalibrationEntry, QuantizedMatrices, QuantizedTable, WeightQuantizationEntry

from .mla import linears as mla_linears
from .moe import expert_linears
from .limits import (CALIBRATED_METHODS, DEFAULT_WEIGHT_FORM, FALLBACK_WEIGHT_BLOCK, QUANT_METHODS, WEIGHT_BLOCK_SIZES,
                     WEIGHT_PRECISIONS)

QUANTIZED_HEAD = "lm_head.quantized.weight"  # graph name of a quantized LM head's [hidden, vocab] codes
# graph name of the token embeddings' int8 [hidden, vocab] codes in quantized builds: tied, the
# head's codes under a second name; untied, their own (HEAD_BITS, the head's blocks). NOTE: an
# untied table kept in fp32 was 545 of Qwen2.5-0.5B's 922 MB int4 weights file (0.37x of fp32)
QUANTIZED_EMBED = "model.embed_tokens.quantized"
# NOTE: the LM head (and the embeddings tied to it, read from the same codes) stay int8 in int4
# builds: the logits are the most rounding-sensitive matmul, and in fp32 the tied table alone made
# smollm2's int4 file 0.36x of fp32 (goal <= 0.3x); int8 blocks of 32 also map GGUF Q8_0 exactly.
HEAD_BITS = 8
# NOTE: per-channel builds (`--weight-block-size channel`) keep the head in int8 blocks of 32: on
# onnxruntime's CPU the per-channel matmuls run with per-token int8 activations (runtime/execution/ort_quant.py),
# and the head's cost most: smollm2 smoothquant perplexity 55.21 with a per-channel head, 54.64 with
# blocks of 32 (MatMulNBits, int8 activations per 32 of K), fp32 54.62. TensorRT builds take the
# head per channel (its INT8 weight-only DQ is per channel only): exporter/build.py.
HEAD_CHANNEL_BUILDS_BLOCK = 32
LINEARS = ("attn.qkv", "attn.o", "mlp.up", "mlp.down")  # per layer, graph names model.layers.{i}.{x}.weight
BITS = {"int8": 8, "int4": 4}
CHANNEL = 0  # block_size of per-output-channel scales: one block spans all of K (`--weight-block-size channel`)
QMAX = {8: 127, 4: 7}  # symmetric codes lie in [-QMAX - 1, QMAX]; we use [-QMAX, QMAX]
# (precision, per channel) of the builds --quant-method smoothquant makes: weights that onnxruntime's
# CPU runs as int8 x int8 with per-token int8 activations, per-channel int8 always, int4 blocks in
# the large steps under weight_matmul_accuracy "int8" (re-rounded per channel; awq.py scores that)
SMOOTHQUANT_FORMS = (("int8", True), ("int4", False))


@dataclass(frozen=True, slots=True)
class WeightQuantization:
    """How a build quantizes its matmul weights (validated when made)."""

    precision: str = "fp32"  # one of WEIGHT_PRECISIONS; fp32/fp16 follow the build's --dtype
    # rows of K sharing one scale; CHANNEL: per output column; None: the precision's default form
    block_size: int | None = None
    # one of QUANT_METHODS (from float weights; pre-quantized sources map exactly); None: the default form
    method: str | None = None
    calibration_text: str | None = None  # awq: text file (None: the bundled text)

    def __post_init__(self) -> None:
        """Validates, and fills what is None from limits.DEFAULT_WEIGHT_FORM (its comment says how)."""
        if self.precision not in WEIGHT_PRECISIONS:
            raise ConfigError(f"--weights must be one of {', '.join(WEIGHT_PRECISIONS)}, got {self.precision!r}")
        block, method = DEFAULT_WEIGHT_FORM.get(self.precision, (FALLBACK_WEIGHT_BLOCK, "rtn"))
        if self.block_size is None:
            given = self.method is not None and self.method != method
            object.__setattr__(self, "block_size", FALLBACK_WEIGHT_BLOCK if given else block)
        if self.method is None:
            sq_ok = (self.precision, self.block_size == CHANNEL) in SMOOTHQUANT_FORMS
            object.__setattr__(self, "method", method if method != "smoothquant" or sq_ok else "rtn")
        if isinstance(self.block_size, bool) or self.block_size not in WEIGHT_BLOCK_SIZES:
            raise ConfigError("--weight-block-size must be one of channel (0), "
                              f"{', '.join(str(b) for b in WEIGHT_BLOCK_SIZES if b)}, got {self.block_size!r}")
        if self.method not in QUANT_METHODS:
            raise ConfigError(f"--quant-method must be one of {', '.join(QUANT_METHODS)}, got {self.method!r}")
        if self.calibration_text is not None and self.method not in CALIBRATED_METHODS:
            raise ConfigError("--calibration-text for weights only applies to --quant-method awq or smoothquant")
        if self.method == "smoothquant" and ((self.precision, self.block_size == CHANNEL) not in SMOOTHQUANT_FORMS):
            raise ConfigError("--quant-method smoothquant scales weights for int8 x int8 matmuls (per-token int8 "
                              "activations): per-channel int8 (--weights int8 --weight-block-size channel) or int4 "
                              "blocks (--weights int4 --weight-block-size 32|64|128), got "
                              f"--weights {self.precision} --weight-block-size {self.block_size or 'channel'}")

    @property
    def quantized(self) -> bool:
        return self.precision in BITS

    @property
    def bits(self) -> int:
        return BITS[self.precision]


@dataclass(frozen=True, slots=True)
class QuantizedMatrix:
    """W [K, N] ≈ (q - zero_point) * scale (+ offset), blocks of `block_size` rows of K."""

    q: np.ndarray  # [K, N] int8 codes (int4 builds: values in -8..7)
    scale: np.ndarray  # [ceil(K / B), N] float32
    bits: int  # 4 | 8
    block_size: int  # B, rows of K per scale; CHANNEL (0): all K rows, one scale per output column
    zero_point: np.ndarray | None = None  # [ceil(K / B), N] int8 (int4: -8..7); None: 0
    offset: np.ndarray | None = None  # [ceil(K / B), N] float32 added per block (GGUF Q4_1 minimum)
    origin: str = "rtn"  # how the codes were made: "rtn", "awq", "gguf:Q4_0", ...

    def __post_init__(self) -> None:
        k, n = self.q.shape
        assert self.scale.shape == (-(-k // self.rows), n), (self.q.shape, self.scale.shape)

    @property
    def rows(self) -> int:
        """Rows of K per scale (K itself for per-channel scales)."""
        return self.block_size or self.q.shape[0]

    def dequantize(self) -> np.ndarray:
        """The float32 weight [K, N] the graph computes with."""
        k = self.q.shape[0]
        rep = lambda a: np.repeat(a, self.rows, axis=0)[:k]  # noqa: E731 - [K/B, N] -> [K, N]
        w = self.q.astype(np.float32)
        if self.zero_point is not None:
            w -= rep(self.zero_point.astype(np.float32))
        w *= rep(self.scale)
        if self.offset is not None:
            w += rep(self.offset)
        return w


def concat_columns(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Matrices side by side along N (q | k | v, gate | up): blocks along K are untouched."""
    first = parts[0]
    assert all(p.bits == first.bits and p.block_size == first.block_size for p in parts)
    cat = lambda xs: None if xs[0] is None else np.concatenate(xs, axis=1)  # noqa: E731
    zps, offs = [p.zero_point for p in parts], [p.offset for p in parts]
    if any(z is None for z in zps) and not all(z is None for z in zps):
        zps = [np.zeros_like(p.scale, np.int8) if p.zero_point is None else p.zero_point for p in parts]
    if any(o is None for o in offs) and not all(o is None for o in offs):
        offs = [np.zeros_like(p.scale) if p.offset is None else p.offset for p in parts]
    origins = sorted({p.origin for p in parts})
    return QuantizedMatrix(np.concatenate([p.q for p in parts], axis=1), cat([p.scale for p in parts]),
                           first.bits, first.block_size, cat(zps), cat(offs), "+".join(origins))


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    """[K, N] -> [ceil(K/B), B, N], zero-padded along K."""
    k, n = w.shape
    pad = (-k) % block
    if pad:
        w = np.concatenate([w, np.zeros((pad, n), w.dtype)], axis=0)
    return w.reshape(-1, block, n)


def quantize_rtn(w: np.ndarray, bits: int, block_size: int, origin: str = "rtn") -> QuantizedMatrix:
    """Symmetric round-to-nearest of W [K, N]: scale = max|W| / qmax per block of K (per output
    column over all of K when block_size is CHANNEL)."""
    k = w.shape[0]
    wb = _blocks(np.asarray(w, np.float32), block_size or k)  # [K/B, B, N]
    qmax = QMAX[bits]
    scale = np.abs(wb).max(axis=1) / qmax  # [K/B, N]
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(wb / scale[:, None, :]), -qmax, qmax).astype(np.int8)
    return QuantizedMatrix(q.reshape(-1, w.shape[1])[:k], scale, bits, block_size, origin=origin)


# ---- ONNX packing -------------------------------------------------------------------------
def pack_int4(q: np.ndarray) -> np.ndarray:
    """int4 codes (-8..7, any shape) -> bytes as ONNX stores INT4 tensors: row-major elements,
    two per byte, the even element in the low nibble; an odd count leaves the last high nibble 0."""
    flat = (q.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack_int4(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of pack_int4: int8 codes of `shape`."""
    lo, hi = packed & 0xF, packed >> 4
    flat = np.stack([lo, hi], axis=1).reshape(-1)[: int(np.prod(shape))].astype(np.int8)
    return np.where(flat > 7, flat - 16, flat).astype(np.int8).reshape(shape)


def stored_codes(q: np.ndarray, bits: int) -> tuple[np.ndarray, int]:
    """(bytes to store, ONNX data type) of integer codes."""
    if bits == 4:
        return pack_int4(q), TensorProto.INT4
    return np.ascontiguousarray(q.astype(np.int8)), TensorProto.INT8


# ---- the model ----------------------------------------------------------------------------
def float_linears(weights) -> dict[str, np.ndarray]:
    """name -> float [K, N] of every decoder matmul of a ModelWeights: LINEARS, an MLA layer's
    projections (exporter/mla.py linears: W_UK / W_UV stay float32, its NOTE says why) and each
    expert's up / down."""
    out = {}
    for i, lw in enumerate(weights.layers):
        if getattr(lw, "mla", None) is not None:  # q (or q_a, q_b) and kv_a; qkv_w is None, o is attn.o
            out.update(mla_linears(i, lw.mla))
        for x, arr in zip(LINEARS, (lw.qkv_w, lw.o_w, lw.up_w, lw.down_w)):
            if arr is not None:  # NOTE: None: a sparse layer without a shared expert (its MLP is its experts)
                out[f"model.layers.{i}.{x}.weight"] = arr
        if getattr(lw, "moe", None) is not None:  # each expert's up / down, quantized like any matmul
            out.update(expert_linears(i, lw.moe))
    return out


def quantize_model(weights, wq: WeightQuantization, presets: dict[str, QuantizedMatrix] | None = None,
                   scales_for: dict[str, np.ndarray] | None = None) -> dict[str, QuantizedMatrix]:
    """Every decoder matmul of `weights` quantized as `wq` says: a preset (codes read from a
    pre-quantized source, of `wq`'s bits and block size) is taken as is; the rest are rounded
    to nearest, after dividing rows of K by `scales_for[name]` [K] (AWQ: the inverse scale is
    folded into the previous op by the caller) when given."""
    presets, scales_for = presets or {}, scales_for or {}
    out = {}
    for name, w in float_linears(weights).items():
        p = presets.get(name)
        if p is not None and p.bits == wq.bits and p.block_size == wq.block_size:
            out[name] = p
            continue
        if name in scales_for:
            w = w * scales_for[name][:, None]
        out[name] = quantize_rtn(w, wq.bits, wq.block_size, origin=wq.method if name in scales_for else "rtn")
    return out


def _names_pattern(q: dict[str, QuantizedMatrix]) -> str:
    """The decoder matmuls' graph names as one pattern, in their first order (dense families:
    model.layers.*.{attn.qkv,attn.o,mlp.up,mlp.down}; experts' indices as *)."""
    short = []
    for name in q:
        if name.startswith("model.layers."):  # model.layers.{i}.<short>.weight
            rest = name.split(".", 3)[3].removesuffix(".weight")
            short.append(re.sub(r"\.experts\.\d+\.", ".experts.*.", rest))
    return "model.layers.*.{" + ",".join(dict.fromkeys(short)) + "}"


def describe(q: dict[str, QuantizedMatrix], wq: WeightQuantization, act_dtype: str, kept: dict[str, str],
             requantized_from: str | None, method_info: dict, matmul_accuracy: str) -> WeightQuantizationEntry:
    """The manifest's `weights.quantization` record: what is quantized, how, and what is not;
    `method_info` (weight_sources.quantized_weights) adds the method's own record and the LM
    head's; `matmul_accuracy` is the build's serving default (limits.default_matmul_accuracy)."""
    table = q.get(QUANTIZED_EMBED)  # untied embeddings: a table, not a matmul (named below)
    q = {n: m for n, m in q.items() if n != QUANTIZED_EMBED}
    origins: dict[str, int] = {}
    for m in q.values():
        origins[m.origin] = origins.get(m.origin, 0) + 1
    any_m = next(iter(q.values()))
    info = dict(method_info)
    calibration, head = info.pop("calibration", None), info.pop("lm_head")
    if "alpha_grid" in info:
        info["alpha_grid"] = tuple(info["alpha_grid"])
    return WeightQuantizationEntry(
        precision=wq.precision, bits=wq.bits, block_size=wq.block_size or "channel",
        axis="output (N): one scale per column" if wq.block_size == CHANNEL else "input (K)",
        method=info.pop("method", wq.method), symmetric=all(m.zero_point is None for m in q.values()),
        block_offsets=any(m.offset is not None for m in q.values()),
        scales_dtype=act_dtype, code_dtype="int4 (two per byte)" if any_m.bits == 4 else "int8",
        format=("onnx QDQ: DequantizeLinear(axis=1, scale [N]) -> MatMul (opset 21); onnxruntime CPU "
                "sessions run it as int8 x int8 MatMulIntegerToFloat with per-token activation scales "
                "(runtime/execution/ort_quant.py)"
                if wq.block_size == CHANNEL else "onnx QDQ: DequantizeLinear(axis=0, block_size) -> MatMul (opset 21)"),
        quantized=QuantizedMatrices(len(q), origins, _names_pattern(q) + (
            f", {QUANTIZED_HEAD} (int8, [hidden, vocab]; tied embeddings gather its rows)" if QUANTIZED_HEAD in q
            else "")),
        embeddings=(QuantizedTable(table.bits, table.block_size or "channel", table.origin,
                                   f"{QUANTIZED_EMBED} (int8, [hidden, vocab]; a Gather on axis 1 reads a token's "
                                   f"column)")
                    if table is not None else "tied: the LM head's codes" if QUANTIZED_HEAD in q else None),
        kept=kept, requantized_from=requantized_from,
        calibration=CalibrationEntry(**calibration) if calibration is not None else None,
        lm_head=QuantizedTable(**head), matmul_accuracy=matmul_accuracy, **info)
