"""TensorRT glue of GatedDeltaRule (plugins/gated_delta/trt.py): importable and clearly failing without
TensorRT, its autotune types / tactics / launch grid consistent with spec.py and configs.py, registered
when TensorRT exists. (Its mypy check against `tensorrt-stubs` is in tests/tensorrt/test_typecheck.py.)"""

import importlib.util
import re
from pathlib import Path

import pytest

from kvexport.errors import KvExportError
from kvexport.plugins.gated_delta import configs, spec, trt

HAS_TRT = importlib.util.find_spec("tensorrt") is not None and importlib.util.find_spec("tensorrt.plugin") is not None


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed")
def test_register_without_tensorrt_raises_a_clear_error():
    with pytest.raises(trt.TensorRTUnavailableError, match="GatedDeltaRule plugin needs TensorRT") as e:
        trt.register()
    assert isinstance(e.value, KvExportError)


def test_autotune_combinations_tactics_and_grid():
    combos = trt.type_combinations()
    assert combos == ["FP16, FP16, FP16, FP32, FP32, FP32, INT64, INT64, INT64, FP16, FP32",
                      "BF16, BF16, BF16, FP32, FP32, FP32, INT64, INT64, INT64, BF16, FP32"]
    assert all(len(c.split(", ")) == len(spec.INPUTS) + len(spec.OUTPUTS) for c in combos)
    assert [t.tactic for t in configs.TILES] == [1, 2, 3]
    with pytest.raises(KvExportError, match="rebuild"):
        trt.tactic_tile(99)
    qwen35 = configs.SHAPES[0].attrs()  # 16 value heads of 128: 4, 2 or 8 value tiles per head
    assert [trt.launch_grid(qwen35, t.tactic) for t in configs.TILES] == [(16, 4), (16, 2), (16, 8)]


def test_trt_module_has_no_postponed_annotations():
    src = Path(trt.__file__).read_text()  # tensorrt.plugin calls issubclass() on the annotations
    assert not re.search(r"^from __future__ import annotations", src, re.M)


@pytest.mark.tensorrt
@pytest.mark.skipif(not HAS_TRT, reason="needs TensorRT >= 10.10 (`import tensorrt.plugin` fails here)")
def test_register_with_tensorrt():
    import tensorrt

    trt.register()
    trt.register()  # idempotent
    assert tensorrt.get_plugin_registry().get_creator(spec.OP_TYPE, spec.VERSION, spec.NAMESPACE) is not None
