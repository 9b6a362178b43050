"""kvexport: Hugging Face causal LMs -> prefill/decode ONNX graphs with explicit KV cache,
TensorRT plugins and a batching runtime.

This package holds the CLI and the contracts shared by all parts (`kvexport.io`,
`kvexport.manifest`, `kvexport.errors`); the parts live in `kvexport.exporter`,
`kvexport.plugins`, `kvexport.runtime` and `kvexport.recipes`.

    from kvexport import LLM, SamplingParams
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # NOTE: lazy, so `import kvexport` (and the CLI's --help) stays light.
    if name == "LLM":
        from kvexport.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvexport.runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
