"""TensorRT glue (trt.py): importable and clearly failing without TensorRT, consistent with
the configs, registered when TensorRT exists. (Its mypy check against `tensorrt-stubs` is
in tests/tensorrt/test_typecheck.py, with the rest of the TensorRT glue.)"""

import importlib.util
import re
from pathlib import Path

import pytest

from kvexport.errors import KvExportError
from kvexport.plugins.paged_attention import configs, spec, trt

HAS_TRT = importlib.util.find_spec("tensorrt") is not None and importlib.util.find_spec("tensorrt.plugin") is not None


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed")
def test_register_without_tensorrt_raises_a_clear_error():
    with pytest.raises(trt.TensorRTUnavailableError, match="TensorRT is not installed") as e:
        trt.register()
    assert isinstance(e.value, KvExportError)


def test_autotune_combinations_and_tactics():
    combos = trt.type_combinations()
    assert len(combos) == 6  # fp16/bf16 activations × (same-dtype, int8, int4 = UINT8 rows) pools
    for c in combos:
        types = c.split(", ")
        assert len(types) == len(spec.INPUTS) + len(spec.OUTPUTS)
        assert types[5:9] == ["INT64"] * 4 and types[9:11] == ["FP32", "FP32"]
        assert types[3:5] == types[12:14]  # aliased pools keep their dtype
    assert "FP16, FP16, FP16, INT8, INT8" in combos[1] and "FP16, FP16, FP16, UINT8, UINT8" in combos[2]
    tactics = [t.tactic for t in configs.PREFILL_TILES]
    assert tactics == [1, 2, 3]
    assert all(trt.tactic_tile(t) == tile for t, tile in zip(tactics, configs.PREFILL_TILES))
    with pytest.raises(KvExportError, match="rebuild"):
        trt.tactic_tile(99)


def test_trt_module_has_no_postponed_annotations():
    # tensorrt.plugin calls issubclass() on the decorated functions' annotations
    src = Path(trt.__file__).read_text()
    assert not re.search(r"^from __future__ import annotations", src, re.M)


@pytest.mark.tensorrt
@pytest.mark.skipif(not HAS_TRT, reason="needs TensorRT >= 10.10 (`import tensorrt.plugin` fails here)")
def test_register_with_tensorrt():
    import tensorrt

    trt.register()
    trt.register()  # idempotent
    creator = tensorrt.get_plugin_registry().get_creator(spec.OP_TYPE, spec.VERSION, spec.NAMESPACE)
    assert creator is not None
