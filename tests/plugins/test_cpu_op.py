"""The native CPU PagedAttention (plugins/paged_attention/cpu) against the float64 reference,
in real onnxruntime sessions: outputs within the fp32 tolerance, pools bit for bit."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from kvexport.plugins.paged_attention.native import in_place_binding, one_node_model
from kvexport.plugins.paged_attention.reference import make_case, paged_attention
from kvexport.plugins.paged_attention.spec import INPUTS, TOLERANCE


@pytest.fixture(scope="module")
def lib(cpu_op):
    return str(cpu_op)


def session(lib, model, threads=2):
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def feeds_of(case):
    kvh = case["key_cache"].shape[0]
    out = {k: (v.numpy() if v is not None else np.ones(kvh, np.float32)) for k, v in case.items()}
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def reference(case, attrs):
    c = {k: (v.clone() if v is not None else None) for k, v in case.items()}
    out = paged_attention(*(c[n] for n in INPUTS), attrs=attrs)
    return out.numpy(), c["key_cache"].numpy(), c["value_cache"].numpy()


CASES = {
    "decode-gqa": dict(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, q_lens=[1] * 5, ctx_lens=[0, 1, 15, 16, 77]),
    "prefill-ragged": dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, q_lens=[1, 40, 7, 17], ctx_lens=[33, 0, 9, 16]),
    "chunk-after-prefix": dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, q_lens=[35, 3], ctx_lens=[64, 64],
                               shared_prefix_blocks=4),
    "mha-odd-dim": dict(num_heads=3, num_kv_heads=3, head_dim=24, block_size=8, q_lens=[5, 1, 19], ctx_lens=[3, 30, 0]),
    # the wide heads the op specialises (Gemma, Qwen3.5: 256; Gemma 4's global layers: 512), decode and prompt rows
    "wide-256": dict(num_heads=8, num_kv_heads=2, head_dim=256, block_size=16, q_lens=[1, 20, 1], ctx_lens=[70, 0, 33]),
    "wide-512": dict(num_heads=4, num_kv_heads=1, head_dim=512, block_size=16, q_lens=[1, 9], ctx_lens=[40, 7]),
    "mqa-big-block": dict(num_heads=4, num_kv_heads=1, head_dim=80, block_size=32, q_lens=[2, 33], ctx_lens=[70, 5]),
    "sliding-window": dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, q_lens=[1, 12, 6], ctx_lens=[29, 0, 21],
                           sliding_window=7),
    "int8": dict(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, q_lens=[1, 21, 1], ctx_lens=[50, 4, 0],
                 kv_dtype="int8"),
    "int8-window": dict(num_heads=2, num_kv_heads=1, head_dim=48, block_size=8, q_lens=[9, 1], ctx_lens=[13, 40],
                        kv_dtype="int8", sliding_window=10),
    "empty-sequence": dict(num_heads=2, num_kv_heads=2, head_dim=16, block_size=16, q_lens=[0, 3, 0], ctx_lens=[5, 2, 40]),
    "int8-per-head-scales": dict(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, q_lens=[1, 21, 1],
                                 ctx_lens=[50, 4, 0], kv_dtype="int8", per_head_scales=True),  # builds before per-channel
}

# Per-layer attributes (Gemma 2/3-style layers): each case's output must differ from the same
# inputs with default attributes, so the attribute provably reaches the computation.
PER_LAYER = dict(num_heads=6, num_kv_heads=2, head_dim=32, block_size=8, q_lens=[1, 19, 1, 9], ctx_lens=[40, 0, 6, 17])
PER_LAYER_CASES = {
    "sliding_window": dict(sliding_window=7),
    "logit_softcap": dict(logit_softcap=1.5, scale=0.4),
    "scale": dict(scale=0.0625),  # e.g. query_pre_attn_scalar ** -0.5 != head_dim ** -0.5
    "all": dict(sliding_window=5, logit_softcap=2.0, scale=0.3),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(lib, name):
    case, attrs = make_case(**CASES[name], seed=hash(name) % 1000)
    want_out, want_k, want_v = reference(case, attrs)
    feeds = feeds_of(case)
    out, k, v = session(lib, one_node_model(attrs, attrs.kv_dtype)).run(None, feeds)
    assert np.abs(out - want_out).max() <= TOLERANCE["float32"]
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)
    # the inputs were not touched: outputs were separate buffers here
    np.testing.assert_array_equal(feeds["key_cache"], case["key_cache"].numpy())


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("name", sorted(PER_LAYER_CASES))
def test_per_layer_attributes_match_reference(lib, name, kv_dtype):
    case, attrs = make_case(**PER_LAYER, **PER_LAYER_CASES[name], kv_dtype=kv_dtype, seed=5)
    plain, plain_attrs = make_case(**PER_LAYER, kv_dtype=kv_dtype, seed=5)
    want_out = reference(case, attrs)[0]
    assert np.abs(want_out - reference(plain, plain_attrs)[0]).max() > 1e-2  # the attribute matters here
    out, k, v = session(lib, one_node_model(attrs, kv_dtype)).run(None, feeds_of(case))
    assert np.abs(out - want_out).max() <= TOLERANCE["float32"]
    ref_out, ref_k, ref_v = reference(case, attrs)
    np.testing.assert_array_equal(k, ref_k)
    np.testing.assert_array_equal(v, ref_v)


def test_graphs_without_logit_softcap_still_run(lib):
    """Plugin graphs exported before the attribute existed: no soft-capping."""
    case, attrs = make_case(**PER_LAYER, seed=2)
    model = one_node_model(attrs, "float32")
    node = model.graph.node[0]
    node.attribute.remove(next(a for a in node.attribute if a.name == "logit_softcap"))
    out = session(lib, model).run(None, feeds_of(case))[0]
    assert np.abs(out - reference(case, attrs)[0]).max() <= TOLERANCE["float32"]


def test_pools_update_in_place_when_bound_to_the_inputs(lib):
    """How the runtime runs it: each pool output bound to its input's buffer (IOBinding)."""
    case, attrs = make_case(**CASES["prefill-ragged"], seed=3)
    want_out, want_k, want_v = reference(case, attrs)
    feeds = feeds_of(case)
    sess = session(lib, one_node_model(attrs, "float32"))
    binding = in_place_binding(sess, feeds)
    sess.run_with_iobinding(binding)
    out = binding.copy_outputs_to_cpu()[0]
    assert np.abs(out - want_out).max() <= TOLERANCE["float32"]
    # the numpy arrays behind the bound OrtValues hold the updated pools
    np.testing.assert_array_equal(feeds["key_cache"], want_k)
    np.testing.assert_array_equal(feeds["value_cache"], want_v)


