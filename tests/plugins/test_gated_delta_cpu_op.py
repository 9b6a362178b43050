"""The native CPU kvexport::GatedDeltaRule (plugins/gated_delta/cpu/gated_delta_ort.cc, in the
library scripts/build_cpu_ops.sh builds) against the float64 reference: ragged prefill from fresh
and resumed states, decodes, grouped heads, Qwen3.5-0.8B's head shape on several threads; the pool
left untouched; inferred output shapes; bad metadata and attributes refused by name."""

import numpy as np
import pytest
import torch

from kvexport.plugins.gated_delta import native
from kvexport.plugins.gated_delta.reference import gated_delta, make_case
from kvexport.plugins.gated_delta.spec import INPUTS, TOLERANCE

pytestmark = pytest.mark.skipif(native.library_or_why()[0] is None,
                                reason="the native op library has no GatedDeltaRule (scripts/build_cpu_ops.sh)")


def _run(inputs, attrs, threads=1):
    sess = native.session(attrs, threads)
    feeds = {n: inputs[n].numpy() for n in INPUTS}
    pool = feeds["recurrent_state"].copy()
    out, new = sess.run(None, feeds)
    assert np.array_equal(pool, feeds["recurrent_state"])  # the pool is only read
    return out, new


@pytest.mark.parametrize("case", [
    dict(num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=12, q_lens=[70, 9, 1, 1, 3],
         ctx_lens=[0, 20, 0, 500, 7]),
    dict(num_k_heads=3, num_v_heads=3, k_head_dim=5, v_head_dim=7, q_lens=[1, 1, 1], ctx_lens=[4, 0, 9]),
    dict(num_k_heads=16, num_v_heads=16, k_head_dim=128, v_head_dim=128, q_lens=[40, 1, 1], ctx_lens=[0, 100, 3]),
])
@pytest.mark.parametrize("threads", [1, 3])
def test_matches_reference(case, threads):
    inputs, attrs = make_case(**case, seed=len(case["q_lens"]))
    ref_out, ref_new = gated_delta(**inputs, attrs=attrs)
    out, new = _run(inputs, attrs, threads)
    err = max(np.abs(out - ref_out.numpy()).max(), np.abs(new - ref_new.numpy()).max())
    assert err < TOLERANCE["float32"], err
    assert np.abs(new).max() > 0.3  # real magnitudes compared


def test_inferred_output_shapes():
    _, attrs = make_case(num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=12, q_lens=[1], ctx_lens=[0])
    sess = native.session(attrs)
    shapes = [o.shape for o in sess.get_outputs()]
    assert shapes == [["num_tokens", 4, 12], ["num_seqs", 4, 8, 12]]


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(state_slots=torch.tensor([99, 0])), "state_slots names a slot outside"),
    (lambda d: d.update(seq_lens=torch.tensor([1, 2])), "seq_lens\\[s\\] is smaller"),
    (lambda d: d.update(query_start_loc=torch.tensor([0, 2, 3])),
     "query_start_loc must start at 0 and end at num_tokens"),
    (lambda d: d.update(key=d["key"][:-1]), "query and key must be"),
    (lambda d: d.update(g=d["g"][:-1]), "g and beta must be"),
])
def test_bad_metadata_is_refused(change, message):
    inputs, attrs = make_case(num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=12, q_lens=[2, 2],
                              ctx_lens=[3, 3])
    change(inputs)
    sess = native.session(attrs)
    with pytest.raises(Exception, match=f"kvexport::GatedDeltaRule: {message}"):
        sess.run(None, {n: inputs[n].numpy() for n in INPUTS})


def test_bad_attribute_is_refused():
    import onnxruntime as ort

    _, attrs = make_case(num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=12, q_lens=[1], ctx_lens=[0])
    model = native.one_node_model(attrs)
    for a in model.graph.node[0].attribute:
        if a.name == "num_k_heads":
            a.i = 3
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(native.library_or_why()[0]))
    with pytest.raises(Exception, match="num_v_heads must be a multiple of num_k_heads"):
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
