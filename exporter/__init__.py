"""kvexport.exporter: HF folder / GGUF / alias -> validated build directory (prefill and
decode ONNX graphs, shared weights, tokenizer, manifest). Entry point: `build.build()`."""