@pytest.mark.parametrize("corrupt, message", [
    (lambda f: f["block_tables"].__setitem__((0, 0), 10_000), "block id out of range"),
    (lambda f: f["slot_mapping"].__setitem__(0, 10_000_000), "slot_mapping points past the pool"),
    (lambda f: f["seq_lens"].__setitem__(1, 0), "seq_lens"),
    (lambda f: f["seq_lens"].__setitem__(1, np.iinfo(np.int64).max), "more blocks than block_tables"),
    (lambda f: f["query_start_loc"].__setitem__(2, 0), "non-decreasing"),
])
def test_bad_metadata_is_a_clear_error_and_writes_nothing(lib, corrupt, message):
    case, attrs = make_case(**CASES["decode-gqa"], seed=1)
    feeds = feeds_of(case)
    corrupt(feeds)
    before = feeds["key_cache"].copy()
    sess = session(lib, one_node_model(attrs, "float32"))
    with pytest.raises(Exception, match=message):
        sess.run(None, feeds)
    np.testing.assert_array_equal(feeds["key_cache"], before)


@pytest.mark.parametrize("attr, value, message", [
    ("kv_dtype", "float16", "runs only as a TensorRT plugin"),
    ("sliding_window", -1, "sliding_window"),
    ("scale", 0.0, "scale"),
    ("logit_softcap", -1.0, "logit_softcap"),
])
def test_bad_attributes_are_refused_when_the_session_opens(lib, attr, value, message):
    _, attrs = make_case(**CASES["decode-gqa"], seed=1)
    model = one_node_model(attrs, "float32")
    node = model.graph.node[0]
    for a in node.attribute:
        if a.name == attr:
            node.attribute.remove(a)
            break
    node.attribute.append(helper.make_attribute(attr, value))
    with pytest.raises(Exception, match=message):
        session(lib, model)


