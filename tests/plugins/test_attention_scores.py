"""The PagedAttention op's optional attention_scores output (spec.py "Attention scores", importance
eviction) in the native CPU op, against the float64 reference, in real onnxruntime sessions; and the
same op without the optional input and output still runs as before (builds made before scoring)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kvexport.plugins.paged_attention.native import one_node_model
from kvexport.plugins.paged_attention import reference
from kvexport.plugins.paged_attention.reference import attention_scores, make_case, paged_attention
from kvexport.plugins.paged_attention.spec import INPUTS, SCORE_TOLERANCE, TOLERANCE

CASES = {
    "prefill-gqa": dict(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, q_lens=[40, 7, 17], ctx_lens=[0, 9, 16]),
    "decode-mixed": dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, q_lens=[1, 1, 12], ctx_lens=[30, 0, 5]),
    "int8": dict(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, q_lens=[21, 1], ctx_lens=[4, 50], kv_dtype="int8"),
    "int4-window-softcap": dict(num_heads=4, num_kv_heads=1, head_dim=32, block_size=8, q_lens=[9, 14],
                                ctx_lens=[13, 3], kv_dtype="int4", sliding_window=10, logit_softcap=2.0),
    "sinks": dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, q_lens=[6, 5], ctx_lens=[7, 0],
                  attention_sinks=(0.5, -1.0, 2.0, 0.0)),
}
OBS = {"prefill-gqa": [8, 0, 30], "decode-mixed": [1, 1, 4], "int8": [5, 1], "int4-window-softcap": [3, 14],
       "sinks": [2, 5]}


def _session(lib, model):
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    so.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _feeds(case):
    kvh = case["key_cache"].shape[0]
    out = {k: (v.numpy() if v is not None else np.ones(kvh, np.float32)) for k, v in case.items()}
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scores_match_reference(cpu_op, name):
    case, attrs = make_case(**CASES[name], seed=7)
    obs = torch.tensor(OBS[name], dtype=torch.int64)
    c = {k: (v.clone() if v is not None else None) for k, v in case.items()}
    want_out = paged_attention(*(c[n] for n in INPUTS), attrs=attrs).numpy()
    want = attention_scores(c["query"], c["key_cache"], c["block_tables"], c["seq_lens"], c["query_start_loc"], obs,
                            c["k_scale"], attrs=attrs).numpy()
    feeds = _feeds(case)
    feeds["observation_lens"] = obs.numpy()
    out, k, _v, scores = _session(cpu_op, one_node_model(attrs, attrs.kv_dtype, scores=True)).run(None, feeds)
    assert scores.shape == want.shape == (len(OBS[name]), attrs.num_kv_heads, case["block_tables"].shape[1] * attrs.block_size)
    assert np.abs(scores - want).max() <= SCORE_TOLERANCE
    assert np.abs(out - want_out).max() <= TOLERANCE["float32"]  # the attention itself is unchanged
    np.testing.assert_array_equal(k, c["key_cache"].numpy())
    # each observed query's probabilities sum to 1 per query head (no sinks): G * obs per KV head
    if not attrs.attention_sinks:
        q_lens = np.diff(case["query_start_loc"].numpy())
        np.testing.assert_allclose(scores.sum(-1), (np.minimum(OBS[name], q_lens) * attrs.group_size)[:, None]
                                   * np.ones((1, attrs.num_kv_heads)), rtol=1e-5)


def test_without_scores_unchanged(cpu_op):
    """An 11-input node (a build made before scoring) runs as before, and observation_lens all 0 give zeros."""
    case, attrs = make_case(**CASES["prefill-gqa"], seed=3)
    feeds = _feeds(case)
    old = _session(cpu_op, one_node_model(attrs, attrs.kv_dtype)).run(None, feeds)
    feeds["observation_lens"] = np.zeros(3, np.int64)
    new = _session(cpu_op, one_node_model(attrs, attrs.kv_dtype, scores=True)).run(None, feeds)
    for a, b in zip(old, new[:3]):
        np.testing.assert_array_equal(a, b)
    assert not new[3].any()


def test_negative_observation_refused(cpu_op):
    case, attrs = make_case(**CASES["decode-mixed"], seed=3)
    feeds = _feeds(case)
    feeds["observation_lens"] = np.array([1, -1, 0], np.int64)
    with pytest.raises(Exception, match="observation_lens must be >= 0"):
        _session(cpu_op, one_node_model(attrs, attrs.kv_dtype, scores=True)).run(None, feeds)


# The Triton kernels' scores pass (launch.attention_scores_triton), on CPU under TRITON_INTERPRET=1
# (tests/plugins/conftest.py), against the same float64 reference.
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_scores_match_reference(name):
    from kvexport.plugins.paged_attention import configs
    from kvexport.plugins.paged_attention.launch import attention_scores_triton, paged_attention_triton

    case, attrs = make_case(**CASES[name], seed=5)
    obs = torch.tensor(OBS[name], dtype=torch.int64)
    c = {k: (v.clone() if v is not None else None) for k, v in case.items()}
    paged_attention(*(c[n] for n in INPUTS), attrs=attrs)
    want = attention_scores(c["query"], c["key_cache"], c["block_tables"], c["seq_lens"], c["query_start_loc"], obs,
                            c["k_scale"], attrs=attrs)
    paged_attention_triton(*(case[n] for n in INPUTS), attrs=attrs, tile=configs.INTERPRET_TILE)
    nan = torch.full(want.shape, float("nan"))  # the kernel zeroes its rows itself (a TensorRT output is not)
    got = attention_scores_triton(case["query"], case["key_cache"], case["block_tables"], case["seq_lens"],
                                  case["query_start_loc"], obs, case["k_scale"], attrs=attrs,
                                  tile=configs.INTERPRET_TILE, out=nan)
    assert got is nan and got.dtype == torch.float32 and not got.isnan().any()
    assert (got.double() - want).abs().max().item() <= SCORE_TOLERANCE
    assert want.abs().max() > 0.5  # the case scores something


def test_triton_scores_half_activations_and_several_row_tiles():
    """fp16 activations and pool (the GPU's dtypes; fp16 inputs are exact in the interpreter's float32
    dot, so the float32 tolerance holds here — the GPU check bounds tensor-core dots); 13 observed
    tokens × group 3 = 39 rows span three 16-row tiles, whose sums add up in the same row of scores."""
    from kvexport.plugins.paged_attention import configs
    from kvexport.plugins.paged_attention.launch import attention_scores_triton

    case, attrs = make_case(num_heads=6, num_kv_heads=2, head_dim=32, block_size=8, q_lens=[13, 1], ctx_lens=[20, 9],
                            kv_dtype="float16", act_dtype="float16", seed=2)
    obs = torch.tensor([13, 1], dtype=torch.int64)
    for n in ("key", "value"):  # this step's keys in the pool, as after the attention
        reference.store_kv(case[n + "_cache"], case["slot_mapping"], case[n], attrs, None)
    want = attention_scores(case["query"], case["key_cache"], case["block_tables"], case["seq_lens"],
                            case["query_start_loc"], obs, attrs=attrs)
    got = attention_scores_triton(case["query"], case["key_cache"], case["block_tables"], case["seq_lens"],
                                  case["query_start_loc"], obs, attrs=attrs, tile=configs.INTERPRET_TILE)
    assert (got.double() - want).abs().max().item() <= SCORE_TOLERANCE
    np.testing.assert_allclose(got.sum(-1).numpy(), [[39, 39], [3, 3]], rtol=1e-3)
