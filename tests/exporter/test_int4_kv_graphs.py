"""int4 KV in the exported graphs: the standard-ops codec (exporter/kv_int4.py) stores the
reference's bytes exactly (onnxruntime sessions, edge values included), the Hadamard rotation
is orthogonal, and tiny random models built with --kv-dtype int4 (paged `onnx` attention, paged
plugin attention on the native CPU op, contiguous) validate against transformers, the two paged
attentions agree on logits and on the bytes they store, and bad input is refused naming
--kv-dtype."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.exporter import kv_int4
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.onnx_builder import GraphBuilder, WeightStore
from kvexport.exporter.validate import TOLERANCE, PagedDriver, prompt_ids
from kvexport.plugins.paged_attention.reference import dequantize_int4, quantize_int4


def _codec_session(d: int, rank: int):
    b = GraphBuilder("codec", WeightStore())
    q = kv_int4.quantize_rows(b, "x", d, rank)
    x = kv_int4.dequantize_rows(b, "rows", d, rank)
    b.opset = io.ONNX_OPSET
    row = io.kv_row_width(d, "int4")
    dims = [f"a{i}" for i in range(rank - 1)]
    graph = helper.make_graph(
        b.nodes, "codec",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims + [d]),
         helper.make_tensor_value_info("rows", TensorProto.UINT8, dims + [row])],
        [helper.make_tensor_value_info(q, TensorProto.UINT8, None), helper.make_tensor_value_info(x, TensorProto.FLOAT, None)],
        initializer=b.constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", io.ONNX_OPSET)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("d, rank", [(64, 3), (96, 4)])
def test_onnx_codec_stores_the_reference_bytes(d, rank):
    gen = torch.Generator().manual_seed(d)
    shape = (3, 2, 5, d)[-rank:] if rank == 4 else (6, 2, d)
    x = torch.randn(shape, generator=gen) * torch.logspace(-6, 3, shape[-2])[:, None]
    x = x.reshape(-1, d)
    x[0] = 0.0  # constant group: minimum scale 2^-14
    x[1, :32] = -0.0  # a -0.0 minimum keeps its sign bit
    x[2, :32] = 1e-6  # float16 subnormals
    x[3, 5] = 3e5  # saturation at ±65504
    x[4, :32] = -7.25
    x = x.reshape(shape)
    want = quantize_int4(x).numpy()
    rows, back = _codec_session(d, rank).run(None, {"x": x.numpy(), "rows": want})
    np.testing.assert_array_equal(rows, want)
    np.testing.assert_array_equal(back, dequantize_int4(torch.from_numpy(want), d).numpy())


def test_hadamard_is_orthogonal_and_keeps_scores():
    for d in (32, 64, 96, 128):
        h = kv_int4.hadamard(d).astype(np.float64)
        np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-6)
    h = kv_int4.hadamard(64)
    assert set(np.unique(np.abs(h))) == {0.125}  # ±1/8 exactly: head_dim 64 rotates exactly


HF = dict(hidden_size=128, num_attention_heads=4)  # head_dim 32: one group per head
OPTS = dict(block_size=4, max_seq_len=64, kv_dtype=io.DType.INT4)


@pytest.mark.parametrize("family, attention, layout", [
    ("qwen2", io.Attention.ONNX, io.KVLayout.PAGED),
    ("llama", io.Attention.PLUGIN, io.KVLayout.PAGED),
    ("llama", None, io.KVLayout.CONTIGUOUS),
])
def test_int4_builds_validate(hf_folder, tmp_path, family, attention, layout, cpu_op):
    src = str(hf_folder(family, num_key_value_heads=2, **HF))
    out, m = build(src, tmp_path / "b", BuildOptions(attention=attention, layout=layout, **OPTS))
    assert m.kv.dtype == "int4" and m.kv.quantization["scheme"] == io.KV_INT4_FORMAT
    assert m.kv.bytes_per_token == io.kv_bytes_per_token(2, 2, 32, io.DType.INT4) == 2 * 2 * 2 * 18
    v = m.validation
    assert v.passed and v.max_abs_diff <= TOLERANCE["int4_kv"], v
    assert v.max_abs_diff > TOLERANCE["fp32"]  # the codes are really 4-bit: not the float path
    if layout is io.KVLayout.CONTIGUOUS:
        assert not (out / io.GENAI_CONFIG).exists()  # onnxruntime-genai cannot allocate these rows


def test_plugin_and_onnx_attention_agree(hf_folder, tmp_path, cpu_op):
    src = str(hf_folder("qwen2", num_key_value_heads=2, **HF))
    plug, mp = build(src, tmp_path / "p", BuildOptions(attention=io.Attention.PLUGIN, validate=False, **OPTS))
    ref, mr = build(src, tmp_path / "o", BuildOptions(attention=io.Attention.ONNX, validate=False, **OPTS))
    prompts = prompt_ids(None, mr.model.vocab_size)
    forced = [[(7 * s + t) % 100 + 3 for t in range(5)] for s in range(len(prompts))]
    a = PagedDriver(plug, mp, "native").run(prompts, forced, 5)
    b = PagedDriver(ref, mr).run(prompts, forced, 5)
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) < 1e-3


def test_int4_needs_head_dim_a_multiple_of_32(hf_folder, tmp_path):
    src = str(hf_folder("llama", num_key_value_heads=2))  # head_dim 16
    with pytest.raises(ConfigError, match="--kv-dtype int4 needs head_dim a multiple of 32"):
        build(src, tmp_path / "b", BuildOptions(**OPTS))
    assert not (tmp_path / "b").exists()
