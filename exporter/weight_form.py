"""The build's "weight form" stage: which form the matmul weights take (`choose`: the options', or
what a pre-quantized checkpoint holds), and the quantized weights and their manifest record
(`weight_form`); float builds pass the weights through. Where the codes come from is
exporter/weight_sources.py, how they are stored exporter/quantize.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvexport.manifest_weights import WeightQuantizationEntry

from . import calibrate, mla, prequantized
from .limits import CALIBRATED_METHODS, default_matmul_accuracy
from .options import BuildOptions
from .progress import Progress
from .quantize import WeightQuantization, describe
from .source import ModelSource
from .spec import ModelSpec
from .weight_sources import quantized_weights

# what int8/int4 builds keep in the activation dtype, and why (the manifest records it)
KEPT = {"lm_head": "int8 even in int4 builds (exporter/quantize.py HEAD_BITS): the logits are the most "
                   "rounding-sensitive matmul; embeddings gather their rows from int8 codes too (tied: the same)",
        "norms, RoPE tables, biases": "tiny; float32 as transformers computes them"}
MOE_KEPT = {"MoE routers": "as transformers computes them (exporter/moe.py route); rounded, they would change "
                           "which experts a token gets"}


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightForm:
    """The weights the graphs are built from."""

    quantization: WeightQuantization  # the form: precision, block size, method
    weights: Any  # exporter/families.py ModelWeights (quantized matmuls' float copies as rounded)
    qweights: dict | None = None  # int8/int4: graph name -> exporter/quantize.py QuantizedMatrix; None: float
    record: WeightQuantizationEntry | None = None  # the manifest's weights.quantization; None: float

    def note(self) -> str | None:
        """The manifest's note on the weights (None: float weights)."""
        if self.record is None:
            return None
        return (f"{self.record.form()} weights: DequantizeLinear -> MatMul (opset 21); LM head and tied "
                f"embeddings int8; served as {self.record.serving} (weights.quantization)")


def choose(src: ModelSource, opts: BuildOptions, tokenizer) -> WeightQuantization:
    """The build's WeightQuantization: the options', except that for a pre-quantized checkpoint
    what --weight-block-size / --quant-method leave out follows the checkpoint (its group size,
    its codes mapped as they are) instead of the default form. A default form that searches
    scales on calibration text (int8: smoothquant) needs that text: ConfigError saying so, and
    what to do, before the weights are quantized."""
    wq = opts.weight_quantization()
    if not wq.quantized or (opts.weight_block_size is not None and opts.quant_method is not None):
        return wq
    pq = prequantized.config_of(src.directory) if src.kind == "hf" else None
    if pq is not None:  # what is not given follows the checkpoint (a given method is refused: presets())
        block = pq.group_size if opts.weight_block_size is None else opts.weight_block_size
        return WeightQuantization(wq.precision, block, opts.quant_method or "rtn")
    if opts.quant_method is None and wq.method in CALIBRATED_METHODS and tokenizer is not None \
            and opts.calibration_text is None:
        calibrate.default_text(why=f"--weights {wq.precision} defaults to --weight-block-size "
                                   f"{wq.block_size or 'channel'} --quant-method {wq.method}, whose scales are "
                                   f"searched on calibration text; --weight-block-size 32 (round-to-nearest) "
                                   f"needs none")
    return wq


def serving_words(q: WeightQuantizationEntry, dtype: str) -> str:
    """How onnxruntime's CPU serves weights `q` at the build's default accuracy, in words (the
    manifest's weights.quantization.serving; session_plan.describe)."""
    # NOTE: lazy: the runtime's session planning is only needed by quantized builds
    from kvexport.runtime.execution.session_plan import describe as describe_sessions
    from kvexport.runtime.execution.session_plan import plan_sessions, resolve_accuracy

    accuracy = resolve_accuracy(q, None)
    return (f"onnxruntime CPU, weight_matmul_accuracy {accuracy}: "
            + describe_sessions(plan_sessions(q, dtype, accuracy), q))


def weight_form(src: ModelSource, opts: BuildOptions, model, spec: ModelSpec, weights, tokenizer,
                progress: Progress) -> WeightForm:
    """The "weight form" stage: `weights` (the family's float ModelWeights) in the form the build
    stores, with its manifest record."""
    wq = choose(src, opts, tokenizer)
    if not wq.quantized:
        return WeightForm(quantization=wq, weights=weights)
    with progress(f"quantizing weights ({wq.precision}, {wq.method})"):
        # NOTE: TensorRT dequantizes INT8 only per channel, so its builds' int8 head is per channel
        weights, qweights, requantized, method_info = quantized_weights(
            src, model, spec, weights, wq, tokenizer, opts.calibration_text, opts.calibration_tokens,
            head_block=0 if opts.backend == "tensorrt" else None)
        accuracy = opts.weight_matmul_accuracy or default_matmul_accuracy(wq.method)
        kept = KEPT | (mla.KEPT if spec.mla is not None else {}) | (MOE_KEPT if spec.moe is not None else {})
        record = describe(qweights, wq, opts.dtype.numpy_name, kept, requantized, method_info, accuracy)
        record = replace(record, serving=serving_words(record, opts.dtype.value))
    return WeightForm(quantization=wq, weights=weights, qweights=qweights, record=record)
