"""TensorRT glue (trt.py): importable and clearly failing without TensorRT, consistent with
the configs, type-checked with mypy against `tensorrt-stubs`, registered when TensorRT exists."""

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvexport.errors import KvExportError
from kvexport.plugins.paged_attention import configs, spec, trt

HAS_TRT = importlib.util.find_spec("tensorrt") is not None and importlib.util.find_spec("tensorrt.plugin") is not None
STUBS = "tensorrt-stubs==10.13.0.35.1"  # newest stubs (TensorRT 10.13); no tensorrt.plugin in them


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed")
def test_register_without_tensorrt_raises_a_clear_error():
    with pytest.raises(trt.TensorRTUnavailableError, match="TensorRT is not installed") as e:
        trt.register()
    assert isinstance(e.value, KvExportError)


def test_autotune_combinations_and_tactics():
    combos = trt.type_combinations()
    assert len(combos) == 4  # fp16/bf16 activations × (same-dtype, int8) pools
    for c in combos:
        types = c.split(", ")
        assert len(types) == len(spec.INPUTS) + len(spec.OUTPUTS)
        assert types[5:9] == ["INT64"] * 4 and types[9:11] == ["FP32", "FP32"]
        assert types[3:5] == types[12:14]  # aliased pools keep their dtype
    assert "FP16, FP16, FP16, INT8, INT8" in combos[1]
    tactics = [t.tactic for t in configs.PREFILL_TILES]
    assert tactics == [1, 2, 3]
    assert all(trt.tactic_tile(t) == tile for t, tile in zip(tactics, configs.PREFILL_TILES))
    with pytest.raises(KvExportError, match="rebuild"):
        trt.tactic_tile(99)


def test_trt_module_has_no_postponed_annotations():
    # tensorrt.plugin calls issubclass() on the decorated functions' annotations
    src = Path(trt.__file__).read_text()
    assert not re.search(r"^from __future__ import annotations", src, re.M)


def _stub_dir(tmp_path: Path) -> Path:
    """The .pyi files of tensorrt-stubs, unpacked into a MYPYPATH folder. NOTE: the wheel is
    not installed (its metadata requires the unfetchable tensorrt wheel, and it would put an
    importable `tensorrt` namespace package into the environment)."""
    dl = tmp_path / "wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", STUBS, "-d", str(dl)],
                          capture_output=True, text=True, timeout=300)
    wheels = list(dl.glob("*.whl"))
    if proc.returncode or not wheels:
        pytest.skip(f"cannot download {STUBS} from the package index: {proc.stderr.strip()[-300:]}")
    out = tmp_path / "stubs"
    with zipfile.ZipFile(wheels[0]) as z:
        for name in z.namelist():
            if name.endswith(".pyi"):
                z.extract(name, out)
    # NOTE: two generated signatures in these stubs are not valid Python (a parameter named
    # `in`; a required parameter after defaulted ones); repaired so that mypy can parse them.
    bindings = out / "tensorrt_bindings" / "tensorrt.pyi"
    text = re.sub(r"(\(self(?:: \w+)?), in: ", r"\1, in_: ", bindings.read_text())
    text = text.replace("power: Weights = None, channel_axis: int)", "power: Weights = None, channel_axis: int = ...)")
    bindings.write_text(text)
    return out


def test_trt_glue_type_checks_against_tensorrt_stubs(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the test extra")
    stubs = _stub_dir(tmp_path)
    env = {**os.environ, "MYPYPATH": str(stubs)}
    probe = tmp_path / "probe.py"  # the stubs are really used: a misspelt name is an error
    probe.write_text("import tensorrt as trt\nx: trt.DataType = trt.float16\ny = trt.float33\n")
    cmd = [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", "--ignore-missing-imports"]
    p = subprocess.run(cmd + [str(probe)], env=env, capture_output=True, text=True, timeout=600)
    errors = _errors(p.stdout, str(probe))
    assert len(errors) == 1 and 'Module has no attribute "float33"' in errors[0], p.stdout[-3000:]
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run(cmd + ["plugins/paged_attention/trt.py"], env=env, cwd=root, capture_output=True,
                       text=True, timeout=600)
    assert "error:" not in p.stderr and _errors(p.stdout, "plugins/paged_attention/trt.py") == [], p.stdout[-3000:]


def _errors(stdout: str, path: str) -> list[str]:
    """mypy errors in `path` (the generated stubs themselves carry errors, e.g. a `bool` alias)."""
    return [line for line in stdout.splitlines() if line.startswith(path + ":") and ": error:" in line]


@pytest.mark.tensorrt
@pytest.mark.skipif(not HAS_TRT, reason="needs TensorRT >= 10.10 (`import tensorrt.plugin` fails here)")
def test_register_with_tensorrt():
    import tensorrt

    trt.register()
    trt.register()  # idempotent
    creator = tensorrt.get_plugin_registry().get_creator(spec.OP_TYPE, spec.VERSION, spec.NAMESPACE)
    assert creator is not None
