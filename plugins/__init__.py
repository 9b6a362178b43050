"""kvexport.plugins: custom ops for TensorRT, one folder per op (spec, reference, kernels,
registration, README).

PLUGINS maps each op's ONNX op_type to its folder; tests/plugins/test_plugin_registry.py
checks that every folder is registered and every registered op has a reference, kernel
tests against it and a graph parity test."""

PLUGINS = {"PagedAttention": "paged_attention", "PagedMLA": "paged_mla"}  # op_type -> subpackage of kvexport.plugins
