"""INT8 KV on keys with outlier channels (Qwen2-style: q/k/v biases, a few key channels far
larger than the rest at every token). A tiny random qwen2 whose k_proj gets such channels on
purpose: per-head scales (one per KV head, the scheme before per-channel scales) lose the other
channels to rounding; per-channel scales hold. Both run the same build and validation; only
the calibrated scales differ (per-head scales expressed per channel: each head's max repeated,
which quantizes exactly as a per-head scale does)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport import io
from kvexport.exporter import calibrate as cal
from kvexport.exporter.build import BuildOptions, build

OUTLIER_GAIN = 60.0  # how much larger the outlier key channels are than the rest


@pytest.fixture(scope="module")
def outlier_qwen2(hf_folder, tmp_path_factory):
    """A tiny qwen2 (q/k/v biases) whose k_proj makes one RoPE channel pair per KV head
    OUTLIER_GAIN times larger (weight rows and bias), as Qwen2.5's keys are."""
    from transformers import AutoModelForCausalLM

    src = hf_folder("qwen2", num_key_value_heads=2)
    model = AutoModelForCausalLM.from_pretrained(src)
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            k = layer.self_attn.k_proj
            for h in range(cfg.num_key_value_heads):
                for c in (h * d + 1, h * d + 1 + d // 2):  # a rotary pair: stays an outlier after RoPE
                    k.weight[c] *= OUTLIER_GAIN
                    k.bias[c] = k.bias[c] * OUTLIER_GAIN + OUTLIER_GAIN
    out = tmp_path_factory.mktemp("qwen2-outliers")
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


def _per_head(compute):
    def per_head(model, ids, chunk=512, rotary_dim=0):
        s = compute(model, ids, chunk, rotary_dim)  # [layers, 2, kvH, D]
        return np.broadcast_to(s.max(axis=-1, keepdims=True), s.shape).copy()
    return per_head


def _validation(src: str, out, monkeypatch=None):
    """(build manifest, ValidationEntry) of an unvalidated int8 build of `src`, validated here
    (a failing validation is a result to compare, not an error)."""
    from transformers import AutoModelForCausalLM

    from kvexport.exporter.validate import fit_prompts, prompt_ids, validate

    _, m = build(src, out, BuildOptions(block_size=4, max_seq_len=64, kv_dtype=io.DType.INT8,
                                        attention=io.Attention.ONNX, validate=False))
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    prompts, steps = fit_prompts(prompt_ids(None, m.model.vocab_size), m.kv.max_seq_len, 16)
    return m, validate(out, m, model, prompts, steps)


def test_per_channel_scales_hold_where_per_head_scales_fail(outlier_qwen2, tmp_path, monkeypatch):
    chan_m, chan = _validation(outlier_qwen2, tmp_path / "per-channel")
    monkeypatch.setattr(cal, "compute_scales", _per_head(cal.compute_scales))
    head_m, head = _validation(outlier_qwen2, tmp_path / "per-head")
    k_scales = np.array(chan_m.kv.quantization["scales"])[:, 0]  # [layers, kvH, D]
    assert (k_scales.max(-1) / np.median(k_scales, -1)).min() > 10  # the outliers are there
    print(f"per-head: max |d| {head.max_abs_diff:.3g}, agreement {head.token_agreement:.0%}, passed {head.passed}; "
          f"per-channel: max |d| {chan.max_abs_diff:.3g}, agreement {chan.token_agreement:.0%}, passed {chan.passed}")
    # NOTE: per-head scales degrade without failing the int8 bound here (exporter/validate.py);
    # on Qwen2.5-0.5B they failed it (max |d| 3.1, greedy kept on 2 of 5 prompts)
    assert chan.passed
    assert chan.max_abs_diff * 3 < head.max_abs_diff and chan.token_agreement > head.token_agreement
