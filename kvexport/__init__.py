"""kvexport: Hugging Face causal LMs -> prefill/decode ONNX graphs with explicit KV cache,
TensorRT plugins and a batching runtime.

This package holds the CLI and the contracts shared by all parts (`kvexport.io`,
`kvexport.manifest`, `kvexport.errors`); the parts live in `kvexport.exporter`,
`kvexport.plugins`, `kvexport.runtime` and `kvexport.recipes`.
"""

__version__ = "0.1.0"
