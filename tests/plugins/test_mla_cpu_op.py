"""The native CPU PagedMLA (plugins/paged_mla/cpu, compiled into the kvexport op library) against
the float64 reference in real onnxruntime sessions: outputs within the fp32 tolerance, pools bit
for bit (float32, float16, bfloat16 and int8 pools), prefill / decode / context-split decode / head
chunks, in place and copied pools, output shapes inferred in a graph, and bad metadata refused
before anything is written."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from kvexport.plugins.paged_mla import native, reference
from kvexport.plugins.paged_mla.spec import TOLERANCE


@pytest.fixture(scope="module")
def lib(cpu_op):
    if not native.has_mla(cpu_op):
        pytest.fail(f"{cpu_op} has no PagedMLA: rebuild it (scripts/build_cpu_ops.sh)")
    return str(cpu_op)


def session(lib, model, threads=2):
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def bits(t: torch.Tensor) -> np.ndarray:
    """numpy view of a tensor (bfloat16: its uint16 bits, as onnxruntime holds them)."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def run_case(lib, case, kv_dtype="float32", threads=2, seed=0, realistic=False):
    inputs, attrs = reference.make_case(**case, kv_dtype=kv_dtype, seed=seed, realistic=realistic)
    ref = {k: v.clone() for k, v in inputs.items()}
    want = reference.paged_mla(**ref, attrs=attrs).numpy()
    sess = session(lib, native.one_node_model(attrs), threads)
    feeds = {k: np.ascontiguousarray(bits(v)) for k, v in inputs.items()}
    b = native.in_place_binding(sess, feeds, kv_dtype)
    sess.run_with_iobinding(b)
    out = b.get_outputs()[0].numpy()
    assert out.shape == want.shape == (inputs["query"].shape[0], attrs.num_heads, attrs.kv_lora_rank)
    err = np.abs(out.astype(np.float64) - want).max() if out.size else 0.0
    assert err <= TOLERANCE["float32"] * max(1.0, np.abs(want).max() if want.size else 1.0), err
    assert np.array_equal(feeds["latent_cache"], bits(ref["latent_cache"]))  # updated in place, bit for bit
    return inputs, attrs


CASES = {
    "prefill-ragged": dict(num_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, block_size=4, q_lens=[3, 1, 0, 21],
                           ctx_lens=[2, 7, 3, 0]),
    "decode-split": dict(num_heads=16, kv_lora_rank=64, qk_rope_head_dim=16, block_size=16, q_lens=[1, 1, 1],
                         ctx_lens=[0, 15, 700]),  # the long one is split along its context
    "head-chunks": dict(num_heads=40, kv_lora_rank=48, qk_rope_head_dim=0, block_size=8, q_lens=[1, 2],
                        ctx_lens=[600, 9]),  # 32 + 8 heads, no RoPE part
    "odd-sizes": dict(num_heads=3, kv_lora_rank=20, qk_rope_head_dim=5, block_size=3, q_lens=[17, 1],
                      ctx_lens=[5, 40], shared_prefix_blocks=1),
}


@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "float16", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(lib, name, kv_dtype):
    run_case(lib, CASES[name], kv_dtype, seed=len(name))


def test_deepseek_width_realistic_rows_int8_one_thread(lib):
    """DeepSeek's row (512 + 64) with realistic channel profiles, int8 codes; one thread."""
    case = dict(num_heads=8, kv_lora_rank=512, qk_rope_head_dim=64, block_size=16, q_lens=[1, 5], ctx_lens=[300, 40])
    run_case(lib, case, "int8", threads=1, realistic=True)


def test_pool_not_bound_in_place_is_copied(lib):
    inputs, attrs = reference.make_case(**CASES["prefill-ragged"], kv_dtype="int8", seed=9)
    ref = {k: v.clone() for k, v in inputs.items()}
    want = reference.paged_mla(**ref, attrs=attrs).numpy()
    before = inputs["latent_cache"].numpy().copy()
    out, pool = session(lib, native.one_node_model(attrs)).run(None, {k: v.numpy() for k, v in inputs.items()})
    assert np.abs(out - want).max() <= TOLERANCE["float32"] * max(1.0, np.abs(want).max())
    assert np.array_equal(pool, ref["latent_cache"].numpy()) and np.array_equal(inputs["latent_cache"].numpy(), before)


def test_output_shape_is_inferred_in_a_graph(lib):
    """The op's output [T, H, kv_lora_rank] (not the query's [T, H, W]) reaches the next node."""
    attrs = reference.make_case(**CASES["prefill-ragged"])[1]
    m = native.one_node_model(attrs)
    g = m.graph
    g.node.append(helper.make_node("Reshape", ["output", "flat_shape"], ["flat"]))
    g.initializer.append(helper.make_tensor("flat_shape", TensorProto.INT64, [2], [0, -1]))
    del g.output[0]
    g.output.insert(0, helper.make_tensor_value_info("flat", TensorProto.FLOAT, None))
    inputs, _ = reference.make_case(**CASES["prefill-ragged"])
    flat, _ = session(lib, m).run(None, {k: v.numpy() for k, v in inputs.items()})
    assert flat.shape == (25, attrs.num_heads * attrs.kv_lora_rank)


def _expect_error(lib, inputs, attrs, match):
    before = inputs["latent_cache"].numpy().copy()
    feeds = {k: np.ascontiguousarray(v.numpy()) for k, v in inputs.items()}
    sess = session(lib, native.one_node_model(attrs))
    b = native.in_place_binding(sess, feeds, attrs.kv_dtype)
    with pytest.raises(Exception, match=match):
        sess.run_with_iobinding(b)
    assert np.array_equal(feeds["latent_cache"], before)  # refused before anything was written


@pytest.mark.parametrize("bad,match", [
    ("block", "block id out of range"), ("slot", "slot_mapping points past the pool"),
    ("seq_lens", "seq_lens"), ("scale", "kv_scale must be finite and > 0"), ("qsl", "query_start_loc"),
])
def test_bad_metadata_is_refused_before_writing(lib, bad, match):
    inputs, attrs = reference.make_case(**CASES["prefill-ragged"], kv_dtype="int8", seed=1)
    if bad == "block":
        inputs["block_tables"][3, 0] = inputs["latent_cache"].shape[1]
    elif bad == "slot":
        inputs["slot_mapping"][-1] = inputs["latent_cache"].shape[1] * attrs.block_size
    elif bad == "seq_lens":
        inputs["seq_lens"][3] = 2  # fewer than its 21 new tokens
    elif bad == "scale":
        inputs["kv_scale"][5] = 0.0
    else:
        inputs["query_start_loc"][2] = 1  # decreasing
    _expect_error(lib, inputs, attrs, match)


def test_bad_attributes_and_dtypes_are_refused(lib):
    inputs, attrs = reference.make_case(**CASES["prefill-ragged"])
    wrong_pool = native.one_node_model(attrs, kv_dtype="float16")  # kv_dtype float32, pool float16
    with pytest.raises(Exception, match="element type does not match kv_dtype"):
        session(lib, wrong_pool).run(None, {**{k: v.numpy() for k, v in inputs.items()},
                                             "latent_cache": inputs["latent_cache"].numpy().astype(np.float16)})
    m = native.one_node_model(attrs)
    for a in m.graph.node[0].attribute:
        if a.name == "kv_dtype":
            a.s = b"int4"
    with pytest.raises(Exception, match="kv_dtype int4 is not one of"):
        session(lib, m)
