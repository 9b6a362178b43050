"""Which onnxruntime sessions a build's weights open, and what each one derives from the stored
graph: one pure function of the manifest (`weights.quantization`, `dtype`) and the runtime's
`weight_matmul_accuracy` (runtime/config.py). ort_backends.py opens what it says;
tests/runtime/execution/test_session_plan.py holds the whole table; `kvexport inspect` and the manifest's
`weights.quantization.serving` describe it in words.

    plan_sessions(quant, dtype, accuracy) ─> (SessionPlan(steps 1 .. L-1), SessionPlan(steps L ..))
                                             or (SessionPlan(steps 1 ..),)

A step of T tokens runs in the one session whose [min_tokens, max_tokens) holds T. Each plan
names the ort_quant.py rewrites applied, in order, to the graph loaded in memory (`Rewrite`), and
the accuracy level of the MatMulNBits that onnxruntime fuses from the block-wise DequantizeLinear
-> MatMul left in it (4: int8 activations per block of K; 0: float activations, exact).

The table, onnxruntime's CPU provider (`derive`; elsewhere one session, the graph as stored):

    weights           dtype  accuracy     steps: rewrites @ level
    float             any    any          1+: - (no level)
    int8 per channel  any    auto | int8  1+: int8_dynamic @4 (only the LM head's blocks fuse)
    int8 per channel  any    float        1+: int8_dynamic @0
    int4 per channel  any    auto | int8  1+: - @4       float: 1+: - @0
    int4 | int8 blocks fp32  auto         1-7: - @4 | 8+: blocks_to_int8_pair @4          ("pair")
    int4 blocks       fp16   auto         1-31: - @4 | 32+: int8_blocks_to_matmulnbits @0 ("float")
    int8 blocks       fp16   auto         1+: - @4
    int4 | int8 blocks fp32  int8         1-3: - @4 | 4+: blocks_to_int8_channel, int8_dynamic @4 ("int8")
    int4 | int8 blocks fp16  int8         1+: - @4
    int4 | int8 blocks any   float        1+: - @0

NOTE (why the large steps differ, measured on smollm2-135m; ort_backends.py has the figures):
MatMulNBits at level 4 is ~2.3x faster than fp32 at M = 1 but slower from M ~ 32 on, and level 0
(onnxruntime's only exact kernel for block-wise weights) is 1.1-1.3x slower than fp32 from
M = 32 on. The int8 x int8 rewrites take float32 activations and scales only: fp16 builds would
open a second, identical session, so they open none (int4 under "auto" keeps level 0 for large
steps instead). The LM head keeps its int8 blocks in every form (the logits are the most
rounding-sensitive matmul): the pair and per-channel rewrites skip it, and the "float" form makes
it an explicit MatMulNBits at level 4 (the session's level is 0).

Which accuracy applies: the setting when given, else the build's own (`resolve_accuracy`:
`weights.quantization.matmul_accuracy`, recorded by `kvexport build --weight-matmul-accuracy`,
whose default follows the weights form: exporter/limits.py default_matmul_accuracy), else
DEFAULT_ACCURACY for builds made before it was recorded.
NOTE (why the build carries it): which accuracy is right is a property of how the weights were
made, not of the machine: an int4 build whose scales were searched for int8 activations
(`--quant-method smoothquant`) is meant to run "int8", a block int8 build asked for with
`--weight-block-size 32` is the exact form and must not be served rounded by a global runtime
default. So the build records its form and every front end (LLM, CLI, Triton, validation)
serves it so unless told otherwise; the runtime setting overrides it on one build.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvexport.manifest_weights import WEIGHT_MATMUL_ACCURACY, WeightQuantizationEntry

DEFAULT_ACCURACY = "auto"  # builds whose manifest records none (made before the record)
ACCURACY_LEVELS = {"int8": 4, "float": 0}  # MatMulNBits accuracy level by accuracy ("auto": int8's)
# Steps of this many tokens or more run in the large-step session of each form (see the table).
LARGE_STEP_TOKENS = {"float": 32, "int8": 4, "pair": 8}


class Rewrite(enum.Enum):
    """A runtime/execution/ort_quant.py rewrite of the loaded graph (value: its function)."""

    # block-wise int4/int8 matmuls but the LM head's -> per-channel int8 codes (Q4_1 offsets folded)
    BLOCKS_TO_INT8_CHANNEL = "blocks_to_int8_channel"
    # per-channel int8 DequantizeLinear -> MatMul -> MatMulIntegerToFloat, per-token int8 activations
    INT8_DYNAMIC = "int8_dynamic"
    # block-wise int4/int8 matmuls but the LM head's -> int8 pairs (~15 bits of both operands)
    BLOCKS_TO_INT8_PAIR = "blocks_to_int8_pair"
    # int8 blocks (the LM head of an int4 build) -> an explicit MatMulNBits at level 4
    INT8_BLOCKS_TO_MATMULNBITS = "int8_blocks_to_matmulnbits"


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """One onnxruntime session: the steps it runs and what it derives from the stored graph."""

    min_tokens: int  # smallest step it runs, tokens
    max_tokens: int | None  # steps of this many tokens or more run in the next session; None: no bound
    rewrites: tuple[Rewrite, ...]  # applied in this order to the loaded graph; (): the graph file as is
    level: int | None  # MatMulNBits accuracy level of the session (ACCURACY_LEVELS); None: no quantized weights
    form: str  # "stored" | "int8-dynamic" | a LARGE_STEP_TOKENS key ("pair", "int8", "float")

    def __post_init__(self) -> None:
        assert self.min_tokens >= 1 and (self.max_tokens is None or self.max_tokens > self.min_tokens), self

    def runs(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens runs in this session."""
        return self.min_tokens <= tokens and (self.max_tokens is None or tokens < self.max_tokens)


