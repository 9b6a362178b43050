"""int4 KV (kvexport/io.py KV_INT4_FORMAT, plugins/paged_attention/spec.py "INT4 KV"): the
reference codec's bytes against an independent numpy reading of the format, and the native CPU
op against the float64 reference in real onnxruntime sessions (pools bit for bit, outputs
within the fp32 tolerance), with and without in-place pools, decode and prompt tiles."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.plugins.paged_attention.native import in_place_binding, one_node_model
from kvexport.plugins.paged_attention.reference import dequantize_int4, make_case, quantize_int4
from kvexport.plugins.paged_attention.spec import TOLERANCE, PagedAttentionAttrs

from .test_cpu_op import feeds_of, reference, session


def numpy_int4(x: np.ndarray) -> np.ndarray:
    """The format read independently of reference.py: numpy float32 steps, np.float16 rounding."""
    x = x.astype(np.float32)
    d = x.shape[-1]
    g = x.reshape(*x.shape[:-1], d // 32, 32)
    lo, hi = g.min(-1), g.max(-1)
    ext = np.where(hi >= -lo, hi, lo)
    mag = np.clip(np.maximum(np.abs(ext) / np.float32(8), np.float32(2 ** -14)), 0, 65504).astype(np.float16)
    scale = np.where(ext >= 0, -mag, mag)
    code = np.clip(np.round(g / scale.astype(np.float32)[..., None]), -8, 7) + 8
    code = code.astype(np.uint8).reshape(*x.shape[:-1], d // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    return np.concatenate([packed, scale.astype("<f2").view(np.uint8).reshape(*x.shape[:-1], -1)], -1)


def test_row_width_and_bytes_per_token():
    assert io.kv_row_width(64, "int4") == 36 and io.kv_row_width(128, "int4") == 72
    assert io.kv_row_width(64, "int8") == 64
    # smollm2-135m: 30 layers x 3 KV heads x 64: 2 x 30 x 3 x 36 bytes, 0.141x fp32 (scales included)
    fp32 = io.kv_bytes_per_token(30, 3, 64, io.DType.FP32)
    int4 = io.kv_bytes_per_token(30, 3, 64, io.DType.INT4)
    assert (fp32, int4) == (46080, 6480) and int4 / fp32 <= 0.16
    with pytest.raises(ValueError, match="multiple of 32"):
        io.kv_row_width(48, "int4")
    with pytest.raises(ConfigError, match="kv_dtype int4 needs head_dim a multiple of 32"):
        PagedAttentionAttrs(2, 1, 48, 16, 0.1, kv_dtype="int4")


def test_reference_codec_matches_the_format_read_independently():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 128, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[0, 0] = 0.0  # a constant group: the minimum scale
    x[1, 1, :32] = 2.5
    x[2, 2, 5] = 1e6  # saturates to ±65504 in float16
    rows = quantize_int4(x)
    assert rows.dtype == torch.uint8 and rows.shape == (7, 3, 72)
    np.testing.assert_array_equal(rows.numpy(), numpy_int4(x.numpy()))
    back = dequantize_int4(rows, 128)
    ok = x.abs() < 1e4
    absmax = x.reshape(7, 3, 4, 32).abs().amax(-1).repeat_interleave(32, -1)
    # half a step, a whole one where the side opposite the extreme clamps at +7 (+ float16 rounding)
    assert ((back - x).abs()[ok] <= absmax[ok] / 8 * 1.01 + 1e-4).all()
    assert (back[0, 0] == 0).all() and (back[1, 1, :32] == 2.5).all()
    # re-quantizing dequantized rows is a fixed point of the codec
    np.testing.assert_array_equal(quantize_int4(back).numpy(), rows.numpy())


CASES = {
    "decode-gqa": dict(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, q_lens=[1] * 4, ctx_lens=[0, 15, 16, 77]),
    "prefill-ragged": dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, q_lens=[1, 40, 7], ctx_lens=[33, 0, 9]),
    "window-d96": dict(num_heads=4, num_kv_heads=1, head_dim=96, block_size=8, q_lens=[9, 1], ctx_lens=[13, 40],
                       sliding_window=10),
    "generic-d160": dict(num_heads=2, num_kv_heads=2, head_dim=160, block_size=4, q_lens=[3, 1], ctx_lens=[6, 11]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_op_matches_reference(cpu_op, name):
    case, attrs = make_case(**CASES[name], kv_dtype="int4", seed=11)
    want_out, want_k, want_v = reference(case, attrs)
    out, k, v = session(str(cpu_op), one_node_model(attrs, "int4")).run(None, feeds_of(case))
    assert np.abs(out - want_out).max() <= TOLERANCE["float32"]
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)


def test_native_op_in_place_pools(cpu_op):
    case, attrs = make_case(**CASES["prefill-ragged"], kv_dtype="int4", seed=3)
    want_out, want_k, want_v = reference(case, attrs)
    feeds = feeds_of(case)
    sess = session(str(cpu_op), one_node_model(attrs, "int4"))
    binding = in_place_binding(sess, feeds)
    sess.run_with_iobinding(binding)
    assert np.abs(binding.copy_outputs_to_cpu()[0] - want_out).max() <= TOLERANCE["float32"]
    np.testing.assert_array_equal(feeds["key_cache"], want_k)
    np.testing.assert_array_equal(feeds["value_cache"], want_v)


def test_native_op_refuses_a_pool_of_the_wrong_width(cpu_op):
    case, attrs = make_case(**CASES["decode-gqa"], kv_dtype="int4", seed=1)
    feeds = feeds_of(case)
    feeds["key_cache"] = feeds["value_cache"] = np.zeros((*feeds["key_cache"].shape[:3], 64), np.uint8)
    with pytest.raises(Exception, match=re.escape("int4: head_dim / 2 + head_dim / 16")):
        session(str(cpu_op), one_node_model(attrs, "int4")).run(None, feeds)


# Triton kernels under TRITON_INTERPRET=1 (tests/plugins/conftest.py): pools bit for bit, outputs within tolerance
@pytest.mark.parametrize("phase, act, head_dim", [("prefill", "float32", 32), ("decode", "float32", 64),
                                                  ("decode-split", "float32", 96), ("prefill", "float16", 32),
                                                  ("decode-split", "bfloat16", 64)])
def test_triton_kernels_match_reference(phase, act, head_dim):
    from kvexport.plugins.paged_attention import configs
    from kvexport.plugins.paged_attention.launch import paged_attention_triton
    from kvexport.plugins.paged_attention.reference import paged_attention

    q_lens, ctx_lens = ([5, 9, 1], [0, 11, 6]) if phase == "prefill" else ([1, 1, 1], [0, 18, 37])
    inputs, attrs = make_case(num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=4, q_lens=q_lens,
                              ctx_lens=ctx_lens, kv_dtype="int4", act_dtype=act, seed=head_dim)
    ref_inputs = {k: (v.clone() if v is not None else None) for k, v in inputs.items()}
    out = paged_attention_triton(**inputs, attrs=attrs, tile=configs.INTERPRET_TILE,
                                 num_splits={"prefill": None, "decode": 1}.get(phase, 3))
    ref = paged_attention(**ref_inputs, attrs=attrs)
    assert (out.double() - ref.double()).abs().max().item() <= TOLERANCE[act]
    assert torch.equal(inputs["key_cache"], ref_inputs["key_cache"])
    assert torch.equal(inputs["value_cache"], ref_inputs["value_cache"])
