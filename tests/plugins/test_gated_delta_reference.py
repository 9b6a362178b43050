"""The float64 reference of kvexport::GatedDeltaRule (plugins/gated_delta/reference.py) against
transformers' own gated delta rule (qwen3_next's torch_chunk_gated_delta_rule for prefill and
torch_recurrent_gated_delta_rule for decode, float32), the state read from the pool by slot (and
zero for fresh sequences), and the attribute checks."""

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                torch_recurrent_gated_delta_rule)

from kvexport.errors import ConfigError
from kvexport.plugins.gated_delta.reference import gated_delta, make_case
from kvexport.plugins.gated_delta.spec import TOLERANCE, GatedDeltaAttrs


def _hf(fn, inputs, attrs, s, **kw):
    """transformers' rule on sequence s alone ([1, q_len, ...]), from its slot unless it is fresh."""
    a, b = int(inputs["query_start_loc"][s]), int(inputs["query_start_loc"][s + 1])
    fresh = int(inputs["seq_lens"][s]) == b - a
    init = None if fresh else inputs["recurrent_state"][int(inputs["state_slots"][s])][None]
    one = lambda n: inputs[n][a:b][None]  # noqa: E731
    out, state = fn(one("query"), one("key"), one("value"), one("g"), one("beta"), initial_state=init,
                    output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    return out[0], state[0]


@pytest.mark.parametrize("hk,hv", [(2, 4), (3, 3)])
def test_reference_equals_transformers_chunked_and_recurrent(hk, hv):
    """A fresh 150-token prompt (three chunks of 64, the last partial), a 37-token chunk resuming from
    its slot, and two decodes: outputs and new states equal transformers' within float32's error."""
    inputs, attrs = make_case(num_k_heads=hk, num_v_heads=hv, k_head_dim=16, v_head_dim=12,
                              q_lens=[150, 37, 1, 1], ctx_lens=[0, 20, 300, 5], seed=hk)
    pool = inputs["recurrent_state"].clone()
    out, new = gated_delta(**inputs, attrs=attrs)
    assert torch.equal(pool, inputs["recurrent_state"])  # the pool is only read
    assert out.shape == (189, hv, 12) and new.shape == (4, hv, 16, 12) and new.dtype == torch.float32
    worst = 0.0
    for s, fn in enumerate([torch_chunk_gated_delta_rule] * 2 + [torch_recurrent_gated_delta_rule] * 2):
        a, b = int(inputs["query_start_loc"][s]), int(inputs["query_start_loc"][s + 1])
        o, st = _hf(fn, inputs, attrs, s)
        worst = max(worst, (o - out[a:b]).abs().max().item(), (st - new[s]).abs().max().item())
    assert worst < TOLERANCE["float32"], worst
    assert new.abs().max() > 0.5 and out.abs().max() > 0.1  # the comparison saw real magnitudes


def test_fresh_sequences_ignore_their_slot_and_resumed_ones_read_it():
    inputs, attrs = make_case(num_k_heads=1, num_v_heads=2, k_head_dim=4, v_head_dim=4, q_lens=[3, 3],
                              ctx_lens=[0, 4], seed=1)
    out, new = gated_delta(**inputs, attrs=attrs)
    changed = dict(inputs, recurrent_state=inputs["recurrent_state"] * 3)
    out2, new2 = gated_delta(**changed, attrs=attrs)
    assert torch.equal(out2[:3], out[:3]) and torch.equal(new2[0], new[0])  # fresh: slot ignored
    assert not torch.allclose(out2[3:], out[3:]) and not torch.allclose(new2[1], new[1])


def test_two_chunks_equal_one_prefill():
    """Chunked prefill: 40 tokens then 25 from the first chunk's new state equal 65 at once."""
    inputs, attrs = make_case(num_k_heads=2, num_v_heads=2, k_head_dim=8, v_head_dim=8, q_lens=[65],
                              ctx_lens=[0], seed=3)
    out, new = gated_delta(**inputs, attrs=attrs)
    first = {**inputs, **{n: inputs[n][:40] for n in ("query", "key", "value", "g", "beta")},
             "seq_lens": torch.tensor([40]), "query_start_loc": torch.tensor([0, 40])}
    o1, s1 = gated_delta(**first, attrs=attrs)
    pool = inputs["recurrent_state"].clone()
    pool[int(inputs["state_slots"][0])] = s1[0]
    second = {**inputs, **{n: inputs[n][40:] for n in ("query", "key", "value", "g", "beta")},
              "recurrent_state": pool, "seq_lens": torch.tensor([65]), "query_start_loc": torch.tensor([0, 25])}
    o2, s2 = gated_delta(**second, attrs=attrs)
    assert (torch.cat([o1, o2]) - out).abs().max() < 1e-5 and (s2 - new).abs().max() < 1e-5


@pytest.mark.parametrize("kw,field", [(dict(num_v_heads=3), "num_v_heads \\(3\\) must be a multiple"),
                                      (dict(k_head_dim=0), "k_head_dim must be an integer >= 1"),
                                      (dict(scale=0.0), "scale must be > 0"),
                                      (dict(use_qk_l2norm=2), "use_qk_l2norm must be 0 or 1")])
def test_attribute_errors(kw, field):
    base = dict(num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=8, scale=0.35, use_qk_l2norm=1)
    with pytest.raises(ConfigError, match=field):
        GatedDeltaAttrs(**{**base, **kw})
