"""Triton kernels vs the float64 torch reference, on CPU under TRITON_INTERPRET=1 (see
conftest.py): outputs within spec.TOLERANCE, pools bit-identical after the in-place store."""

import pytest
import torch

from kvexport.plugins.paged_attention import configs, reference
from kvexport.plugins.paged_attention.launch import paged_attention_triton, plan
from kvexport.plugins.paged_attention.spec import TOLERANCE

TILE = configs.INTERPRET_TILE


def _run(*, num_splits=None, compare_tokens=None, **case):
    inputs, attrs = reference.make_case(**case)
    ref_inputs = {k: (v.clone() if v is not None else None) for k, v in inputs.items()}
    out = paged_attention_triton(**inputs, attrs=attrs, tile=TILE, num_splits=num_splits)
    ref = reference.paged_attention(**ref_inputs, attrs=attrs)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rows = slice(None) if compare_tokens is None else compare_tokens
    err = (out[rows].double() - ref[rows].double()).abs().max().item()
    assert err <= TOLERANCE[case.get("act_dtype", "float32")], err
    assert torch.equal(inputs["key_cache"], ref_inputs["key_cache"])  # the store: bit for bit
    assert torch.equal(inputs["value_cache"], ref_inputs["value_cache"])
    return inputs, attrs


HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}  # (num_heads, num_kv_heads); gqa group 3


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("phase", ["prefill", "decode", "decode-split"])
def test_heads_and_kv_dtype(heads, kv_dtype, phase):
    h, kvh = HEADS[heads]
    if phase == "prefill":  # ragged: a fresh prompt, a chunk after cached blocks, a 1-token step
        q_lens, ctx_lens = [5, 9, 1], [0, 11, 6]
    else:
        q_lens, ctx_lens = [1, 1, 1, 1], [0, 5, 23, 37]
    _run(num_heads=h, num_kv_heads=kvh, head_dim=16, block_size=4, q_lens=q_lens, ctx_lens=ctx_lens,
         kv_dtype=kv_dtype, num_splits=3 if phase == "decode-split" else 1, seed=hash(heads) % 100)


@pytest.mark.parametrize("act,kv", [("float16", "float16"), ("bfloat16", "bfloat16"), ("float16", "int8"),
                                    ("bfloat16", "int8"), ("float32", "float16"), ("bfloat16", "float16")])
@pytest.mark.parametrize("phase", ["prefill", "decode-split"])
def test_activation_dtypes(act, kv, phase):
    q_lens, ctx_lens = ([4, 7, 1], [0, 9, 14]) if phase == "prefill" else ([1, 1, 1], [3, 18, 33])
    _run(num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, q_lens=q_lens, ctx_lens=ctx_lens,
         act_dtype=act, kv_dtype=kv, num_splits=2 if phase != "prefill" else None, seed=3)


@pytest.mark.parametrize("window", [1, 5, 16])
@pytest.mark.parametrize("phase", ["prefill", "decode", "decode-split"])
def test_sliding_window(window, phase):
    q_lens, ctx_lens = ([6, 20, 1], [0, 13, 30]) if phase == "prefill" else ([1, 1, 1], [2, 19, 45])
    _run(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, q_lens=q_lens, ctx_lens=ctx_lens,
         sliding_window=window, num_splits={"prefill": None, "decode": 1}.get(phase, 3), seed=window)


def test_shared_prefix_blocks_holes_and_odd_shapes():
    # block_size 5, head_dim 24 (not powers of 2), prefix blocks shared by all sequences,
    # shuffled tables with unused ids between them (make_case), a q_len-0 sequence
    _run(num_heads=6, num_kv_heads=2, head_dim=24, block_size=5, q_lens=[3, 0, 17, 2], ctx_lens=[12, 7, 10, 40],
         shared_prefix_blocks=2, kv_dtype="int8", seed=7)
    _run(num_heads=6, num_kv_heads=3, head_dim=24, block_size=5, q_lens=[1, 0, 1], ctx_lens=[12, 7, 40],
         shared_prefix_blocks=2, num_splits=4, seed=8)


def test_prefill_tiles_span_many_tokens_and_blocks():
    # a 40-token prompt chunk over 33 cached tokens: several q-tiles per sequence, more
    # tiles of keys than of queries, tile boundaries not aligned with blocks
    _run(num_heads=2, num_kv_heads=1, head_dim=16, block_size=3, q_lens=[40, 2], ctx_lens=[33, 0], seed=11)


