"""Learned attention sinks (GPT-OSS) in `kvexport::PagedAttention` (the `attention_sinks`
attribute): the float64 reference against transformers' own gpt_oss eager attention; the Triton
kernels (interpreter: prefill, decode, split-K decode) and the native CPU op (real onnxruntime
sessions) against the reference, within spec.TOLERANCE, pools bit for bit; the attribute's
validation, its absence meaning no sinks (graphs exported before it), and the reference harness
(ort.py) carrying it."""

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from kvexport.errors import ConfigError
from kvexport.plugins.paged_attention import configs, reference
from kvexport.plugins.paged_attention.launch import paged_attention_triton
from kvexport.plugins.paged_attention.native import one_node_model
from kvexport.plugins.paged_attention.spec import INPUTS, TOLERANCE, PagedAttentionAttrs

# one sink per query head: around the scores' range, one far above every score (the row's output
# is then ~0, still finite) and one far below (no effect)
SINKS6 = (0.7, -1.3, 2.5, 30.0, -30.0, 0.1)
CASES = {
    "prefill": dict(q_lens=[5, 12, 1], ctx_lens=[0, 9, 14]),
    "decode": dict(q_lens=[1, 1, 1, 1], ctx_lens=[0, 5, 23, 37]),
}


def _case(phase, **kw):
    return reference.make_case(num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, **CASES[phase],
                               attention_sinks=SINKS6, seed=13, **kw)


def _ref(inputs, attrs):
    c = {k: (v.clone() if v is not None else None) for k, v in inputs.items()}
    return reference.paged_attention(*(c[n] for n in INPUTS), attrs=attrs), c


def test_reference_is_transformers_gpt_oss_attention():
    """One prompt of 9 tokens, GQA, a window of 4: the reference's output equals transformers'
    gpt_oss eager_attention_forward (its sinks concatenated to the logits) in float64."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    for window in (0, 4):
        inputs, attrs = reference.make_case(num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, q_lens=[9],
                                            ctx_lens=[0], sliding_window=window, attention_sinks=SINKS6, seed=3)
        ours, _ = _ref(inputs, attrs)
        q = inputs["query"].double().transpose(0, 1)[None]  # [1, H, 9, D]
        k = inputs["key"].double().transpose(0, 1)[None]  # [1, kvH, 9, D]
        v = inputs["value"].double().transpose(0, 1)[None]
        i = torch.arange(9)
        visible = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
        mask = torch.zeros(9, 9, dtype=torch.float64).masked_fill(~visible, float("-inf"))[None, None]

        class Module(torch.nn.Module):
            num_key_value_groups = 3
            sinks = torch.tensor(SINKS6, dtype=torch.float64)

        theirs, _ = eager_attention_forward(Module().eval(), q, k, v, mask, scaling=attrs.scale)  # [1, 9, H, D]
        assert (ours.double() - theirs[0]).abs().max().item() < 1e-6


def test_attrs_validate_round_and_omit_empty_sinks():
    base = dict(num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, scale=0.25)
    attrs = PagedAttentionAttrs(**base, attention_sinks=[0.1] * 6)
    assert attrs.attention_sinks == (float(np.float32(0.1)),) * 6  # float32 values, as the attribute holds
    onnx_attrs = attrs.onnx_attributes()
    assert onnx_attrs["attention_sinks"] == list(attrs.attention_sinks)
    assert PagedAttentionAttrs.from_onnx_attributes(onnx_attrs) == attrs
    assert "attention_sinks" not in PagedAttentionAttrs(**base).onnx_attributes()  # graphs as before sinks
    with pytest.raises(ConfigError, match="attention_sinks must list one value per query head"):
        PagedAttentionAttrs(**base, attention_sinks=[0.1] * 2)
    with pytest.raises(ConfigError, match="attention_sinks must be finite"):
        PagedAttentionAttrs(**base, attention_sinks=[float("nan")] * 6)


# (phase, decode splits, activations, pool, window): every kernel (prefill; decode unsplit, where the
# decode kernel adds the sinks; split-K, where the reduce kernel does) and every pool kind
TRITON_CASES = [("prefill", None, "float32", "float32", 0), ("decode", 3, "float32", "float32", 0),
                ("prefill", None, "float16", "float16", 5), ("decode", 3, "float16", "float16", 5),
                ("decode", 1, "float32", "int8", 5), ("prefill", None, "float32", "int4", 0)]


@pytest.mark.parametrize("phase,num_splits,act,kv,window", TRITON_CASES)
def test_triton_kernels_match_the_reference(phase, num_splits, act, kv, window):
    kw = dict(act_dtype=act, kv_dtype=kv, sliding_window=window)
    if kv == "int4":  # int4 rows need head_dim a multiple of 32
        inputs, attrs = reference.make_case(num_heads=6, num_kv_heads=2, head_dim=32, block_size=4, **CASES[phase],
                                            attention_sinks=SINKS6, seed=13, **kw)
    else:
        inputs, attrs = _case(phase, **kw)
    want, ref_in = _ref(inputs, attrs)
    out = paged_attention_triton(**inputs, attrs=attrs, tile=configs.INTERPRET_TILE, num_splits=num_splits)
    assert (out.double() - want.double()).abs().max().item() <= TOLERANCE[act]
    assert torch.equal(inputs["key_cache"], ref_in["key_cache"]) and torch.equal(inputs["value_cache"],
                                                                                  ref_in["value_cache"])
    # the sinks reach the kernels: without them the reference differs
    assert (want.double() - _ref(inputs, replace(attrs, attention_sinks=()))[0].double()).abs().max().item() > 0.1
    assert want[:, 3].abs().max().item() < 1e-6  # head 3's sink (30) takes nearly all the weight


def _session(lib, model):
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    so.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _feeds(inputs):
    kvh = inputs["key_cache"].shape[0]
    return {k: np.ascontiguousarray(v.numpy() if v is not None else np.ones(kvh, np.float32))
            for k, v in inputs.items()}


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("kv,window", [("float32", 0), ("float32", 5), ("int8", 0), ("int4", 5)])
def test_cpu_op_matches_the_reference(cpu_op, phase, kv, window):
    """Both of the op's paths: few rows (decode: one dot product per key) and many (prompt tiles)."""
    if kv == "int4":
        inputs, attrs = reference.make_case(num_heads=6, num_kv_heads=2, head_dim=32, block_size=4, **CASES[phase],
                                            attention_sinks=SINKS6, kv_dtype=kv, sliding_window=window, seed=13)
    else:
        inputs, attrs = _case(phase, kv_dtype=kv, sliding_window=window)
    want, ref_in = _ref(inputs, attrs)
    out, k, v = _session(cpu_op, one_node_model(attrs, kv)).run(None, _feeds(inputs))
    assert np.abs(out - want.numpy()).max() <= TOLERANCE["float32"]
    np.testing.assert_array_equal(k, ref_in["key_cache"].numpy())
    np.testing.assert_array_equal(v, ref_in["value_cache"].numpy())


