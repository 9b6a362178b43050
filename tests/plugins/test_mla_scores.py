"""PagedMLA's optional attention_scores output (plugins/paged_mla/spec.py "Attention scores",
importance eviction over the latent pool): the float64 reference against a direct softmax, the native
CPU op in real onnxruntime sessions and the Triton kernel under TRITON_INTERPRET=1 (conftest.py)
against the reference; the op without the optional input and output runs as before."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kvexport.plugins.paged_mla import configs, native, reference
from kvexport.plugins.paged_mla.spec import INPUTS, SCORE_TOLERANCE, TOLERANCE

CASES = {  # tiny DeepSeek-like rows: L latent + R rope channels, heads not a power of two
    "prefill": dict(num_heads=3, kv_lora_rank=32, qk_rope_head_dim=16, block_size=8, q_lens=[20, 7, 1],
                    ctx_lens=[0, 9, 30]),
    "chunk-int8": dict(num_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, block_size=4, q_lens=[11, 5],
                       ctx_lens=[13, 0], kv_dtype="int8"),
    "bf16-pool": dict(num_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, block_size=8, q_lens=[9, 1],
                      ctx_lens=[6, 17], kv_dtype="bfloat16"),
}
OBS = {"prefill": [8, 0, 3], "chunk-int8": [11, 2], "bf16-pool": [4, 1]}


@pytest.fixture(scope="module")
def lib(cpu_op):
    if not native.has_mla(cpu_op):
        pytest.fail(f"{cpu_op} has no PagedMLA: rebuild it (scripts/build_cpu_ops.sh)")
    return str(cpu_op)


def _session(lib, model):
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _want(case, attrs, obs):
    """(attended latent, scores) of the reference, on copies."""
    c = {k: v.clone() for k, v in case.items()}
    out = reference.paged_mla(*(c[n] for n in INPUTS), attrs=attrs)
    return out, reference.attention_scores(c["query"], c["latent_cache"], c["block_tables"], c["seq_lens"],
                                           c["query_start_loc"], obs, c["kv_scale"], attrs=attrs)


def test_reference_is_the_softmax_mass_of_the_observed_rows():
    """A hand-built case: one sequence, 2 heads, the last 2 of 5 tokens observed: the column sums of
    the causal softmax of those rows, over both heads; each observed row and head adds 1 in total."""
    case, attrs = reference.make_case(num_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, block_size=4, q_lens=[5],
                                      ctx_lens=[0], seed=1)
    _, got = _want(case, attrs, torch.tensor([2]))
    q, lat = case["query"].double(), case["latent"].double()  # float32 pool: rows stored exactly
    want = torch.zeros(5, dtype=torch.float64)
    for t in (3, 4):
        for h in range(2):
            want[:t + 1] += torch.softmax(attrs.scale * (lat[:t + 1] @ q[t, h]), 0)
    assert got.shape == (1, 1, case["block_tables"].shape[1] * 4)
    torch.testing.assert_close(got[0, 0, :5], want, rtol=0, atol=1e-12)
    assert not got[0, 0, 5:].any() and abs(float(got.sum()) - 4.0) < 1e-12


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_op_scores_match_reference(lib, name):
    case, attrs = reference.make_case(**CASES[name], seed=3)
    obs = torch.tensor(OBS[name], dtype=torch.int64)
    want_out, want = _want(case, attrs, obs)
    feeds = {k: np.ascontiguousarray(_bits(v)) for k, v in case.items()}
    feeds["observation_lens"] = obs.numpy()
    sess = _session(lib, native.one_node_model(attrs, kv_dtype=attrs.kv_dtype, scores=True))
    b = native.in_place_binding(sess, feeds, attrs.kv_dtype)
    b.bind_output("attention_scores")
    sess.run_with_iobinding(b)
    out, scores = b.get_outputs()[0].numpy(), b.get_outputs()[2].numpy()
    assert scores.shape == tuple(want.shape) == (len(OBS[name]), 1, case["block_tables"].shape[1] * attrs.block_size)
    assert np.abs(scores - want.numpy()).max() <= SCORE_TOLERANCE
    assert np.abs(out - want_out.numpy()).max() <= TOLERANCE["float32"] * 4  # the attention is unchanged
    q_lens = np.diff(case["query_start_loc"].numpy())
    np.testing.assert_allclose(scores.sum((1, 2)), np.minimum(OBS[name], q_lens) * attrs.num_heads, rtol=1e-5)


def test_cpu_op_without_scores_unchanged_and_bad_observation_refused(lib):
    case, attrs = reference.make_case(**CASES["prefill"], seed=4)
    feeds = {k: np.ascontiguousarray(_bits(v)) for k, v in case.items()}
    old = _session(lib, native.one_node_model(attrs)).run(None, feeds)
    feeds["observation_lens"] = np.zeros(3, np.int64)
    new = _session(lib, native.one_node_model(attrs, scores=True)).run(None, feeds)
    for a, b in zip(old, new[:2]):
        np.testing.assert_array_equal(a, b)
    assert new[2].shape == (3, 1, case["block_tables"].shape[1] * attrs.block_size) and not new[2].any()
    feeds["observation_lens"] = np.array([1, -1, 0], np.int64)
    with pytest.raises(Exception, match="observation_lens must be >= 0"):
        _session(lib, native.one_node_model(attrs, scores=True)).run(None, feeds)


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_scores_match_reference(name):
    from kvexport.plugins.paged_mla.launch import attention_scores_triton, paged_mla_triton

    case, attrs = reference.make_case(**CASES[name], seed=5)
    obs = torch.tensor(OBS[name], dtype=torch.int64)
    paged_mla_triton(*(case[n] for n in INPUTS), attrs=attrs, tile=configs.INTERPRET_TILE)
    # NOTE: the reference scores the pool the kernel wrote (under the interpreter, float32 -> bfloat16
    # stores round differently from torch's; the scores pass only reads the pool)
    want = reference.attention_scores(case["query"], case["latent_cache"], case["block_tables"], case["seq_lens"],
                                      case["query_start_loc"], obs, case["kv_scale"], attrs=attrs)
    got = attention_scores_triton(case["query"], case["latent_cache"], case["block_tables"], case["seq_lens"],
                                  case["query_start_loc"], obs, case["kv_scale"], attrs=attrs,
                                  tile=configs.INTERPRET_TILE)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= SCORE_TOLERANCE
    assert want.max() > 0.5
