"""kvexport.plugins: custom ops for TensorRT, one folder per op (spec, reference, kernels,
registration, README), and common/, the pieces every op folder shares (the PyOp harness,
TensorRT registration helpers, the ahead-of-time compile, the GPU check's command line).

REGISTRY is the one list of the ops: everything that needs every op derives from it
(kvexport/tensorrt_env.py registers each op's `trt` module; tests/plugins/test_plugin_registry.py
checks that every folder is registered and every registered op has a reference, kernel tests
against it and a graph parity test). A new op adds its folder and one entry here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Plugin:
    """One op of the registry."""

    op_type: str  # the ONNX op_type in the `kvexport` domain (= the folder's spec.OP_TYPE)
    folder: str  # its subpackage of kvexport.plugins
    parity_test: str  # its graph parity test, "<file under tests/>::<test function>"

    @property
    def package(self) -> str:
        """The op's package, e.g. kvexport.plugins.paged_attention."""
        return f"{__name__}.{self.folder}"

    @property
    def trt_module(self) -> str:
        """The op's TensorRT registration module (exposes register())."""
        return f"{self.package}.trt"


REGISTRY = (
    Plugin("PagedAttention", "paged_attention",
           "exporter/test_plugin_and_int8.py::test_plugin_graph_matches_transformers_and_onnx_attention"),
    Plugin("PagedMLA", "paged_mla", "exporter/test_deepseek_mla.py::test_parity_fp32"),
    Plugin("GatedDeltaRule", "gated_delta", "exporter/test_qwen3_5_plugin.py::test_parity_fp32_plugin"),
)
PLUGINS = {p.op_type: p.folder for p in REGISTRY}  # op_type -> subpackage of kvexport.plugins