def test_slot_minus_one_padding_is_not_stored():
    # a padding "sequence": one token with slot -1 and a table of pad blocks; real tokens
    # must match the reference and the pools must be untouched by the padding token
    inputs, attrs = reference.make_case(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                                        q_lens=[3, 1], ctx_lens=[2, 9], kv_dtype="int8", seed=5)
    pad = dict(inputs)
    t = inputs["query"].shape[0]
    for name in ("query", "key", "value"):
        pad[name] = torch.cat([inputs[name], inputs[name][:1] * 0 + 7.0])
    pad["block_tables"] = torch.cat([inputs["block_tables"], torch.zeros_like(inputs["block_tables"][:1])])
    pad["seq_lens"] = torch.cat([inputs["seq_lens"], torch.tensor([1])])
    pad["query_start_loc"] = torch.cat([inputs["query_start_loc"], torch.tensor([t + 1])])
    pad["slot_mapping"] = torch.cat([inputs["slot_mapping"], torch.tensor([-1])])
    ref_in = {k: (v.clone() if v is not None else None) for k, v in pad.items()}
    out = paged_attention_triton(**pad, attrs=attrs, tile=TILE)
    ref = reference.paged_attention(**ref_in, attrs=attrs)
    assert (out[:t] - ref[:t]).abs().max().item() <= TOLERANCE["float32"]
    assert torch.equal(pad["key_cache"], ref_in["key_cache"]) and torch.equal(pad["value_cache"], ref_in["value_cache"])
    assert torch.isfinite(out[t:]).all()  # the pad token attends to its own K/V (not stored)


@pytest.mark.parametrize("per_head", [False, True])
def test_int8_store_rounds_half_to_even_and_saturates(per_head):
    # keys exactly on .5 ties and far out of range: the pool must hold QuantizeLinear's codes
    # (per-channel scales, and the per-head [kv_heads] scales of older builds)
    inputs, attrs = reference.make_case(num_heads=2, num_kv_heads=2, head_dim=16, block_size=4,
                                        q_lens=[1, 1], ctx_lens=[3, 6], kv_dtype="int8", seed=2,
                                        per_head_scales=per_head)
    inputs["k_scale"] = torch.tensor([0.5, 0.25]) if per_head else torch.tensor([[0.5] * 8 + [0.25] * 8] * 2)
    inputs["v_scale"] = inputs["v_scale"][..., :1].expand_as(inputs["k_scale"]).contiguous()
    ties = torch.tensor([0.25, 0.75, -0.25, -0.75, 1.25, 100.0, -100.0, 0.0] * 2)  # / 0.5 -> .5 ties
    inputs["key"] = ties.repeat(2, 2, 1)  # [T=2, kvH=2, D=16]
    ref_in = {k: (v.clone() if v is not None else None) for k, v in inputs.items()}
    paged_attention_triton(**inputs, attrs=attrs, tile=TILE, num_splits=1)
    reference.paged_attention(**ref_in, attrs=attrs)
    assert torch.equal(inputs["key_cache"], ref_in["key_cache"])
    slot = int(inputs["slot_mapping"][0])
    stored = inputs["key_cache"][0, slot // 4, slot % 4].tolist()
    assert stored[:8] == [0, 2, 0, -2, 2, 127, -128, 0]
    assert stored[8:] == ([0, 2, 0, -2, 2, 127, -128, 0] if per_head else [1, 3, -1, -3, 5, 127, -128, 0])


def test_plan_split_heuristic():
    attrs = reference.make_case(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, q_lens=[1],
                                ctx_lens=[1])[1]
    plan_ = lambda s, L, **kw: plan(attrs, s, 1, L, torch.device("cpu"), **kw)  # noqa: E731  1 SM
    assert plan_(4, 100).num_splits == 1 and plan_(4, 100).kind == "decode"
    assert plan(attrs, 4, 7, 100, torch.device("cpu")).kind == "prefill"
    p = plan_(1, 4096, num_splits=8)
    assert p.num_splits == 8 and p.partition == 512 and p.partition % p.tile.block_n == 0
    assert plan_(1, 4096, num_splits=1000).num_splits <= configs.MAX_SPLITS
    # NOTE: the automatic split count reads the GPU's SM count: only scripts/gpu_check.sh runs it


# Per-layer attributes (Gemma 2/3-style layers), each on its own and together: the output
# must differ from default attributes (the attribute reaches the kernel) and match the reference.
PER_LAYER_CASES = {
    "sliding_window": dict(sliding_window=6),
    "logit_softcap": dict(logit_softcap=1.5, scale=0.4),
    "scale": dict(scale=0.0625),  # e.g. query_pre_attn_scalar ** -0.5 != head_dim ** -0.5
    "all": dict(sliding_window=5, logit_softcap=2.0, scale=0.3),
}


@pytest.mark.parametrize("name", sorted(PER_LAYER_CASES))
@pytest.mark.parametrize("act,kv", [("float32", "float32"), ("float32", "int8"), ("float16", "float16"),
                                    ("float16", "int8")])
@pytest.mark.parametrize("phase", ["prefill", "decode-split"])
def test_per_layer_attributes(name, act, kv, phase):
    q_lens, ctx_lens = ([5, 12, 1], [0, 9, 14]) if phase == "prefill" else ([1, 1, 1], [3, 18, 33])
    case = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, q_lens=q_lens, ctx_lens=ctx_lens,
                act_dtype=act, kv_dtype=kv, seed=4)
    inputs, attrs = _run(**case, **PER_LAYER_CASES[name], num_splits=2 if phase != "prefill" else None)
    plain, plain_attrs = reference.make_case(**case)
    with_attr, _ = reference.make_case(**case, **PER_LAYER_CASES[name])
    diff = (reference.paged_attention(**with_attr, attrs=attrs).double()
            - reference.paged_attention(**plain, attrs=plain_attrs).double()).abs().max().item()
    assert diff > 1e-2
