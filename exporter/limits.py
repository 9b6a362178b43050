"""The values build options may take: one definition, light to import (no torch), checked by
exporter/build.py `BuildOptions`, and used by the CLI's options (click choices and ranges) and
the recipe schema (recipes/__init__.py).

NOTE: max_seq_len sizes the RoPE tables stored in the graphs (2 x tokens x head_dim float32)
and calibration_tokens the calibration run, so both are capped far above any real use but
below an allocation failure.
"""

from __future__ import annotations

from kvexport import io

# inclusive ranges of the numeric options
RANGES: dict[str, tuple[int, int]] = {
    "block_size": (1, 1024),  # tokens per KV block
    "max_seq_len": (2, 1 << 18),  # tokens
    "calibration_tokens": (16, 1 << 20),  # tokens
    "validate_steps": (1, 1024),  # decode steps
}
DTYPES = (io.DType.FP32, io.DType.FP16)  # weights/activations
KV_DTYPES = (io.DType.FP32, io.DType.FP16, io.DType.INT8)
BACKENDS = ("onnxruntime", "tensorrt")  # the runtime's --backend names ("onnx": the old name of onnxruntime)
# matmul weights (exporter/quantize.py): --weights, --weight-block-size (rows of K per scale), --quant-method
WEIGHT_PRECISIONS = ("fp32", "fp16", "int8", "int4")
WEIGHT_BLOCK_SIZES = (0, 32, 64, 128)  # 0: one scale per output channel (CLI `channel`)
# the default per precision (None given): blocks of 32 for both. Measured on smollm2-135m
# (bench/weight_quality.py, perplexity vs fp32 54.617): int8 blocks of 32 54.523 (-0.2%); int8 per
# channel 55.159 (+1.0%) with float activations, 55.926 (+2.4%) as onnxruntime serves it fast
# (per-row dynamic int8 activations, runtime/execution/ort_quant.py), so per channel is opt-in (`channel`)
DEFAULT_WEIGHT_BLOCK = {"int8": 32, "int4": 32}
QUANT_METHODS = ("rtn", "awq", "smoothquant")
CALIBRATED_METHODS = ("awq", "smoothquant")  # scale searches on calibration text (exporter/awq.py)
