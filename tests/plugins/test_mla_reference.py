"""The PagedMLA spec and float64 reference (plugins/paged_mla): absorbed attention over latent rows
equals DeepSeek's per-head attention with expanded keys and values; the store (float, int8
QuantizeLinear rounding) and causal paging; attribute errors; and the onnxruntime-extensions PyOp
harness (ort.py) running a one-node graph exactly as the reference does, PagedAttention nodes in the
same graph included."""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from kvexport.errors import ConfigError
from kvexport.plugins.paged_attention import reference as pa_reference
from kvexport.plugins.paged_attention.native import one_node_model as pa_one_node_model
from kvexport.plugins.paged_mla import ort as mla_ort
from kvexport.plugins.paged_mla import reference, spec
from kvexport.plugins.paged_mla.native import one_node_model


def test_absorbed_attention_equals_expanded_per_head_attention():
    """q_h·[W_UK_h c | k_rope] over expanded keys, then W_UV_h: the same as the op's output times W_UV."""
    g = torch.Generator().manual_seed(0)
    h, nope, rope, lora, v_dim, bs = 3, 8, 4, 12, 6, 4
    inputs, attrs = reference.make_case(num_heads=h, kv_lora_rank=lora, qk_rope_head_dim=rope, block_size=bs,
                                        q_lens=[5, 1], ctx_lens=[3, 9], scale=0.3, seed=1)
    w_uk = torch.randn(h, nope, lora, generator=g, dtype=torch.float64)
    w_uv = torch.randn(h, v_dim, lora, generator=g, dtype=torch.float64)
    q_nope = torch.randn(inputs["query"].shape[0], h, nope, generator=g, dtype=torch.float64)
    q_rope = inputs["query"][..., lora:].double()
    inputs["query"] = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), q_rope], -1).float()
    out = reference.paged_mla(**inputs, attrs=attrs).double()  # [T, H, L]; the pool now holds this step's rows
    got = torch.einsum("thl,hvl->thv", out, w_uv)
    qsl, lens = inputs["query_start_loc"], inputs["seq_lens"]
    for s in range(2):
        start, end = int(qsl[s]), int(qsl[s + 1])
        n, table = int(lens[s]), inputs["block_tables"][s]
        pos = torch.arange(n)
        rows = inputs["latent_cache"][0, table[pos // bs], pos % bs].double()  # [n, W]
        c, k_rope = rows[:, :lora], rows[:, lora:]
        for t in range(start, end):
            p = n - (end - t)  # the token's position: it sees rows 0..p
            for hh in range(h):
                k = torch.cat([c[:p + 1] @ w_uk[hh].T, k_rope[:p + 1]], -1)  # [p+1, nope + rope] per-head keys
                v = c[:p + 1] @ w_uv[hh].T  # [p+1, v_dim] per-head values
                scores = attrs.scale * (torch.cat([q_nope[t, hh], q_rope[t, hh]]) @ k.T)
                want = torch.softmax(scores, 0) @ v
                assert torch.allclose(got[t, hh], want, atol=1e-4, rtol=1e-4), (t, hh)


def test_store_then_attend_reads_this_steps_rows_as_stored():
    inputs, attrs = reference.make_case(num_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, block_size=4,
                                        q_lens=[6], ctx_lens=[0], kv_dtype="int8", seed=2)
    ref = {k: v.clone() for k, v in inputs.items()}
    reference.paged_mla(**ref, attrs=attrs)
    slots = inputs["slot_mapping"]
    stored = ref["latent_cache"][0].reshape(-1, attrs.row_width)[slots]
    # QuantizeLinear: round half to even of the float32 quotient, saturated
    want = torch.round(inputs["latent"].float() / inputs["kv_scale"]).clamp(-128, 127).to(torch.int8)
    assert torch.equal(stored, want)
    # the first token attends to itself only: output = its own dequantized latent
    out = reference.paged_mla(**{**inputs, "latent_cache": inputs["latent_cache"].clone()}, attrs=attrs)
    own = stored[0, :attrs.kv_lora_rank].double() * inputs["kv_scale"][:attrs.kv_lora_rank].double()
    assert torch.allclose(out[0].double(), own.expand(2, -1).float().double(), atol=1e-6)


def test_attrs_errors_name_the_field():
    for bad, field in [(dict(num_heads=0), "num_heads"), (dict(kv_lora_rank=0), "kv_lora_rank"),
                       (dict(qk_rope_head_dim=-1), "qk_rope_head_dim"), (dict(kv_dtype="int4"), "kv_dtype"),
                       (dict(scale=0.0), "scale")]:
        kw = dict(num_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, block_size=4, scale=0.5)
        kw.update(bad)
        with pytest.raises(ConfigError, match=field):
            spec.PagedMLAAttrs(**kw)
    a = spec.PagedMLAAttrs(4, 512, 64, 16, 0.1, "int8")
    assert a.row_width == 576 and a.pool_shape(10) == (1, 10, 16, 576)
    assert spec.PagedMLAAttrs.from_onnx_attributes({**a.onnx_attributes(), "kv_dtype": b"int8"}) == a
    assert spec.kv_bytes_per_token(61, 512, 64, 2) == 61 * 576 * 2  # DeepSeek-V3 in bf16: 70,272 bytes


def _feeds(inputs):
    return {k: np.ascontiguousarray(v.numpy()) for k, v in inputs.items()}


@pytest.mark.parametrize("kv", ["float32", "int8", "float16"])
def test_pyop_harness_runs_the_reference(tmp_path, kv):
    act = "float16" if kv == "float16" else "float32"
    inputs, attrs = reference.make_case(num_heads=3, kv_lora_rank=16, qk_rope_head_dim=8, block_size=4,
                                        q_lens=[3, 1, 0], ctx_lens=[2, 9, 4], kv_dtype=kv, act_dtype=act, seed=3)
    onnx.save(one_node_model(attrs, act), str(tmp_path / "m.onnx"))
    sess = mla_ort.plugin_session(tmp_path / "m.onnx")
    out, cache = sess.run(None, _feeds(inputs))
    ref = {k: v.clone() for k, v in inputs.items()}
    want = reference.paged_mla(**ref, attrs=attrs)
    assert out.shape == (4, 3, 16) and out.dtype == want.numpy().dtype
    # the same float64 computation (float32: identical); fp16: the PyOp
    # rounds to float32 and the graph casts to fp16 (double rounding, < 1 fp16 ulp)
    assert np.abs(out.astype(np.float64) - want.double().numpy()).max() <= (1e-3 if act == "float16" else 0.0)
    assert np.array_equal(cache, ref["latent_cache"].numpy())


def test_plugin_session_rewrites_mla_and_paged_attention_nodes_together(tmp_path):
    """One graph holding both ops: plugin_session's rewrite points each at its reference PyOp
    (the PagedAttention rewrite is paged_attention.ort's, tested with that op)."""
    _, pa_attrs = pa_reference.make_case(num_heads=2, num_kv_heads=1, head_dim=8, block_size=4, q_lens=[2],
                                         ctx_lens=[3], seed=4)
    attrs = spec.PagedMLAAttrs(2, 8, 4, 4, 0.3)
    g1 = one_node_model(attrs).graph
    g2 = pa_one_node_model(pa_attrs, "float32").graph
    for v in list(g2.input) + list(g2.output):  # the PagedAttention graph's names would clash with ours
        v.name = "pa_" + v.name
    node = g2.node[0]
    node.input[:] = ["pa_" + n for n in node.input]
    node.output[:] = ["pa_" + n for n in node.output]
    graph = helper.make_graph([g1.node[0], node], "both", list(g1.input) + list(g2.input),
                              list(g1.output) + list(g2.output))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("kvexport", 1)])
    rewritten = mla_ort.rewrite_for_reference(mla_ort.rewrite_paged_attention(model))
    ops = {n.op_type: n for n in rewritten.graph.node}
    assert set(ops) == {"KvexportPagedMLA_float32_float32", "KvexportPagedAttention_float32_float32_11"}
    assert {n.domain for n in ops.values()} == {"ai.onnx.contrib"}
    assert [o.domain for o in rewritten.opset_import].count("ai.onnx.contrib") == 1
    exact = {a.name: a for a in ops["KvexportPagedMLA_float32_float32"].attribute}["scale_exact"]
    assert float(exact.s.decode()) == float(np.float32(0.3))  # the node's float32 scale, every digit
    assert TensorProto.FLOAT == g1.input[0].type.tensor_type.elem_type
