"""MXFP4 gpt-oss checkpoints (exporter/mxfp4.py), as openai/gpt-oss-20b / -120b ship their experts:
`quantization_config: {"quant_method": "mxfp4"}`, each expert projection as uint8 e2m1 code blocks
(`*_blocks`, two codes a byte) and e8m0 scales (`*_scales`, one per 32).

- The dequantization equals transformers' own (transformers.integrations.mxfp4
  convert_moe_packed_tensors) bit for bit, over every code and a wide range of scales.
- A tiny gpt_oss (the shapes of tests/exporter/test_gpt_oss.py) whose experts are quantized to MXFP4
  here builds, validates, and serves the greedy tokens of transformers' model loaded from the same
  folder with Mxfp4Config(dequantize=True) (transformers' loader and dequantization, on CPU).
- Other quant_methods (and mxfp4 on a family transformers does not pack so) are refused by name
  before any weight is read; a packed tensor without its scales is refused naming it."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvexport import LLM, SamplingParams, io
from kvexport.errors import ConfigError, SourceError
from kvexport.exporter import mxfp4, source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.validate import TOLERANCE




from testkit import parity as engine_parity  # noqa: E402
from testkit.families import make_hf_folder  # noqa: E402
PROJ = ("gate_up_proj", "down_proj")


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., K] (K a multiple of 32) -> (uint8 blocks [..., K/32, 16], uint8 scales [..., K/32]):
    per block the power of two putting its largest |w| in e2m1's range, codes rounded to nearest."""
    b = w.reshape(*w.shape[:-1], -1, mxfp4.BLOCK).astype(np.float32)
    amax = np.abs(b).max(-1, keepdims=True)
    exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, 0).astype(np.int32)  # 6 = 1.5 * 2^2
    codes = np.abs(b[..., None] / np.ldexp(1.0, exp)[..., None] - mxfp4.FP4_VALUES).argmin(-1).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp[..., 0] + mxfp4.SCALE_BIAS).astype(np.uint8)


def write_mxfp4(src: Path, d: Path) -> Path:
    """The float gpt_oss folder `src` saved as an MXFP4 checkpoint in `d`: every expert projection
    [E, in, out] stored transposed [E, out, in] as blocks + scales, the rest as it was."""
    from safetensors.numpy import load_file, save_file

    d.mkdir(parents=True)
    sd = load_file(str(src / "model.safetensors"))
    for name in [k for k in sd if k.endswith(PROJ)]:
        blocks, scales = quantize(np.ascontiguousarray(sd.pop(name).transpose(0, 2, 1)))
        sd[name + "_blocks"], sd[name + "_scales"] = blocks, scales
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (d / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (d / f.name).write_bytes(f.read_bytes())
    return d


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpt-oss")
    return write_mxfp4(make_hf_folder("gpt_oss", base / "float"), base / "mxfp4")


def hf_dequantized(directory: Path):
    """transformers' own reading of the checkpoint: its MXFP4 loader, dequantizing (CPU, float32)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=Mxfp4Config(dequantize=True),
                                                dtype=torch.float32).eval()


def test_dequantize_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 40, 4, 16), dtype=np.uint8)  # every code, both nibbles
    scales = rng.integers(0, 253, size=(3, 40, 4), dtype=np.uint8)  # 2^-127 (subnormal) .. 2^125
    ours = mxfp4.expert_weight(blocks, scales, "w")  # [3, 128, 40]
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    assert ours.shape == tuple(ref.shape) == (3, 128, 40)
    np.testing.assert_array_equal(ours, ref.numpy())
    assert np.isfinite(ours).all() and (ours != 0).mean() > 0.8


def test_build_serves_transformers_tokens(checkpoint, tmp_path):
    ref = hf_dequantized(checkpoint)
    ours = source.load_model(source.resolve(str(checkpoint)))
    want = ref.state_dict()
    for k, v in ours.state_dict().items():  # the experts exactly as transformers dequantizes them
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
    assert any(k.endswith("experts.gate_up_proj") for k in want)
    out, m = build(str(checkpoint), tmp_path / "b", BuildOptions(attention=io.Attention.ONNX, block_size=4,
                                                                 max_seq_len=64))
    v = m.validation
    assert v.passed and v.greedy_identical and v.max_abs_diff <= TOLERANCE["fp32"], v
    prompts = engine_parity.random_prompts(3, 128, 5, 20, seed=3)
    got = LLM(out).generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in got] == engine_parity.hf_greedy(ref, prompts, 12)


@pytest.mark.parametrize("qc,model_type", [({"quant_method": "bitsandbytes", "load_in_4bit": True}, "gpt_oss"),
                                           ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "gpt_oss"),
                                           ({"quant_method": "mxfp4"}, "llama"), ({"bits": 4}, "gpt_oss")])
def test_unread_quant_methods_are_refused_by_name(checkpoint, tmp_path, qc, model_type):
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((checkpoint / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc} if model_type == "gpt_oss" else
                                              {"model_type": "llama", "quantization_config": qc}))
    (d / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError) as e:
        build(str(d), tmp_path / "b", BuildOptions(validate=False))
    msg = str(e.value)
    assert "'quantization_config.quant_method'" in msg and "supported values: awq, gptq, mxfp4 (gpt_oss" in msg
    assert repr(qc.get("quant_method")) in msg and "config.json" in msg
    assert not (tmp_path / "b").exists()


def test_blocks_without_scales_are_refused(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((checkpoint / "config.json").read_text())
    sd = load_file(str(checkpoint / "model.safetensors"))
    del sd["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(SourceError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks has no "
                                          r"model\.layers\.1\.mlp\.experts\.down_proj_scales"):
        source.load_model(source.resolve(str(d)))
