"""`kvexport::PagedAttention`: paged / GQA / INT8-KV attention over a block pool.

    spec.py       inputs, outputs, attributes, aliasing, tolerances (the contract)
    reference.py  readable torch reference: the executable definition
    kernels.py    Triton kernels (prefill + decode, split-K) — tested under TRITON_INTERPRET=1
    ort.py        the reference as an onnxruntime custom op (proves plugin graphs on CPU)
    trt.py        TensorRT registration (tensorrt.plugin, ahead-of-time kernels)
"""

from .spec import OP_TYPE, PLUGIN_ID, PagedAttentionAttrs  # noqa: F401
