"""The int4 KV key transform (exporter/kv_int4.py calibrate_transform): int4 builds store
(k - μ) / s and attend with q * s, μ the calibration text's mean post-RoPE key and s each
channel's spread (per layer, KV head and channel). Covered: shifting every key by a constant
leaves softmax attention unchanged and changes soft-capped attention (reference op, float pools:
why soft-capped layers get no μ); a tiny Qwen2 with a large k bias on a few channels (Qwen2.5's
outliers) built --kv-dtype int4 holds μ and s in both graphs and in the manifest, equal to the
mean and spread of the keys transformers caches for the calibration ids, and validates much
closer to transformers than the same build without the transform; a soft-capped model (Gemma 2)
gets channel scales only. The channel scale s is chosen per layer and KV head by measurement
(kv_int4.choose_scale): on a crafted layer whose head has channels 30x wider than the rest, the
pick is the candidate of least error and far better than none or full equalization; the error
it measures is the reference op's on int4 pools of the same rows; every candidate is exact
without quantization."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvexport import io
from kvexport.errors import ValidationError
from kvexport.exporter import calibrate, kv_int4
from kvexport.exporter.build import BuildOptions, build
from kvexport.plugins.paged_attention.reference import make_case, paged_attention

HF = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)  # head_dim 32: one group per head
OPTS = dict(block_size=4, max_seq_len=64, kv_dtype=io.DType.INT4, attention=io.Attention.ONNX)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_a_constant_key_shift_is_exact_without_softcap(softcap):
    case, attrs = make_case(num_heads=4, num_kv_heads=2, head_dim=32, block_size=4, q_lens=[3, 1],
                            ctx_lens=[5, 9], kv_dtype="float32", seed=1)
    if softcap:
        from dataclasses import replace
        attrs = replace(attrs, logit_softcap=softcap)
    mu = torch.randn(2, 32, generator=torch.Generator().manual_seed(2)) * 20
    shifted = dict(case, key=case["key"] - mu, key_cache=case["key_cache"] - mu[:, None, None, :])
    args = ("query", "key", "value", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc",
            "slot_mapping")
    a = paged_attention(*(case[k].clone() for k in args), attrs=attrs)
    b = paged_attention(*(shifted[k].clone() for k in args), attrs=attrs)
    diff = float((a - b).abs().max())
    assert diff < 1e-5 if not softcap else diff > 1e-3


@pytest.fixture(scope="module")
def biased_qwen2(hf_folder, tmp_path_factory):
    """A tiny Qwen2 whose k bias puts channels 14, 15, 30, 31 (RoPE's slowest pairs: about the
    same after RoPE at every position) of every KV head at +-40, the rest of the keys ~1."""
    d = tmp_path_factory.mktemp("hf-qwen2-kbias")
    model = AutoModelForCausalLM.from_pretrained(hf_folder("qwen2", **HF))
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.self_attn.k_proj.bias.view(2, 32)
            bias[:, [14, 15, 30, 31]] = torch.tensor([40.0, -40.0, 30.0, -30.0])
    model.save_pretrained(d, safe_serialization=True)
    return d


def test_offsets_are_the_mean_key_and_make_outlier_keys_accurate(biased_qwen2, tmp_path, monkeypatch):
    out, m = build(str(biased_qwen2), tmp_path / "mu", BuildOptions(**OPTS))
    entry = m.kv.quantization["key_transform"]
    mu = np.asarray(entry["offsets"], np.float32)  # [layers, kv_heads, head_dim]
    sc = np.asarray(entry["scales"], np.float32)
    assert mu.shape == sc.shape == (2, 2, 32) and entry["layers_without_offset"] == []
    assert entry["calibration"]["tokens"] == 2048
    # the mean of the post-RoPE keys transformers caches for the same ids, in one pass
    model = AutoModelForCausalLM.from_pretrained(biased_qwen2)
    ids = calibrate.calibration_ids(None, m.model.vocab_size, None, 2048)
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    keys = [layer.keys[0].double() for layer in cache.layers]  # [kv_heads, seq, head_dim]
    np.testing.assert_allclose(mu, np.stack([k.mean(1).numpy() for k in keys]), atol=1e-4)
    var = np.stack([k.var(1, unbiased=False).numpy() for k in keys])
    sd = np.sqrt(np.concatenate([(var[..., :16] + var[..., 16:]) / 2] * 2, axis=-1))  # RoPE pairs c, c + 16
    choice = entry["scale_choice"]
    errors = np.asarray(choice["errors"])  # [layers, candidates, kv_heads]
    assert errors.shape == (2, len(kv_int4.CANDIDATES), 2) and len(choice["candidates"]) == len(kv_int4.CANDIDATES)
    for i in range(2):
        for h in range(2):  # each head's s is its measured best candidate, from the keys' spread
            c = choice["chosen"][i][h]
            assert errors[i, kv_int4.CANDIDATES.index(c), h] == errors[i, :, h].min()
            want = kv_int4.candidate_scale(torch.from_numpy(sd[i]), c)[h].numpy()
            np.testing.assert_allclose(sc[i, h], want, rtol=1e-3)
    assert sc[..., [14, 15, 30, 31]].min() > 2 * np.median(sc)  # the outliers are narrowed most
    assert np.abs(mu[..., [14, 15, 30, 31]]).min() > 20  # the outliers are what the offsets hold
    for name in (io.PREFILL_GRAPH, io.DECODE_GRAPH):
        inits = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(out / name)).graph.initializer
                 if t.name.startswith("kv_offsets.")}
        assert sorted(inits) == sorted(f(i) for i in range(2) for f in (io.k_offset, io.k_channel_scale,
                                                                         io.q_channel_scale))
        np.testing.assert_array_equal(np.stack([inits[io.k_offset(i)] for i in range(2)]), mu)
        np.testing.assert_array_equal(np.stack([inits[io.k_channel_scale(i)] for i in range(2)]), sc)
        np.testing.assert_array_equal(inits[io.q_channel_scale(1)], np.repeat(sc[1], 2, axis=0))  # 2 q heads per KV head
    with_mu = m.validation
    assert with_mu.passed, with_mu
    # the same build without the transform (μ = 0, s = 1): the outliers set every group's scale
    none = kv_int4.KeyTransform(np.stack([np.zeros_like(mu), np.ones_like(sc)], axis=1), [[0.0] * 2] * 2,
                                np.zeros((2, len(kv_int4.CANDIDATES), 2)))
    monkeypatch.setattr(kv_int4, "calibrate_transform", lambda *a, **k: none)
    with pytest.raises(ValidationError) as e:  # it fails the int4 bounds
        build(str(biased_qwen2), tmp_path / "zero", BuildOptions(**OPTS))
    without = float(re.search(r"max \|Δ\| ([0-9.]+)", str(e.value)).group(1))
    assert without > 1.5 * with_mu.max_abs_diff, (str(e.value), with_mu)  # measured: 2.8 vs 1.53


def test_softcapped_layers_get_no_offsets_only_channel_scales(hf_folder, tmp_path):
    src = str(hf_folder("gemma2", num_key_value_heads=2, head_dim=32))  # attn_logit_softcapping 50
    out, m = build(src, tmp_path / "g", BuildOptions(validate=False, **OPTS))
    entry = m.kv.quantization["key_transform"]
    assert entry["layers_without_offset"] == [0, 1] and not np.asarray(entry["offsets"]).any()
    graph = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False).graph
    names = {t.name for t in graph.initializer if t.name.startswith("kv_offsets.")}
    assert names == {f(i) for i in range(2) for f in (io.k_channel_scale, io.q_channel_scale)}  # s is exact there


def _layer(wide: list[float], n: int = 256, seed: int = 0) -> dict:
    """A captured layer (kv_int4._capture's form): 4 query heads on 2 KV heads, head_dim 64, every
    position a query; KV head h's channels 0-3 and their RoPE partners 32-35 `wide[h]` times wider."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, n, 64, generator=g)
    for h, w in enumerate(wide):
        k[h, :, [0, 1, 2, 3, 32, 33, 34, 35]] *= w
    return dict(q=2 * torch.randn(4, n, 64, generator=g), k=k, v=torch.randn(2, n, 64, generator=g),
                pos=torch.arange(n), scale=64 ** -0.5, window=0, softcap=0.0, sinks=None)


def _spread(cap):
    k = cap["k"].double()
    mean = k.mean(1)
    return mean, kv_int4.channel_spread(((k - mean[:, None]) ** 2).mean(1), 64)


def test_the_scale_chosen_is_the_candidate_of_least_attention_error():
    cap = _layer([30.0, 1.0])
    mu, sd = _spread(cap)
    s, chosen, err = kv_int4.choose_scale(cap, mu, sd)
    assert err.shape == (len(kv_int4.CANDIDATES), 2)
    assert chosen == [kv_int4.CANDIDATES[j] for j in err.argmin(0).tolist()]
    for h in range(2):
        torch.testing.assert_close(s[h], kv_int4.candidate_scale(sd, chosen[h])[h])
    # the wide head: neither leaving the channels (alpha 0) nor equalizing them (alpha 1) — halfway
    # (measured: 0.103 / 0.034 / 0.113)
    e = dict(zip(kv_int4.CANDIDATES, err[:, 0].tolist()))
    assert chosen[0] in (0.25, 0.5), e
    assert e[chosen[0]] < 0.5 * min(e[0.0], e[1.0]), e


def _op(kv_dtype: str, q, k, v):
    """The reference op on one sequence whose tokens are all new (stored, then read back from
    `kv_dtype` pools): q [H, T, D], k, v [kvH, T, D] -> [H, T, D] float64."""
    case, attrs = make_case(num_heads=q.shape[0], num_kv_heads=k.shape[0], head_dim=q.shape[-1], block_size=16,
                            q_lens=[q.shape[1]], ctx_lens=[0], kv_dtype=kv_dtype, seed=0)
    case = dict(case, query=q.transpose(0, 1).float().contiguous(), key=k.transpose(0, 1).float().contiguous(),
                value=v.transpose(0, 1).float().contiguous())
    args = ("query", "key", "value", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc",
            "slot_mapping")
    return paged_attention(*(case[a] for a in args), attrs=attrs).double().transpose(0, 1)


def test_the_measured_error_is_the_reference_ops_on_int4_pools():
    """attention_error's o' is what the op computes from int4 pools of the transformed rows
    (quantize_int4's bytes): the same relative error as plugins/paged_attention/reference.py's."""
    cap = _layer([12.0, 2.0], n=48, seed=3)
    mu, sd = _spread(cap)
    s = kv_int4.candidate_scale(sd, 0.5)
    got = kv_int4.attention_error(cap, mu, s)
    hd = torch.from_numpy(kv_int4.hadamard(64))
    q, k, v = cap["q"], cap["k"], cap["v"]
    out = _op("int4", (q * s.float().repeat_interleave(2, 0)[:, None]) @ hd,
              ((k - mu.float()[:, None]) / s.float()[:, None]) @ hd, v @ hd) @ hd.double()
    ref = _op("float32", q, k, v)
    num = ((out - ref) ** 2).sum((1, 2)).view(2, 2).sum(1)
    den = (ref ** 2).sum((1, 2)).view(2, 2).sum(1)
    assert float(got.min()) > 1e-3  # int4 noise, not nothing
    torch.testing.assert_close(got, num / den, rtol=1e-3, atol=0)


@pytest.mark.parametrize("candidate", kv_int4.CANDIDATES)
def test_every_candidate_transform_is_exact_without_quantization(candidate):
    """float64, no rounding: softmax(rotate(q s)·rotate((k - μ) / s)ᵀ)·rotate(v), rotated back, is
    the attention of q, k, v (the q·μ shift is the same for every key a query reads)."""
    cap = {name: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x)
           for name, x in _layer([30.0, 3.0], n=96, seed=5).items()}
    cap["k"] = cap["k"] + 7.0  # an offset worth removing
    mu, sd = _spread(cap)
    s = kv_int4.candidate_scale(sd, candidate)
    hd = torch.from_numpy(kv_int4.hadamard(64)).double()
    ref = kv_int4._attend(cap, cap["q"], cap["k"], cap["v"])
    got = kv_int4._attend(dict(cap), (cap["q"] * s.repeat_interleave(2, 0)[:, None]) @ hd,
                          ((cap["k"] - mu[:, None]) / s[:, None]) @ hd, cap["v"] @ hd) @ hd
    assert float((got - ref).abs().max()) < 1e-10
