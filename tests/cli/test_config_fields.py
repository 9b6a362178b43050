"""Hostile config.json files (issue 31 §5): `kvexport plan` and `kvexport build` read a config through
one reader (exporter/source.py config_json, exporter/config_fields.py) and refuse the same files the same
way: exit 2, the field at fault and its allowed range named, before transformers or any arithmetic sees
them. Before: huge counts and a 5,000-digit integer ended in an internal error (exit 1), a config nested
100,000 deep in a RecursionError, `head_dim: 2**63` was planned, `max_position_embeddings: 1` blamed
--max-model-len (and built), zero heads gave a bare ZeroDivisionError, missing MLA fields took
transformers' defaults."""

import json
import shutil

import pytest

FIVE_THOUSAND_DIGITS = "1" + "0" * 4999


def _hostile(hf_folder, tmp_path, family: str, patch: str | None, drop: tuple[str, ...] = ()) -> str:
    """A copy of the tiny `family` folder whose config.json ends with the raw JSON text `patch`
    (the key it sets removed first) and lacks the fields `drop`."""
    d = tmp_path / "src"
    shutil.copytree(hf_folder(family), d)
    cfg = json.loads((d / "config.json").read_text())
    for name in drop:
        cfg.pop(name, None)
    if patch is not None:
        cfg.pop(patch.split(":")[0].strip().strip('"'), None)
    text = json.dumps(cfg)
    (d / "config.json").write_text(text if patch is None else text[:-1] + ", " + patch + "}")
    return str(d)


MLA = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
CASES = [  # (family, raw JSON patch, fields dropped, words the message must hold)
    ("llama", '"num_hidden_layers": 1e30', (), "'num_hidden_layers' of {cfg} must be an integer in 1..1,024, "
                                               "got float"),
    ("llama", f'"num_hidden_layers": {2**63}', (), "'num_hidden_layers' of {cfg} must be an integer in 1..1,024, got "
                                                   "9223372036854775808"),
    ("llama", f'"num_hidden_layers": {FIVE_THOUSAND_DIGITS}', (), "'num_hidden_layers' of {cfg} must be an integer in "
                                                                  "1..1,024, got an integer of 5,000 digits"),
    ("llama", '"num_hidden_layers": true', (), "'num_hidden_layers' of {cfg} must be an integer in 1..1,024, got bool"),
    ("llama", '"num_attention_heads": 0', (), "'num_attention_heads' of {cfg} must be an integer in 1..1,024, got 0"),
    ("llama", '"num_key_value_heads": 0', (), "'num_key_value_heads' of {cfg} must be an integer in 1..1,024, got 0"),
    ("llama", '"head_dim": 1e30', (), "'head_dim' of {cfg} must be an integer in 1..4,096, got float"),
    ("llama", f'"head_dim": {2**63}', (), "'head_dim' of {cfg} must be an integer in 1..4,096"),
    ("llama", f'"hidden_size": {2**63}', (), "'hidden_size' of {cfg} must be an integer in 1..1,048,576"),
    ("llama", f'"intermediate_size": {2**63}', (), "'intermediate_size' of {cfg} must be an integer in 1..4,194,304"),
    ("llama", '"vocab_size": 1e30', (), "'vocab_size' of {cfg} must be an integer in 1..16,777,216, got float"),
    ("llama", '"max_position_embeddings": 1', (), "'max_position_embeddings' of {cfg} must be an integer in "
                                                  "2..16,777,216, got 1"),
    ("llama", f'"rope_theta_note": [{FIVE_THOUSAND_DIGITS}]', (), "'rope_theta_note[0]' of {cfg} is an integer of "
                                                                  "5,000 digits"),
    ("llama", '"x": ' + "[" * 100_000 + "]" * 100_000, (), "{cfg} is nested too deeply"),
    ("deepseek_v3", '"n_routed_experts": 1e30', (), "'n_routed_experts' of {cfg} must be an integer in 1..4,096, "
                                                    "got float"),
    ("deepseek_v3", f'"n_routed_experts": {2**63}', (), "'n_routed_experts' of {cfg} must be an integer in 1..4,096"),
    ("deepseek_v3", None, MLA, "'kv_lora_rank' of {cfg} is missing"),
    ("deepseek_v3", None, ("v_head_dim",), "'v_head_dim' of {cfg} is missing"),
]


@pytest.mark.parametrize("command", ["plan", "build"])
@pytest.mark.parametrize("family, patch, drop, words", CASES)
def test_hostile_configs_exit_2_naming_the_field(hf_folder, invoke, tmp_path, command, family, patch, drop, words):
    src = _hostile(hf_folder, tmp_path, family, patch, drop)
    args = ["--memory", "1GiB"] if command == "plan" else ["--out", tmp_path / "b", "--no-validate"]
    r = invoke(command, src, *args)
    message = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert words.format(cfg=f"{src}/config.json") in message, message
    assert "internal error" not in message and "Traceback" not in message
    assert not (tmp_path / "b").exists()


def test_a_config_in_range_still_plans_and_reads(hf_folder, invoke, tmp_path):
    """The bounds are far above real models: the tiny models and a 1M-position, 256-expert one pass."""
    src = _hostile(hf_folder, tmp_path, "deepseek_v3", '"max_position_embeddings": 1048576')
    assert invoke("plan", src, "--memory", "1GiB").exit_code == 0
    assert invoke("plan", hf_folder("llama"), "--memory", "1GiB").exit_code == 0
