"""TensorRT glue of PagedMLA (plugins/paged_mla/trt.py): importable and clearly failing without
TensorRT, its autotune types / tactics / launch grid consistent with spec.py and configs.py,
registered when TensorRT exists. (Its mypy check against `tensorrt-stubs` is in
tests/tensorrt/test_typecheck.py, with the rest of the TensorRT glue.)"""

import importlib.util
import re
from pathlib import Path

import pytest

from kvexport.errors import KvExportError
from kvexport.plugins.paged_mla import configs, spec, trt

HAS_TRT = importlib.util.find_spec("tensorrt") is not None and importlib.util.find_spec("tensorrt.plugin") is not None


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed")
def test_register_without_tensorrt_raises_a_clear_error():
    with pytest.raises(trt.TensorRTUnavailableError, match="PagedMLA plugin needs TensorRT") as e:
        trt.register()
    assert isinstance(e.value, KvExportError)


def test_autotune_combinations_tactics_and_grid():
    combos = trt.type_combinations()
    assert len(combos) == 4  # fp16/bf16 activations × (same-dtype, int8) pools
    for c in combos:
        types = c.split(", ")
        assert len(types) == len(spec.INPUTS) + len(spec.OUTPUTS)
        assert types[3:7] == ["INT64"] * 4 and types[7] == "FP32"
        assert types[2] == types[9] and types[0] == types[1] == types[8]  # the aliased pool keeps its dtype
    assert combos[1].startswith("FP16, FP16, INT8,")
    assert [t.tactic for t in configs.TILES] == [1, 2, 3]
    assert all(trt.tactic_tile(t.tactic) == t for t in configs.TILES)
    with pytest.raises(KvExportError, match="rebuild"):
        trt.tactic_tile(99)
    v3 = configs.SHAPES[0].attrs("float16")  # 128 heads: one token per program, 8 head programs
    assert trt.launch_grid(v3, 1) == (1, 8) and trt.launch_grid(v3, 3) == (1, 2)
    lite = configs.SHAPES[1].attrs("int8")  # 16 heads: a program holds every head of 1, 2 or 4 tokens
    assert [trt.launch_grid(lite, t.tactic) for t in configs.TILES] == [(1, 1), (2, 1), (4, 1)]


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
