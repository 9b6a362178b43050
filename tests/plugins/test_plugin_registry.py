"""Every plugin folder is registered, and every registered op has a spec, a reference, kernel
tests against that reference and a graph parity test (exporter, onnxruntime harness)."""

import importlib
from pathlib import Path

from kvexport import io
from kvexport.plugins import PLUGINS

TESTS = Path(__file__).resolve().parents[1]
# op_type -> its graph parity test in tests/exporter/test_plugin_and_int8.py (a new op must add one)
PARITY_TESTS = {"PagedAttention": "test_plugin_graph_matches_transformers_and_onnx_attention"}
SOURCE = Path(importlib.import_module("kvexport.plugins").__file__).parent


def test_every_plugin_folder_is_registered():
    folders = {p.name for p in SOURCE.iterdir() if (p / "spec.py").is_file()}
    assert folders == set(PLUGINS.values())


def test_every_registered_plugin_has_reference_kernel_tests_and_graph_parity():
    kernel_tests = (TESTS / "plugins" / "test_kernels_interpret.py").read_text()
    parity_tests = (TESTS / "exporter" / "test_plugin_and_int8.py").read_text()
    for op_type, folder in PLUGINS.items():
        spec = importlib.import_module(f"kvexport.plugins.{folder}.spec")
        ref = importlib.import_module(f"kvexport.plugins.{folder}.reference")
        assert spec.OP_TYPE == op_type and spec.NAMESPACE == io.PLUGIN_DOMAIN
        assert callable(getattr(ref, folder))  # the reference is named after the folder
        assert f"kvexport.plugins.{folder}" in kernel_tests and "reference" in kernel_tests
        assert f"def {PARITY_TESTS[op_type]}(" in parity_tests
