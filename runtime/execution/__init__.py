"""kvexport.runtime.execution: one step's tensors.

ModelRunner (model_runner.py: the one packing function) -> backends (backends.py, the
factory; ort_backends.py + ort_quant.py for onnxruntime; trt_backend.py for TensorRT; the
Protocol and the input type in model_input.py) -> sampler (sampling.py) -> text
(detokenizer.py, output_processor.py). The KV tiers' copier (kv_offload.py, kv_disk.py) and
the KV connector's worker side (kv_connector.py: a block's bytes) move blocks."""
