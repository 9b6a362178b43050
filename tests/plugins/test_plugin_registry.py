"""Every plugin folder is registered, and every registered op has a spec, a reference, kernel
tests against that reference and a graph parity test (exporter, onnxruntime harness)."""

import importlib
from pathlib import Path

from kvexport import io, tensorrt_env
from kvexport.plugins import PLUGINS, REGISTRY

TESTS = Path(__file__).resolve().parents[1]
# op_type -> (test file under tests/, its graph parity test), as the registry names them
PARITY_TESTS = {p.op_type: tuple(p.parity_test.split("::")) for p in REGISTRY}
SOURCE = Path(importlib.import_module("kvexport.plugins").__file__).parent


def test_every_plugin_folder_is_registered():
    folders = {p.name for p in SOURCE.iterdir() if (p / "spec.py").is_file()}
    assert folders == set(PLUGINS.values())


def test_every_registered_plugin_has_reference_kernel_tests_and_graph_parity():
    kernel_tests = "".join(p.read_text() for p in (TESTS / "plugins").glob("test*kernels_interpret.py"))
    for op_type, folder in PLUGINS.items():
        parity_file, parity_test = PARITY_TESTS[op_type]
        parity_tests = (TESTS / parity_file).read_text()
        spec = importlib.import_module(f"kvexport.plugins.{folder}.spec")
        ref = importlib.import_module(f"kvexport.plugins.{folder}.reference")
        assert spec.OP_TYPE == op_type and spec.NAMESPACE == io.PLUGIN_DOMAIN
        assert callable(getattr(ref, folder))  # the reference is named after the folder
        assert f"kvexport.plugins.{folder}" in kernel_tests and "reference" in kernel_tests
        assert f"def {parity_test}(" in parity_tests


def test_every_registered_plugin_is_registered_with_tensorrt():
    """tensorrt_env registers the registry's ops, each through its folder's trt.register()."""
    assert tensorrt_env.PLUGIN_MODULES == tuple(f"kvexport.plugins.{p.folder}.trt" for p in REGISTRY)
    for name in tensorrt_env.PLUGIN_MODULES:
        assert callable(importlib.import_module(name).register)  # imports no tensorrt until called
