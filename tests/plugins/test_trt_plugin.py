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


def test_scores_plugin_combinations_and_kernel_source():
    """kvexport::PagedAttentionScores (spec.SCORES_OP_TYPE): one type string per (activation, pool) pair over
    its 7 inputs and float32 output, and its AOT kernel's signature in the same order."""
    combos = trt.scores_type_combinations()
    assert len(combos) == 6 and combos[1] == "FP16, INT8, INT64, INT64, INT64, FP32, INT64, FP32"
    assert all(len(c.split(", ")) == len(spec.SCORES_INPUTS) + 1 for c in combos)
    src = configs.scores_source(configs.SHAPES[0].attrs("int8"), "float16", per_channel_scales=False)
    params = [k for k, v in src.signature.items() if v != "constexpr"]
    assert params[:7] == ["q_ptr", "kc_ptr", "bt_ptr", "seq_lens_ptr", "qsl_ptr", "ks_ptr", "obs_ptr"]  # SCORES_INPUTS
    assert params[7:] == ["max_blocks", "num_blocks", "score_len", "scores_ptr"]  # the extras, then the output
    assert src.constexprs["SCALES_PER_CHANNEL"] is False and src.constexprs["KV_INT8"] is True


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
    assert tensorrt.get_plugin_registry().get_creator(spec.SCORES_OP_TYPE, spec.VERSION, spec.NAMESPACE) is not None
