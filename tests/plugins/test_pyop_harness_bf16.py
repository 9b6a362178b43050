"""The onnxruntime-extensions PyOp harness (plugins/paged_attention/ort.py, shared by
plugins/paged_mla/ort.py) on bfloat16 graphs: PyOps have no bfloat16, so the rewrite runs the
reference in float32 between Casts, for PagedAttention as for PagedMLA; the output equals the
reference's within bfloat16 rounding and the pools bit for bit."""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from kvexport.plugins.paged_attention import ort as pa_ort
from kvexport.plugins.paged_attention import reference as pa_reference
from kvexport.plugins.paged_attention.native import one_node_model as pa_one_node_model
from kvexport.plugins.paged_attention.spec import INPUTS as PA_INPUTS
from kvexport.plugins.paged_mla import ort as mla_ort
from kvexport.plugins.paged_mla import reference as mla_reference
from kvexport.plugins.paged_mla.native import one_node_model as mla_one_node_model

pytest.importorskip("onnxruntime_extensions")


def fed_as_float32(model: onnx.ModelProto, bf16: set[str]) -> onnx.ModelProto:
    """`model` with the tensors in `bf16` made bfloat16 at the node and float32 at the graph's
    edges (a Cast each side): onnxruntime's Python API takes no bfloat16 numpy arrays."""
    g = model.graph
    casts_in, casts_out = [], []
    for v in g.input:
        if v.name in bf16:
            casts_in.append(helper.make_node("Cast", [v.name + "_f32"], [v.name], to=TensorProto.BFLOAT16))
            v.name, v.type.tensor_type.elem_type = v.name + "_f32", TensorProto.FLOAT
    for v in g.output:
        if v.name in bf16:
            casts_out.append(helper.make_node("Cast", [v.name], [v.name + "_f32"], to=TensorProto.FLOAT))
            v.name, v.type.tensor_type.elem_type = v.name + "_f32", TensorProto.FLOAT
    nodes = casts_in + list(g.node) + casts_out
    del g.node[:]
    g.node.extend(nodes)
    return model


def bf16_feeds(inputs: dict) -> dict:
    """float32 numpy feeds (bfloat16 values exactly) of the case's tensors; the *_f32 names."""
    return {k + "_f32" if v.dtype == torch.bfloat16 else k: np.ascontiguousarray(
            (v.float() if v.dtype == torch.bfloat16 else v).numpy()) for k, v in inputs.items() if v is not None}


def test_paged_attention_bfloat16_runs_through_float32(tmp_path):
    inputs, attrs = pa_reference.make_case(num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, q_lens=[3, 1],
                                           ctx_lens=[2, 7], kv_dtype="bfloat16", act_dtype="bfloat16", seed=5)
    model = pa_one_node_model(attrs, "float32")
    bf16 = {"query", "key", "value", "key_cache", "value_cache", "output", "key_cache_out", "value_cache_out"}
    for v in list(model.graph.input) + list(model.graph.output):
        if v.name in bf16:
            v.type.tensor_type.elem_type = TensorProto.BFLOAT16
    assert bf16 <= {v.name for v in list(model.graph.input) + list(model.graph.output)}
    onnx.save(fed_as_float32(model, bf16), str(tmp_path / "m.onnx"))
    kvh = inputs["key_cache"].shape[0]
    feeds = {**bf16_feeds(inputs), **{n: np.ones(kvh, np.float32) for n in ("k_scale", "v_scale")
                                      if inputs.get(n) is None}}
    out, kc, vc = pa_ort.plugin_session(tmp_path / "m.onnx").run(None, feeds)
    ref = {k: (v.clone() if v is not None else None) for k, v in inputs.items()}
    want = pa_reference.paged_attention(*(ref[n] for n in PA_INPUTS), attrs=attrs)
    # the reference's float64 result rounded to bf16 once (its output) or via float32 (the PyOp's): 1 ulp
    assert np.abs(out - want.float().numpy()).max() <= 2 ** -7 * max(1.0, want.float().abs().max().item())
    np.testing.assert_array_equal(kc, ref["key_cache"].float().numpy())
    np.testing.assert_array_equal(vc, ref["value_cache"].float().numpy())


def test_paged_mla_bfloat16_runs_through_float32(tmp_path):
    inputs, attrs = mla_reference.make_case(num_heads=3, kv_lora_rank=16, qk_rope_head_dim=8, block_size=4,
                                            q_lens=[3, 1], ctx_lens=[2, 9], kv_dtype="bfloat16", act_dtype="bfloat16",
                                            seed=3)
    model = mla_one_node_model(attrs, "bfloat16")
    bf16 = {v.name for v in list(model.graph.input) + list(model.graph.output)
            if v.type.tensor_type.elem_type == TensorProto.BFLOAT16}
    assert bf16 == {"query", "latent", "latent_cache", "output", "latent_cache_out"}
    onnx.save(fed_as_float32(model, bf16), str(tmp_path / "m.onnx"))
    out, cache = mla_ort.plugin_session(tmp_path / "m.onnx").run(None, bf16_feeds(inputs))
    ref = {k: v.clone() for k, v in inputs.items()}
    want = mla_reference.paged_mla(**ref, attrs=attrs)
    assert np.abs(out - want.float().numpy()).max() <= 2 ** -7 * max(1.0, want.float().abs().max().item())
    np.testing.assert_array_equal(cache, ref["latent_cache"].float().numpy())
