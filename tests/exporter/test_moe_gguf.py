"""GGUF input for the mixture-of-experts families transformers' GGUF loader reads (qwen2moe,
qwen3moe): a tiny random model written as llama.cpp lays it out (gguf-py's own HF -> GGUF tensor
name map; experts stacked as ffn_gate_exps / ffn_up_exps / ffn_down_exps, qwen2moe's shared expert
as *_shexp with its ffn_gate_inp_shexp gate), float32 or with Q8_0 experts, built by kvexport and
validated; its served greedy tokens equal those of transformers' own model loaded from the same
file (`from_pretrained(dir, gguf_file=...)`, the expert widths its GGUF mapping lacks passed as config
fields, exactly what kvexport passes: exporter/source.py GGUF_CONFIG_FILL).

Also: transformers alone reads those widths as its config defaults (why kvexport fills them), and a
MoE stored under a dense architecture (llama.cpp's Mixtral: "llama" + llama.expert_count) is refused
by name."""

from pathlib import Path

import numpy as np
import pytest
import torch

from kvexport import LLM, SamplingParams, io
from kvexport.errors import UnsupportedModelError
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.validate import TOLERANCE

from testkit import parity as engine_parity
from testkit.gguf_files import CASES, write_moe_gguf


def widths(family: str) -> dict[str, int]:
    keys = ("moe_intermediate_size", "shared_expert_intermediate_size")
    return {k: v for k, v in CASES[family].items() if k in keys}


def hf_from_gguf(path: Path, family: str):
    """transformers' own model from the GGUF: its loader, tensor mapping and dequantization."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                       output_loading_info=True, **widths(family))
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()


PARAMS = [("qwen3_moe", None), ("qwen2_moe", "Q8_0")]


@pytest.mark.parametrize("family,expert_type", PARAMS, ids=[f"{f}-{t or 'f32'}" for f, t in PARAMS])
def test_moe_gguf_builds_and_serves_transformers_tokens(hf_folder, tmp_path, family, expert_type):
    import gguf

    f = write_moe_gguf(hf_folder(family, **CASES[family]), family, tmp_path / f"{family}.gguf", expert_type)
    ref = hf_from_gguf(f, family)
    out, m = build(str(f), tmp_path / "b", BuildOptions(attention=io.Attention.ONNX, block_size=4, max_seq_len=64))
    v = m.validation
    assert v.passed and v.greedy_identical and v.max_abs_diff <= TOLERANCE["fp32"], v
    spec = m.model.spec["moe"]
    assert (spec["num_experts"], spec["expert_intermediate_size"]) == (4, 32)
    assert spec["sparse_layers"] == [0, 1]
    assert spec["shared_intermediate_size"] == (64 if family == "qwen2_moe" else 0)
    assert spec["norm_topk_prob"] == (family == "qwen3_moe")  # llama.cpp's qwen3moe renormalizes (transformers too)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(f)).tensors}
    assert kinds == ({"F32", expert_type} if expert_type else {"F32"})
    prompts = engine_parity.random_prompts(3, 128, 5, 20, seed=4)
    got = LLM(out).generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in got] == engine_parity.hf_greedy(ref, prompts, 12)


@pytest.mark.parametrize("expert_type,weights", [("Q8_0", "int8"), ("Q4_1", "int4")])
def test_gguf_experts_map_exactly_onto_codes(hf_folder, tmp_path, expert_type, weights):
    """--weights int8|int4 --quant-method rtn --weight-block-size 32 of a GGUF with Q8_0 / Q4_1
    experts: every routed expert's up (gate | up) and down and the shared expert's matrices are its
    blocks (exporter/weight_sources.py gguf_presets; Q4_1's block minimums as offsets), not re-rounded;
    the build validates."""
    f = write_moe_gguf(hf_folder("qwen2_moe", **CASES["qwen2_moe"]), "qwen2_moe", tmp_path / "m.gguf", expert_type)
    out, m = build(str(f), tmp_path / "b", BuildOptions(attention=io.Attention.ONNX, block_size=4, max_seq_len=64,
                                                        weights=weights, quant_method="rtn", weight_block_size=32))
    assert m.validation.passed, m.validation
    # per layer: 4 experts x (up, down) + the shared expert's up, down from the GGUF; attention (F32) re-rounded,
    # and the head (int8 in every build: Q8_0-exact only from a Q8_0 output.weight, F32 here)
    assert m.weights.quantization.quantized.origins == {f"gguf:{expert_type}": 2 * (4 * 2 + 2), "rtn": 2 * 2 + 1}


def test_transformers_alone_reads_the_expert_widths_as_defaults(hf_folder, tmp_path):
    """What kvexport fills in: transformers' GGUF config mapping has no expert_feed_forward_length /
    expert_shared_feed_forward_length, so the config class's defaults stand (and the tensors would
    not fit them); kvexport's config has the file's."""
    from transformers import AutoConfig

    f = write_moe_gguf(hf_folder("qwen2_moe", **CASES["qwen2_moe"]), "qwen2_moe", tmp_path / "m.gguf")
    plain = AutoConfig.from_pretrained(tmp_path, gguf_file=f.name)
    assert (plain.moe_intermediate_size, plain.shared_expert_intermediate_size) == (1408, 5632)  # class defaults
    ours = source.load_config(source.resolve(str(f)))
    assert (ours.moe_intermediate_size, ours.shared_expert_intermediate_size) == (32, 64)


def test_moe_under_a_dense_architecture_is_refused(tmp_path):
    import gguf

    f = tmp_path / "mixtral.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError) as e:
        build(str(f), tmp_path / "b", BuildOptions(validate=False))
    msg = str(e.value)
    assert "'llama.expert_count'" in msg and "mixtral.gguf" in msg and "qwen2moe, qwen3moe" in msg
    assert not (tmp_path / "b").exists()
