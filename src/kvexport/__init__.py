"""kvexport: Hugging Face causal LMs -> prefill/decode ONNX graphs with explicit KV cache,
TensorRT plugins and a batching runtime.

This package holds the CLI and the contracts shared by all parts (`kvexport.io`,
`kvexport.manifest`, `kvexport.errors`); the parts live in `kvexport.exporter`,
`kvexport.plugins`, `kvexport.runtime` and `kvexport.recipes`.

    from kvexport import LLM, SamplingParams, StructuredOutputs
    LLM("build/x").generate(["..."], SamplingParams(structured=StructuredOutputs(json=MyPydanticModel)))
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "__version__"]


def __getattr__(name: str):
    # NOTE: lazy, so `import kvexport` (and the CLI's --help) stays light.
    if name == "LLM":
        from kvexport.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvexport.runtime.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputs":  # SamplingParams.structured: json schema | json_object | regex | choice | grammar
        from kvexport.runtime.sampling_params import StructuredOutputs

        return StructuredOutputs
    raise AttributeError(name)
