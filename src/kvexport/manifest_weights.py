"""The manifest's `weights.quantization` section (kvexport/manifest.py WeightsEntry): how an int8 /
int4 build's matmul weights are stored, where their codes came from, and how the build is served
by default. Written by exporter/quantize.py `describe()`; read by the runtime
(runtime/execution/session_plan.py), `kvexport inspect` and the TensorRT engine builder.

    WeightQuantizationEntry ─ quantized: QuantizedMatrices   (the decoder matmuls + the LM head)
                            ─ lm_head / embeddings: QuantizedTable (int8 [hidden, vocab] codes)
                            ─ calibration: CalibrationEntry  (awq / smoothquant)
                            ─ matmul_accuracy, serving       (the form onnxruntime's CPU runs)

NOTE (builds before a field existed): fields added after the first quantized builds are
optional and left out of the JSON when None (metadata omit_if_none), so every manifest saves back
byte for byte: `embeddings` (before untied tables were quantized), `lm_head` (before its record;
its blocks were the matrices'), the calibrated methods' fields, `matmul_accuracy` and `serving`
(before the build recorded its serving form: the runtime then uses session_plan.DEFAULT_ACCURACY).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError

# how onnxruntime's CPU runs block-wise int4/int8 weights (runtime/execution/session_plan.py):
# "auto" exact-ish (int8 pairs for large steps), "int8" fastest (int8 activations), "float" exact
WEIGHT_MATMUL_ACCURACY = ("auto", "int8", "float")
_BITS = {"int8": 8, "int4": 4}
CHANNEL = "channel"  # block_size of per-output-channel scales, as the manifest writes it
_OMIT = {"omit_if_none": True}


def _block_ok(b: int | str) -> bool:
    return b == CHANNEL or (isinstance(b, int) and not isinstance(b, bool) and b >= 1)


@dataclass(frozen=True, slots=True)
class QuantizedMatrices:
    # quantized matmul weights (exporter/quantize.py float_linears) + the LM head when quantized: per dense
    # layer 4 (q|k|v, o, gate|up, down); an MLA layer has q (or q_a, q_b), kv_a and o instead of q|k|v, o
    # (kv_b stays float); an MoE layer adds each expert's up and down (a sparse layer without a shared
    # expert has no gate|up, down of its own)
    matrices: int
    origins: dict[str, int]  # how their codes were made ("rtn", "awq", "smoothquant", "gguf:Q4_1", ...) -> count
    names: str  # their graph names, as a pattern


@dataclass(frozen=True, slots=True)
class QuantizedTable:
    """An int8 [hidden, vocab] table: the LM head's codes, or untied embeddings' own."""

    bits: int  # 8 (exporter/quantize.py HEAD_BITS)
    block_size: int | str  # rows of hidden per scale, or "channel"
    origin: str  # "rtn" | "gguf:Q8_0" | ...
    name: str | None = field(default=None, metadata=_OMIT)  # embeddings: the graph name and how it is read

    def __post_init__(self) -> None:
        if not _block_ok(self.block_size):
            raise ConfigError(f"block_size must be a positive integer or {CHANNEL!r}, got {self.block_size!r}")


@dataclass(frozen=True, slots=True)
class CalibrationEntry:
    text: str  # file name of the calibration text, or "random-ids" (models without a tokenizer)
    tokens: int  # tokens of it run through the model


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightQuantizationEntry:
    """An int8 / int4 build's matmul weights (exporter/quantize.py describe()); fields in the
    order the JSON holds them. Checked when made (ConfigError; the manifest names the field)."""

    precision: str  # "int8" | "int4"
    bits: int  # bits per matmul code: 8 | 4 (the LM head is int8 whatever: lm_head)
    block_size: int | str  # rows of K per scale (32 | 64 | 128), or "channel": one scale per output column
    axis: str  # the axis the scales run along, in words
    method: str  # "rtn" | "awq" | "smoothquant", or "<awq|gptq>:<format> (pre-quantized codes, mapped exactly)"
    symmetric: bool  # no zero points
    block_offsets: bool  # per-block additive offsets (GGUF Q4_1 minimums, a second small product)
    scales_dtype: str  # numpy name of the scales' dtype (the activations')
    code_dtype: str  # "int8" | "int4 (two per byte)"
    format: str  # the graphs' QDQ form, in words
    quantized: QuantizedMatrices
    # untied embeddings: their int8 table; tied: a sentence (the head's codes); builds before: absent
    embeddings: QuantizedTable | str | None = field(default=None, metadata=_OMIT)
    kept: dict[str, str]  # what stays in the activation dtype -> why
    requantized_from: str | None  # GGUF sources: which tensor types mapped exactly, which were re-rounded
    source: dict | None = field(default=None, metadata=_OMIT)  # pre-quantized checkpoints: quantization_config
    calibration: CalibrationEntry | None = field(default=None, metadata=_OMIT)  # awq / smoothquant
    alpha_grid: tuple[float, ...] | None = field(default=None, metadata=_OMIT)  # awq / smoothquant: exponents tried
    scaled_matrices: int | None = field(default=None, metadata=_OMIT)  # awq / smoothquant: matrices given scales
    search: str | None = field(default=None, metadata=_OMIT)  # awq / smoothquant: candidates and objective
    mean_alpha: float | None = field(default=None, metadata=_OMIT)  # awq / smoothquant: mean chosen exponent
    lm_head: QuantizedTable | None = field(default=None, metadata=_OMIT)  # builds before its record: absent
    # the weight_matmul_accuracy the runtime serves this build with unless told otherwise (one of
    # WEIGHT_MATMUL_ACCURACY; session_plan.resolve_accuracy); None: builds before, "auto"
    matmul_accuracy: str | None = field(default=None, metadata=_OMIT)
    # how onnxruntime's CPU runs the matmuls under matmul_accuracy, in words (session_plan.describe)
    serving: str | None = field(default=None, metadata=_OMIT)

    def __post_init__(self) -> None:
        if _BITS.get(self.precision) != self.bits:
            raise ConfigError(f"precision {self.precision!r} with {self.bits}-bit codes: expected int8 (8) or "
                              f"int4 (4)")
        if not _block_ok(self.block_size):
            raise ConfigError(f"block_size must be a positive integer or {CHANNEL!r}, got {self.block_size!r}")
        if self.matmul_accuracy is not None and self.matmul_accuracy not in WEIGHT_MATMUL_ACCURACY:
            raise ConfigError(f"matmul_accuracy must be one of {', '.join(WEIGHT_MATMUL_ACCURACY)}, got "
                              f"{self.matmul_accuracy!r}")

    @property
    def per_channel(self) -> bool:
        return self.block_size == CHANNEL

    @property
    def head_block_size(self) -> int | str:
        """The int8 LM head's block size (builds before its record: the matrices')."""
        return self.lm_head.block_size if self.lm_head is not None else self.block_size

    def form(self) -> str:
        """The stored form in words, e.g. "int8 per-channel, smoothquant" or "int4 blocks of 32, rtn"."""
        layout = "per-channel" if self.per_channel else f"blocks of {self.block_size}"
        return f"{self.precision} {layout}, {self.method}"
