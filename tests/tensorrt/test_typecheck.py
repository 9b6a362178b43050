"""Type-check the TensorRT glue (kvexport/tensorrt_env.py, exporter/tensorrt_build.py,
runtime/execution/trt_backend.py, plugins/common/trt.py, plugins/paged_attention/trt.py, plugins/paged_mla/trt.py) with mypy
against the `tensorrt-stubs` type stubs: every TensorRT class, method, argument count and
enum member the glue uses must exist with that signature in the stubs (TensorRT 10.13).

Where the stubs come from: `$KVEXPORT_TENSORRT_STUBS`, else `<venv>/tensorrt-stubs`, else an
installed `tensorrt-stubs` distribution. NOTE: install them with
`pip install --no-deps --target "$VIRTUAL_ENV/tensorrt-stubs" tensorrt-stubs==10.13.0.35.1`:
their metadata requires the real `tensorrt==10.13.0.35` (not installable here), and stubs
installed into site-packages make `import tensorrt` succeed as an empty namespace package.

NOTE: the generated stubs have five lines that are not valid Python (a parameter named `in`,
a required parameter after defaults); the test fixes those in a temporary copy. Errors inside
the stubs are ignored; errors in kvexport's code are not."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULES = ("kvexport.tensorrt_env", "kvexport.exporter.tensorrt_build", "kvexport.runtime.execution.trt_backend",
           "kvexport.plugins.common.trt", "kvexport.plugins.paged_attention.trt", "kvexport.plugins.paged_mla.trt",
           "kvexport.plugins.gated_delta.trt")

MYPY_INI = """\
[mypy]
python_version = 3.11
follow_imports = silent
check_untyped_defs = True
warn_unused_ignores = True
[mypy-tensorrt.*,tensorrt_bindings.*]
ignore_errors = True
[mypy-tensorrt_libs.*]
ignore_missing_imports = True
[mypy-torch.*,onnx.*,onnxruntime.*,onnxruntime_extensions.*,transformers.*,tokenizers.*,triton.*]
follow_imports = skip
ignore_missing_imports = True
"""


def _stubs_dir() -> Path | None:
    candidates = [os.environ.get("KVEXPORT_TENSORRT_STUBS"), str(Path(sys.prefix) / "tensorrt-stubs")]
    spec = importlib.util.find_spec("tensorrt_stubs")
    if spec is not None and spec.origin:
        candidates.append(str(Path(spec.origin).parent.parent))
    for c in candidates:
        if c and (Path(c) / "tensorrt" / "__init__.pyi").is_file():
            return Path(c)
    return None


def _fixed_stubs(src: Path, dst: Path) -> Path:
    for pkg in ("tensorrt", "tensorrt_bindings"):
        shutil.copytree(src / pkg, dst / pkg)
    p = dst / "tensorrt_bindings" / "tensorrt.pyi"
    text = re.sub(r"([(,] )in:", r"\1in_:", p.read_text())  # `in` is a keyword
    text = text.replace("power: Weights = None, channel_axis: int)", "power: Weights = None, channel_axis: int = ...)")
    p.write_text(text)
    return dst


def _source_tree(dst: Path) -> Path:
    """kvexport as mypy should see it: the package-dir mapping of pyproject.toml, as symlinks."""
    pkg = dst / "kvexport"
    shutil.copytree(REPO / "src" / "kvexport", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for sub in ("exporter", "runtime", "plugins", "recipes"):
        os.symlink(REPO / sub, pkg / sub)
    return dst


def test_tensorrt_glue_typechecks_against_tensorrt_stubs(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed: pip install -e '.[test]'")
    stubs = _stubs_dir()
    if stubs is None:
        pytest.skip("tensorrt-stubs not found: pip install --no-deps --target \"$VIRTUAL_ENV/tensorrt-stubs\" "
                    "tensorrt-stubs==10.13.0.35.1 (or set KVEXPORT_TENSORRT_STUBS)")
    fixed = _fixed_stubs(stubs, tmp_path / "stubs")
    src = _source_tree(tmp_path / "src")
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    args = [sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"),
            "--cache-dir", str(tmp_path / "cache"), "--no-error-summary"]
    for m in MODULES:
        args += ["-m", m]
    env = dict(os.environ, MYPYPATH=f"{src}{os.pathsep}{fixed}")
    r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"mypy found problems:\n{r.stdout}{r.stderr}"


def test_typecheck_catches_a_wrong_tensorrt_call(tmp_path):
    """The check has teeth: a misspelt enum member and a wrong argument count are reported."""
    stubs = _stubs_dir()
    if importlib.util.find_spec("mypy") is None or stubs is None:
        pytest.skip("needs mypy and tensorrt-stubs (see the test above)")
    fixed = _fixed_stubs(stubs, tmp_path / "stubs")
    bad = tmp_path / "src" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("import tensorrt as trt\n\n\ndef f(config: trt.IBuilderConfig) -> None:\n"
                   "    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_3, True, 1)\n")
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"),
                        "--cache-dir", str(tmp_path / "cache"), str(bad)], cwd=tmp_path,
                       env=dict(os.environ, MYPYPATH=str(fixed)), capture_output=True, text=True, timeout=600)
    assert r.returncode == 1
    assert 'has no attribute "ALIASED_PLUGIN_IO_10_3"' in r.stdout
    assert 'Too many arguments for "set_preview_feature"' in r.stdout