def test_library_lookup_failures_are_clear(lib, tmp_path, monkeypatch, caplog):
    """A library named by $KVEXPORT_ORT_OPS that cannot be used is an error; an unusable
    library found by default is a warning and None (the runtime falls back to the reference)."""
    from kvexport.errors import KvExportError
    from kvexport.plugins.paged_attention import native

    not_a_lib = tmp_path / "libfake.so"
    not_a_lib.write_text("not an ELF file")
    try:
        for env, message in [(str(tmp_path / "missing.so"), "no such file"), (str(not_a_lib), "not a loadable")]:
            monkeypatch.setenv(native.ENV, env)
            native.library.cache_clear()
            with pytest.raises(KvExportError, match=message):
                native.library()
        # compiled for an API newer than the installed onnxruntime's
        monkeypatch.setattr(native, "_ort_api_version", lambda: 20)
        monkeypatch.setenv(native.ENV, lib)
        native.library.cache_clear()
        with pytest.raises(KvExportError, match="upgrade onnxruntime"):
            native.library()
        monkeypatch.delenv(native.ENV)
        monkeypatch.setattr(native, "default_library", lambda: type(not_a_lib)(lib))
        native.library.cache_clear()
        assert native.library() is None
        assert "upgrade onnxruntime" in caplog.text
    finally:
        native.library.cache_clear()


def test_one_thread_and_many_agree(lib):
    case, attrs = make_case(**CASES["chunk-after-prefix"], seed=7)
    feeds = feeds_of(case)
    model = one_node_model(attrs, "float32")
    a = session(lib, model, threads=1).run(None, feeds)[0]
    b = session(lib, model, threads=2).run(None, feeds)[0]
    np.testing.assert_array_equal(a, b)
    assert torch.isfinite(torch.from_numpy(a)).all()


def test_unknown_dims_stay_unknown_for_later_shape_inference(lib):
    """The op's outputs take its inputs' shapes; a dim neither known nor named (the query's
    token count behind a Split) once came back as dim_value -1, and a Concat along it failed
    when the session was made ("Negative dimension value on Concat axis"): ort_quant's int8
    pairs concatenate an attention output's rows like this. Now such dims get names."""
    case, attrs = make_case(**CASES["prefill-ragged"], seed=4)
    model = one_node_model(attrs, "float32")
    g = model.graph
    q = g.input[0].name
    heads, dim = feeds_of(case)[q].shape[1:]
    g.input[0].CopyFrom(helper.make_tensor_value_info("q_in", TensorProto.FLOAT, ["tokens_twice", heads, dim]))
    # the query through a Split of unknown sizes: its dims reach the op unknown and unnamed
    g.node.insert(0, helper.make_node("Split", ["q_in"], [q, "q_rest"], axis=0, num_outputs=2))
    g.node.append(helper.make_node("Concat", [g.output[0].name, g.output[0].name], ["twice"], axis=0))
    g.output.append(helper.make_value_info("twice", helper.make_tensor_type_proto(TensorProto.FLOAT, None)))
    del model.opset_import[:]
    model.opset_import.extend([helper.make_opsetid("", 18), helper.make_opsetid(g.node[1].domain, 1)])
    feeds = feeds_of(case)
    want = reference(case, attrs)[0]
    feeds["q_in"] = np.concatenate([feeds.pop(q)] * 2)  # the first half is the query
    out, twice = session(lib, model).run([g.output[0].name, "twice"], feeds)
    assert np.abs(out - want).max() <= TOLERANCE["float32"]
    np.testing.assert_array_equal(twice, np.concatenate([out, out]))
