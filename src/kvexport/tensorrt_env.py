"""The TensorRT environment: is TensorRT really there, which CUDA GPU, the registration of every
kvexport op (the plugin registry, kvexport.plugins.REGISTRY), and a TensorRT logger that forwards
to `logging`.

Shared by the exporter (exporter/tensorrt_build.py builds engines) and the runtime
(runtime/execution/trt_backend.py runs them), so serving never imports the exporter. Every check raises
`TensorRTUnavailableError` naming what is missing and how to get it; nothing here imports
tensorrt or torch at module level.

NOTE: follows the TensorRT Python API documentation and is type-checked against
`tensorrt-stubs` (tests/tensorrt/test_typecheck.py); see docs/TENSORRT.md.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, KvExportError, TensorRTUnavailableError
from .manifest_engines import GpuInfo
from .plugins import REGISTRY

if TYPE_CHECKING:  # typed by tensorrt-stubs; imported for real only inside functions
    import tensorrt as trt

log = logging.getLogger(__name__)

# every op's TensorRT registration module (each exposes register()), in registry order: a graph may hold any
PLUGIN_MODULES = tuple(p.trt_module for p in REGISTRY)

INSTALL_HINT = ('install TensorRT with `pip install "kvexport[tensorrt]"` on a machine with an NVIDIA GPU '
                'and driver, or use the NVIDIA TensorRT container (see docker/)')
ONNX_OK = ("The ONNX build is complete and usable with onnxruntime as it is (`kvexport generate`, "
           "`kvexport serve`); build the engines later with TensorRT present.")


def require_tensorrt() -> str:
    """Check that the real TensorRT bindings import; returns their version.

    NOTE: `import tensorrt` alone proves nothing: the `tensorrt-stubs` package (a folder with
    only `__init__.pyi`) or a half-installed PyPI placeholder import as an empty namespace
    package. The bindings are there only if `tensorrt.Builder` is."""
    try:
        import tensorrt
    except ImportError as e:
        raise TensorRTUnavailableError(f"TensorRT is not installed (`import tensorrt` failed: {e}); "
                                       f"{INSTALL_HINT}. {ONNX_OK}") from None
    if not hasattr(tensorrt, "Builder"):
        raise TensorRTUnavailableError(
            f"`import tensorrt` found {getattr(tensorrt, '__path__', '?')} without the TensorRT bindings (only type "
            f"stubs or the PyPI placeholder package are installed); {INSTALL_HINT}. {ONNX_OK}")
    return str(tensorrt.__version__)


def cuda_device(device: int = 0) -> GpuInfo:
    """Name and compute capability of CUDA device `device` (via torch, a dependency), or
    TensorRTUnavailableError when there is none."""
    import torch

    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else "no NVIDIA GPU or driver is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
        raise TensorRTUnavailableError(f"TensorRT engines need a CUDA GPU, but {why}; build and run the engines on "
                                       f"a machine with an NVIDIA GPU and driver and a CUDA build of torch, or in "
                                       f"the NVIDIA TensorRT container (see docker/). {ONNX_OK}")
    if device >= torch.cuda.device_count():
        raise ConfigError(f"CUDA device {device} does not exist; this machine has {torch.cuda.device_count()}")
    major, minor = torch.cuda.get_device_capability(device)
    return GpuInfo(torch.cuda.get_device_name(device), f"{major}.{minor}")


def plugin_module(name: str) -> Any:
    """An op's TensorRT registration module (one of PLUGIN_MODULES; imported late: it imports tensorrt)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "tensorrt":
            raise TensorRTUnavailableError(f"the kvexport plugins need `{e.name}` (the `tensorrt.plugin` Python "
                                           f"plugin API), which this TensorRT lacks; {INSTALL_HINT}. {ONNX_OK}") from None
        if e.name and not name.startswith(e.name):
            raise  # something else the plugin module imports is missing: let its own error speak
        raise KvExportError(f"{name} is not part of this kvexport installation; reinstall kvexport "
                            f"(`pip install --force-reinstall kvexport`)") from None


def register_plugins() -> None:
    """Register every kvexport op of the plugin registry with TensorRT (PagedAttention, PagedMLA): engine
    builds parse graphs that hold them, and JIT plugins need the registration to deserialize."""
    for name in PLUGIN_MODULES:
        plugin_module(name).register()


def trt_logger() -> trt.ILogger:
    """A tensorrt.ILogger that forwards to `logging` (TensorRT INFO/VERBOSE become DEBUG)."""
    import tensorrt as trt

    levels = {trt.ILogger.INTERNAL_ERROR: logging.ERROR, trt.ILogger.ERROR: logging.ERROR,
              trt.ILogger.WARNING: logging.WARNING, trt.ILogger.INFO: logging.DEBUG,
              trt.ILogger.VERBOSE: logging.DEBUG}

    class _LogBridge(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            log.log(levels.get(severity, logging.INFO), "TensorRT: %s", msg)

    return _LogBridge()
