"""The value sets build options choose from, and the default weight form per precision: light to
import (no torch), named by the `BuildOptions` fields (exporter/options.py, where each option's
range and help live) and by the code that makes each form (exporter/quantize.py, plan.py)."""

from __future__ import annotations

from kvexport import io

DTYPES = (io.DType.FP32, io.DType.FP16)  # weights/activations
KV_DTYPES = (io.DType.FP32, io.DType.FP16, io.DType.INT8, io.DType.INT4)  # int4: docs/QUANTIZATION.md "int4 KV"
BACKENDS = io.BACKENDS  # the runtime's --backend names ("onnx": the old name of onnxruntime, options.py)
# matmul weights (exporter/quantize.py): --weights, --weight-block-size (rows of K per scale), --quant-method
WEIGHT_PRECISIONS = ("fp32", "fp16", "int8", "int4")
WEIGHT_BLOCK_SIZES = (0, 32, 64, 128)  # 0: one scale per output channel (CLI `channel`)
# The default form per precision, when neither --weight-block-size nor --quant-method is given:
# (block size, method). smollm2-135m, perplexity on 2048 tokens of King Lear (bench/weight_quality.py;
# fp32 54.62), throughput on `kvexport bench`'s mixed-64 trace (bench/weight_speed.py), 2 cores;
# docs/QUANTIZATION.md has the tables:
#   int8: per channel + smoothquant, served as int8 x int8 (per-token activations) on every step:
#         the fast form. Intel Xeon with VNNI/AMX: 1.64x fp32 throughput, 55.03 (+0.75%); AMD EPYC
#         with AVX2 only (7-bit activations there, runtime/execution/ort_quant.py ACT_QMAX): 56.00
#         (+2.5%). Blocks of 32 (round-to-nearest; `--weight-block-size 32`, GGUF Q8_0 blocks map
#         exactly) are the exact form: 54.62 / 54.63, 0.94x on the Xeon (int8 pairs for large steps).
#   int4: blocks of 32, round-to-nearest (GGUF Q4_1/Q4_0 blocks map exactly), served "auto": 54.58
#         (exact; the Q4_1 file itself 54.62), 0.90-1.0x fp32 throughput and ~1.9x decode. No int4
#         form is both faster and within +1%: "int8" accuracy (`--weight-matmul-accuracy int8`)
#         runs 1.50x at 55.67 (+1.9%) on the Xeon and 61.79 (+13%) on the EPYC; smoothquant int4
#         blocks under "int8" 66.78 (+22%) on the EPYC. So int4 stays exact by default and its
#         fast form is one flag away.
# A method given alone keeps its usual blocks (FALLBACK_WEIGHT_BLOCK: rtn / awq int8 in blocks of
# 32); a block size given alone takes the default method where that method makes such weights
# (quantize.py SMOOTHQUANT_FORMS), else rtn. NOTE: per channel with round-to-nearest is no
# default: 55.9 (+2.4%) served with per-row int8 activations (runtime/execution/ort_quant.py).
DEFAULT_WEIGHT_FORM = {"int8": (0, "smoothquant"), "int4": (32, "rtn")}
FALLBACK_WEIGHT_BLOCK = 32
DEFAULT_WEIGHT_BLOCK = {p: form[0] for p, form in DEFAULT_WEIGHT_FORM.items()}  # 0: per channel
QUANT_METHODS = ("rtn", "awq", "smoothquant")
CALIBRATED_METHODS = ("awq", "smoothquant")  # scale searches on calibration text (exporter/awq.py)


def default_matmul_accuracy(method: str) -> str:
    """The weight_matmul_accuracy a build of weights made by `method` records as its serving
    default (`kvexport build --weight-matmul-accuracy` overrides it; runtime/execution/session_plan.py):
    "int8" for smoothquant, whose scales are searched for the int8 activations that form rounds;
    "auto" (exact-ish: int8 pairs for large steps) for the weight-only methods and pre-quantized codes."""
    return "int8" if method == "smoothquant" else "auto"
