"""What `kvexport engines` passes to TensorRT for quantized weights (exporter/tensorrt_build.py
`engine_quantization`, `weight_problems`), decided without TensorRT: weight-only INT4 in blocks
of 64/128 and per-channel INT8 go through (strong typing: no builder flag), what TensorRT's Q/DQ
cannot take is refused before any TensorRT call, and `--backend tensorrt` builds quantize their
LM head per channel so their graphs qualify."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto

from kvexport import io
from kvexport.errors import ConfigError, TensorRTUnavailableError
from kvexport.exporter import tensorrt_build as tb
from kvexport.exporter.build import BuildOptions, build
from kvexport.manifest import (EngineBuildOptions, QuantizedMatrices, QuantizedTable, WeightQuantizationEntry, WeightsEntry,
                               load)


@pytest.mark.parametrize("bits,block,ok", [(4, 64, True), (4, 128, True), (4, 32, False), (4, 0, False),
                                           (8, 0, True), (8, 32, False), (8, 128, False)])
def test_weight_problems_follow_tensorrt_quantization_schemes(bits, block, ok):
    assert (tb.weight_problems(bits, block) == []) is ok
    assert tb.weight_problems(4, 128, symmetric=False)[0].startswith("the codes have zero points")
    assert "offsets" in tb.weight_problems(4, 64, offsets=True)[0]
    assert "LM head is in blocks of 64" in tb.weight_problems(4, 64, head_block_size=64)[0]
    assert tb.weight_problems(4, 64, head_block_size=0) == []  # per-channel int8 head


def test_float_and_asymmetric_weight_entries():
    plan = tb.engine_quantization(WeightsEntry("weights.data", 1, 1, "fp16", None))
    assert (plan.mode, plan.block_size, plan.builder_flags) == ("none", None, ())
    awq = WeightQuantizationEntry(
        precision="int4", bits=4, block_size=128, axis="input (K)", method="awq:gemm (pre-quantized codes)",
        symmetric=False, block_offsets=False, scales_dtype="float16", code_dtype="int4 (two per byte)",
        format="onnx QDQ", quantized=QuantizedMatrices(2, {"awq:gemm": 1, "rtn": 1},
                                                       "model.layers.*.{attn.qkv}, lm_head.quantized.weight (int8)"),
        kept={}, requantized_from=None, lm_head=QuantizedTable(8, "channel", "rtn"))
    with pytest.raises(ConfigError, match=r"int4 weights:\n  - the codes have zero points") as e:
        tb.engine_quantization(WeightsEntry("weights.data", 1, 1, "int4", awq))
    assert "LM head" not in str(e.value)  # the per-channel head is fine


def test_tensorrt_options_refused_before_any_work():
    with pytest.raises(ConfigError, match="--backend tensorrt: int4 weights in blocks of 32.*64 or 128"):
        BuildOptions(backend="tensorrt", dtype=io.DType.FP16, weights="int4", weight_block_size=32)
    with pytest.raises(ConfigError, match="--backend tensorrt: int8 weights in blocks of 64.*channel"):
        BuildOptions(backend="tensorrt", dtype=io.DType.FP16, weights="int8", weight_block_size=64)


def test_int4_builds_for_tensorrt_and_for_onnxruntime(hf_folder, tmp_path):
    """The same int4 options: the onnxruntime build's block-wise int8 head is refused by name;
    the --backend tensorrt build's graphs (int4 blocks of 64, per-channel int8 head) qualify."""
    src = str(hf_folder("llama", num_key_value_heads=2))
    common = dict(dtype=io.DType.FP16, attention=io.Attention.PLUGIN, weights="int4", weight_block_size=64,
                  block_size=4, max_seq_len=64, validate=False)
    _, m = build(src, tmp_path / "ort", BuildOptions(**common))
    with pytest.raises(ConfigError, match="LM head is in blocks of 64.*--backend tensorrt"):
        tb.check_buildable(m, EngineBuildOptions())
    out = tmp_path / "trt"
    try:
        build(src, out, BuildOptions(backend="tensorrt", **common))
    except TensorRTUnavailableError:
        pass  # no TensorRT or GPU here: the ONNX build is complete regardless
    m = load(out)
    assert m.weights.quantization.lm_head.block_size == "channel"
    assert tb.check_buildable(m, EngineBuildOptions()) == "fp16"
    plan = tb.engine_quantization(m.weights)
    assert (plan.weights, plan.mode, plan.block_size, plan.builder_flags) == ("int4", "weight-only", 64, ())
    g = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False)
    types = {i.name: i.data_type for i in g.graph.initializer}
    dq = [n for n in g.graph.node if n.op_type == "DequantizeLinear" and n.input[0].endswith(".weight.q")]
    head = [n for n in dq if n.input[0].startswith("lm_head")]
    assert len(head) == 1 and {a.name: a.i for a in head[0].attribute} == {"axis": 1}  # per channel, [vocab] scales
    assert types[head[0].input[0]] == TensorProto.INT8
    assert all(types[n.input[0]] == TensorProto.INT4 and len(n.input) == 2 for n in dq if n not in head)
