"""`kvexport::PagedAttention`: paged / GQA / INT8-KV attention over a block pool.

    spec.py       inputs, outputs, attributes, aliasing, tolerances (the contract)
    reference.py  readable torch reference: the executable definition
    kernels.py    Triton kernels (prefill with fused store, decode with split-K, reduce)
    configs.py    the one list of tile configurations (launcher, TensorRT tactics, CI compiles)
    launch.py     `paged_attention_triton(...)`: the reference's signature on the kernels
    ptx.py        ahead-of-time compiles of every configuration to PTX (sm_80 / sm_90)
    cpu/          the native CPU op for onnxruntime (C++; serves plugin graphs on CPU)
    native.py     builds and finds that library (scripts/build_cpu_ops.sh)
    ort.py        the reference as an onnxruntime custom op (validation; fallback)
    trt.py        TensorRT registration (tensorrt.plugin, ahead-of-time kernels)
    gpu_check.py  correctness and bandwidth at real sizes (scripts/gpu_check.sh)
"""

from .spec import OP_TYPE, PLUGIN_ID, PagedAttentionAttrs  # noqa: F401