def resolve_accuracy(quant: WeightQuantizationEntry | None, accuracy: str | None) -> str:
    """The weight_matmul_accuracy a backend runs `quant` (manifest WeightQuantizationEntry or
    None) with: `accuracy` when given, else the build's recorded one, else DEFAULT_ACCURACY."""
    if accuracy is not None:
        return accuracy
    return (quant.matmul_accuracy if quant is not None else None) or DEFAULT_ACCURACY


def plan_sessions(quant: WeightQuantizationEntry | None, dtype: str, accuracy: str,
                  derive: bool = True) -> tuple[SessionPlan, ...]:
    """The sessions to open for weights `quant` (the manifest's `weights.quantization`, a
    WeightQuantizationEntry; None: float weights) of a build of `dtype` ("fp32" | "fp16", the
    activations') served with weight_matmul_accuracy `accuracy` ("auto" | "int8" | "float",
    resolved: resolve_accuracy), ordered by step size; `derive`: whether the sessions may be
    derived in memory (onnxruntime's CPU provider with a backend that opens derived graphs),
    else one session on the graph as stored. The module docstring has the table."""
    if accuracy not in WEIGHT_MATMUL_ACCURACY:
        raise ValueError(f"weight_matmul_accuracy {accuracy!r} is not one of {WEIGHT_MATMUL_ACCURACY}")
    if quant is None:
        return (SessionPlan(1, None, (), None, "stored"),)
    level = ACCURACY_LEVELS["float" if accuracy == "float" else "int8"]
    channel, bits = quant.block_size == "channel", quant.bits
    if not derive:
        return (SessionPlan(1, None, (), level, "stored"),)
    if channel:
        return (SessionPlan(1, None, (Rewrite.INT8_DYNAMIC,) if bits == 8 else (), level,
                            "int8-dynamic" if bits == 8 else "stored"),)
    fp32 = dtype == "fp32"
    large: tuple[str, tuple[Rewrite, ...], int] | None = None  # (form, rewrites, level)
    if accuracy == "auto" and fp32:
        large = ("pair", (Rewrite.BLOCKS_TO_INT8_PAIR,), level)
    elif accuracy == "auto" and bits == 4:
        large = ("float", (Rewrite.INT8_BLOCKS_TO_MATMULNBITS,), ACCURACY_LEVELS["float"])
    elif accuracy == "int8" and fp32:
        large = ("int8", (Rewrite.BLOCKS_TO_INT8_CHANNEL, Rewrite.INT8_DYNAMIC), level)
    if large is None:
        return (SessionPlan(1, None, (), level, "stored"),)
    form, rewrites, large_level = large
    split = LARGE_STEP_TOKENS[form]
    if split <= 1:  # every step in the large form (bench/step_sizes.py times each form alone)
        return (SessionPlan(1, None, rewrites, large_level, form),)
    return (SessionPlan(1, split, (), level, "stored"), SessionPlan(split, None, rewrites, large_level, form))


# ---- in words (kvexport inspect, the manifest's weights.quantization.serving) ----------------

_LEVEL_WORDS = {4: "int8 activations per block of K", 0: "float activations, exact"}
_FORM_WORDS = {
    "int8-dynamic": "int8 x int8 MatMulIntegerToFloat, per-token int8 activations",
    "pair": "int8 pairs (three int8 x int8 products carrying ~15 bits of activations and weights)",
    "int8": "per-channel int8 x per-token int8 MatMulIntegerToFloat (the blocks re-rounded per channel)",
    "float": "MatMulNBits with float activations (exact)",
}


def _steps(p: SessionPlan) -> str:
    if p.max_tokens is None:
        return "every step" if p.min_tokens == 1 else f"steps of {p.min_tokens}+ tokens"
    last = p.max_tokens - 1
    return f"steps of {p.min_tokens} token" if last == 1 else f"steps of {p.min_tokens}-{last} tokens"


def describe(plans: tuple[SessionPlan, ...], quant: WeightQuantizationEntry | None) -> str:
    """How the matmuls of `quant` run under `plans`, in one line, e.g. "every step: int8 x int8
    MatMulIntegerToFloat, per-token int8 activations; LM head: MatMulNBits (int8 activations per
    block of K)"."""
    if quant is None:
        return "every step: float MatMul"
    parts, head = [], None
    for p in plans:
        if p.form == "stored":
            what = f"MatMulNBits ({_LEVEL_WORDS[p.level]})" if quant.block_size != "channel" else (
                f"DequantizeLinear -> MatMul (MatMulNBits {_LEVEL_WORDS[p.level]} where onnxruntime fuses it)")
        else:
            what = _FORM_WORDS[p.form]
            head = "MatMulNBits (int8 activations per block of K)" if p.form == "float" else (
                f"MatMulNBits ({_LEVEL_WORDS[p.level]})")
        parts.append(f"{_steps(p)}: {what}")
    return "; ".join(parts) + (f"; LM head: {head}" if head else "")
