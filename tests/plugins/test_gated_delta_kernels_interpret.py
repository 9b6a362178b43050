"""The GatedDeltaRule Triton kernel (kvexport.plugins.gated_delta.kernels) vs the float64 reference
(kvexport.plugins.gated_delta.reference), on CPU under TRITON_INTERPRET=1 (conftest.py imports it in
interpreter mode): outputs and new states within spec.TOLERANCE — fp32 / fp16 / bf16 activations,
fresh and resumed sequences, decodes, grouped heads, odd head dims (masked tiles), value channels
split over several programs, a step with no tokens for one sequence."""

import pytest
import torch

from kvexport.plugins.gated_delta import configs, reference
from kvexport.plugins.gated_delta.launch import gated_delta_triton
from kvexport.plugins.gated_delta.spec import TOLERANCE


def _run(act_dtype="float32", tile=configs.INTERPRET_TILE, **case):
    inputs, attrs = reference.make_case(act_dtype=act_dtype, **case)
    pool = inputs["recurrent_state"].clone()
    out, new = gated_delta_triton(**inputs, attrs=attrs, tile=tile)
    ref_out, ref_new = reference.gated_delta(**inputs, attrs=attrs)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape and new.shape == ref_new.shape
    assert torch.equal(pool, inputs["recurrent_state"])  # the pool is only read
    err = max((out.double() - ref_out.double()).abs().max().item(), (new - ref_new).abs().max().item())
    assert err <= TOLERANCE[act_dtype] * max(1.0, ref_new.abs().max().item()), err
    return new


@pytest.mark.parametrize("act", ["float32", "float16", "bfloat16"])
def test_prefill_resume_and_decode(act):
    new = _run(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=16, q_lens=[9, 4, 1, 1],
               ctx_lens=[0, 6, 30, 0], act_dtype=act, seed=1)
    assert new.abs().max() > 0.3


def test_odd_dims_value_tiles_and_an_empty_sequence():
    """Dk 12 / Dv 20 (masked power-of-two tiles), Dv split over two programs (BLOCK_V 16), a sequence
    with no new tokens this step (its new state is its old one)."""
    _run(num_k_heads=1, num_v_heads=3, k_head_dim=12, v_head_dim=20, q_lens=[5, 0, 2], ctx_lens=[0, 4, 3], seed=2)
    _run(num_k_heads=2, num_v_heads=2, k_head_dim=8, v_head_dim=40, q_lens=[3], ctx_lens=[5], seed=3,
         tile=configs.TileConfig(32, 1))