def test_cpu_op_without_the_attribute_has_no_sinks_and_refuses_a_wrong_length(cpu_op):
    inputs, attrs = _case("prefill")
    model = one_node_model(attrs, "float32")
    node = model.graph.node[0]
    node.attribute.remove(next(a for a in node.attribute if a.name == "attention_sinks"))
    plain = replace(attrs, attention_sinks=())
    out = _session(cpu_op, model).run(None, _feeds(inputs))[0]
    assert np.abs(out - _ref(inputs, plain)[0].numpy()).max() <= TOLERANCE["float32"]
    node.attribute.append(onnx.helper.make_attribute("attention_sinks", [0.5, 0.5]))
    with pytest.raises(Exception, match="attention_sinks must list one value per query head"):
        _session(cpu_op, model)


def test_reference_harness_carries_the_sinks(tmp_path):
    """ort.py (fp16 plugin graphs on CPU, validation): the node's float list reaches the reference."""
    pytest.importorskip("onnxruntime_extensions")
    from kvexport.plugins.paged_attention.ort import plugin_session

    inputs, attrs = _case("prefill")
    onnx.save(one_node_model(attrs, "float32"), tmp_path / "one.onnx")
    out = plugin_session(tmp_path / "one.onnx").run(None, _feeds(inputs))[0]
    assert np.abs(out - _ref(inputs, attrs)[0].numpy()).max() <= TOLERANCE["float32"]


def test_reference_harness_passes_float_attributes_exactly(tmp_path):
    """onnxruntime-extensions prints a PyOp's float attributes to 6 digits: the harness adds their
    exact text, so the node's scale and soft-cap reach the reference bit for bit (same output)."""
    pytest.importorskip("onnxruntime_extensions")
    from kvexport.plugins.paged_attention.ort import plugin_session

    inputs, attrs = _case("prefill")
    attrs = replace(attrs, scale=float(np.float32(80 ** -0.5)), logit_softcap=float(np.float32(7.1234567)))
    onnx.save(one_node_model(attrs, "float32"), tmp_path / "one.onnx")
    out = plugin_session(tmp_path / "one.onnx").run(None, _feeds(inputs))[0]
    np.testing.assert_array_equal(out, _ref(inputs, attrs)[0].numpy())
