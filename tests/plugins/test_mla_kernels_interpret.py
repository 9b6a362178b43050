"""The PagedMLA Triton kernels (kvexport.plugins.paged_mla.kernels) vs the float64 reference, on CPU
under TRITON_INTERPRET=1 (conftest.py imports them in interpreter mode): outputs within
spec.TOLERANCE (scaled by the output's magnitude), pools bit-identical after the fused store —
fp32 / fp16 / bf16 activations, float / int8 pools, the AOT kernel and split-K + reduce, head
chunks (more heads than a program's rows), no RoPE part, ragged tables with shared prefixes,
slot -1 padding; and the launcher's split heuristic."""

import pytest
import torch

from kvexport.plugins.paged_mla import configs, reference
from kvexport.plugins.paged_mla.launch import paged_mla_triton, plan
from kvexport.plugins.paged_mla.spec import TOLERANCE

TILE = configs.INTERPRET_TILE


def _run(*, num_splits=None, act_dtype="float32", compare_tokens=None, pad_last=False, **case):
    inputs, attrs = reference.make_case(act_dtype=act_dtype, **case)
    if pad_last:  # a padding token: not stored, its output not read
        inputs["slot_mapping"][-1] = -1
    ref_inputs = {k: v.clone() for k, v in inputs.items()}
    out = paged_mla_triton(**inputs, attrs=attrs, tile=TILE, num_splits=num_splits)
    ref = reference.paged_mla(**ref_inputs, attrs=attrs)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rows = slice(None) if compare_tokens is None else compare_tokens
    err = (out[rows].double() - ref[rows].double()).abs().max().item()
    assert err <= TOLERANCE[act_dtype] * max(1.0, ref.double().abs().max().item()), err
    assert torch.equal(inputs["latent_cache"], ref_inputs["latent_cache"])  # the store: bit for bit


BASE = dict(num_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, block_size=4)


@pytest.mark.parametrize("act,kv", [("float32", "float32"), ("float32", "int8"), ("float16", "float16"),
                                    ("bfloat16", "int8")])
@pytest.mark.parametrize("splits", [1, 3])
def test_dtypes_prefill_and_split(act, kv, splits):
    _run(**BASE, q_lens=[3, 1, 0, 6], ctx_lens=[2, 9, 3, 0], act_dtype=act, kv_dtype=kv, num_splits=splits,
         realistic=kv == "int8", seed=splits)


def test_head_chunks_without_rope_decode_split():
    """20 heads over programs of 16 rows: two head chunks; R = 0; three decode sequences, split-K."""
    _run(num_heads=20, kv_lora_rank=16, qk_rope_head_dim=0, block_size=16, q_lens=[1, 1, 1], ctx_lens=[0, 17, 40],
         num_splits=3, seed=5)


def test_odd_sizes_shared_prefix_and_padding_slot():
    """L, R not powers of two (masked lanes), block_size 3, a shared prefix block, a slot -1 token."""
    _run(num_heads=3, kv_lora_rank=20, qk_rope_head_dim=5, block_size=3, q_lens=[5, 4], ctx_lens=[6, 6],
         shared_prefix_blocks=2, pad_last=True, compare_tokens=slice(0, 8), seed=6)


def test_split_plan():
    attrs = reference.make_case(**BASE, q_lens=[1], ctx_lens=[1])[1]
    cpu = torch.device("cpu")
    assert plan(attrs, 2, 2, 5, 4000, cpu).num_splits == 1  # prefill: never split
    p = plan(attrs, 1, 1, 1, 4000, cpu)  # one decode sequence, 4 rows: split (capped by 256 keys a split)
    assert p.num_splits > 1 and p.partition % TILE.block_n == 0 and p.partition * p.num_splits >= 4000
    assert plan(attrs, 1, 1, 1, 100, cpu).num_splits == 1  # too short to split
    assert plan(attrs, 1, 1, 1, 4000, cpu, num_splits=1).num_splits == 1
