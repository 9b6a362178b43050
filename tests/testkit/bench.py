"""bench/ scripts as modules: the tests drive the same code the benchmarks run (bench/ is no package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def script(name: str) -> ModuleType:
    """bench/NAME.py, imported (e.g. "dynamo_routing": its `local_cluster` starts a frontend and workers)."""
    spec = importlib.util.spec_from_file_location(f"kvexport_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
