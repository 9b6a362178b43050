"""`kvexport build MODEL --lora PATH` (exporter/lora.py): a real PEFT 0.21 LoRA adapter (random, non-zero B) merged
into a build of a tiny random model gives the greedy tokens of transformers + peft running the adapter unmerged
(peft's own forward), for llama (every projection, rsLoRA, rank_pattern / alpha_pattern), gpt2 (Conv1D weights:
fan_in_fan_out) and qwen3_moe (attention of an MoE); the manifest records the adapter. Every refusal of the module
docstring is a clear error naming the field, before any weight is loaded where the config alone decides."""

import importlib.util
import json
import shutil

import pytest
import torch

from kvexport import LLM, SamplingParams
from kvexport.errors import ConfigError, KvExportError, SourceError
from kvexport.exporter import lora
from kvexport.exporter.build import BuildOptions, build

from testkit import parity
from testkit.families import TINY

# NOTE: peft imports triton: imported while tests are collected, it would set triton up out of interpreter mode
# before tests/plugins/conftest.py asks for it (the Triton kernel tests then fail), so the tests import it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed (.[test])")

CASES = {
    "llama": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                  r=4, lora_alpha=8, use_rslora=True, rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 3}),
    "gpt2": dict(target_modules=["c_attn", "c_proj"], r=4, lora_alpha=16, fan_in_fan_out=True),
    "qwen3_moe": dict(target_modules="(.*)self_attn\\.(q_proj|o_proj)", r=8, lora_alpha=4),
}
CONFIGS = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=24)}


def make_adapter(folder, out, **lora_kwargs):
    """A PEFT adapter of the HF model in `folder`, saved at `out`; returns (peft model, out)."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():  # B random and large enough to change the greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    return model.eval(), out


@pytest.mark.parametrize("family", list(CASES))
def test_merged_build_gives_peft_tokens(hf_folder, tmp_path, family):
    folder = hf_folder(family, **CONFIGS.get(family, {}))
    ref, adapter = make_adapter(folder, tmp_path / "adapter", **CASES[family])
    out, m = build(str(folder), tmp_path / "b", BuildOptions(max_seq_len=64, block_size=4, lora=str(adapter)))
    assert m.validation.passed and m.validation.greedy_identical, m.validation
    rec = m.source["lora"]
    assert rec["sha256"] == lora.read(adapter).sha256 and rec["modules"] == len(lora.read(adapter).modules)
    prompts = parity.random_prompts(3, TINY["vocab_size"], 5, 20, seed=3)
    want = parity.hf_greedy(ref, prompts, 10)
    with ref.disable_adapter():
        base = parity.hf_greedy(ref, prompts, 10)
    assert want != base, "the adapter does not change the tokens: the test would not see a merge that did nothing"
    got = LLM(out).generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in got] == want


def _adapter(hf_folder, tmp_path, **kw):
    return make_adapter(hf_folder("llama"), tmp_path / "adapter", **(dict(target_modules=["q_proj"], r=4) | kw))[1]


def _edit(adapter, **fields):
    cfg = json.loads((adapter / lora.CONFIG_FILE).read_text())
    (adapter / lora.CONFIG_FILE).write_text(json.dumps(cfg | fields))
    return adapter


@pytest.mark.parametrize("fields,named", [
    (dict(use_dora=True), "use_dora"), (dict(bias="all"), "'bias'"), (dict(modules_to_save=["lm_head"]),
                                                                     "modules_to_save"),
    (dict(peft_type="IA3"), "peft_type"), (dict(lora_bias=True), "lora_bias"), (dict(r=0), "'r'"),
    (dict(target_parameters=["mlp.experts.gate_up_proj"]), "target_parameters"),
    (dict(rank_pattern={"q_proj": 2}), "rank_pattern"),  # the weights are rank 4
    (dict(fan_in_fan_out=True), "fan_in_fan_out"),  # llama's Linear stores [out, in]
    (dict(rank_pattern={"q_proj(": 4}), "not a regular expression"),
    (dict(alpha_pattern={"q_proj": "x"}), "alpha_pattern.q_proj"),
])
def test_refused_config_fields(hf_folder, tmp_path, fields, named):
    adapter = _edit(_adapter(hf_folder, tmp_path), **fields)
    with pytest.raises(KvExportError, match=named):
        build(str(hf_folder("llama")), tmp_path / "b", BuildOptions(max_seq_len=64, lora=str(adapter)))
    assert not (tmp_path / "b").exists()


def test_refused_folders(hf_folder, tmp_path):
    opts = lambda p: BuildOptions(max_seq_len=64, lora=str(p))  # noqa: E731
    with pytest.raises(SourceError, match="no such folder"):
        build(str(hf_folder("llama")), tmp_path / "b", opts(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="adapter_config.json"):
        build(str(hf_folder("llama")), tmp_path / "b", opts(tmp_path / "empty"))
    adapter = _adapter(hf_folder, tmp_path)
    (adapter / lora.WEIGHTS_FILE).rename(adapter / "adapter_model.bin")
    with pytest.raises(SourceError, match="pickled"):
        build(str(hf_folder("llama")), tmp_path / "b", opts(adapter))
    (adapter / lora.CONFIG_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        build(str(hf_folder("llama")), tmp_path / "b", opts(adapter))


def test_adapter_of_another_base_is_refused(hf_folder, tmp_path):
    """An adapter trained on a wider model (hidden 96): refused naming the module and both shapes."""
    other = hf_folder("llama", hidden_size=96)
    _, adapter = make_adapter(other, tmp_path / "adapter", target_modules=["q_proj"], r=4)
    with pytest.raises(SourceError, match=r"model.layers.0.self_attn.q_proj is \[64 x 64\].*another base"):
        build(str(hf_folder("llama")), tmp_path / "b", BuildOptions(max_seq_len=64, lora=str(adapter)))


def test_tied_head_is_refused(hf_folder, tmp_path):
    folder = hf_folder("llama", tie_word_embeddings=True)
    _, adapter = make_adapter(folder, tmp_path / "adapter", target_modules=["lm_head"], r=4)
    with pytest.raises(SourceError, match="lm_head"):
        build(str(folder), tmp_path / "b", BuildOptions(max_seq_len=64, lora=str(adapter)))


def test_cli_flag(hf_folder, tmp_path):
    from click.testing import CliRunner

    from kvexport.cli import main

    adapter = _adapter(hf_folder, tmp_path)
    shutil.copytree(adapter, tmp_path / "a2")
    _edit(tmp_path / "a2", use_dora=True)
    r = CliRunner().invoke(main, ["build", str(hf_folder("llama")), "--out", str(tmp_path / "b"),
                                  "--lora", str(tmp_path / "a2")])
    assert r.exit_code == 2 and "use_dora" in r.output, r.output
    r = CliRunner().invoke(main, ["build", str(hf_folder("llama")), "--lora", str(tmp_path / "nowhere")])
    assert r.exit_code == 2 and "'--lora'" in r.output and "does not exist" in r.output, r.output
