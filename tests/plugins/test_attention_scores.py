"""The PagedAttention op's optional attention_scores output (spec.py "Attention scores", importance
eviction) in the native CPU op, against the float64 reference, in real onnxruntime sessions; and the
same op without the optional input and output still runs as before (builds made before scoring)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kvexport.plugins.paged_attention.native import one_node_model
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
