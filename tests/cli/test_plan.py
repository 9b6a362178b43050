"""`kvexport plan` on the command line: the tables, `--json` (the library's Plan, key for key),
and errors that exit 2 naming the option or field."""

import json

from click.testing import CliRunner

from kvexport.cli import main
from kvexport.exporter.plan import plan

LLAMA3_70B = dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192,
                  rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False)


def _config(tmp_path, cfg=LLAMA3_70B):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_help_lists_plan():
    r = CliRunner().invoke(main, ["--help"])
    line = [l for l in r.output.splitlines() if l.strip().startswith("plan")]
    assert r.exit_code == 0 and line and "fit" in line[0], r.output
    r = CliRunner().invoke(main, ["plan", "--help"])
    assert r.exit_code == 0 and "--json keys" in r.output and "max_context" in r.output


def test_json_is_the_plan(invoke, tmp_path):
    cfg = _config(tmp_path)
    r = invoke("plan", cfg, "--memory", "80GiB", "--weights", "int4", "--max-num-seqs", "8", "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    want = plan(cfg, "80GiB", weights="int4", max_num_seqs=8).to_json()
    assert got == json.loads(json.dumps(want))
    fp16 = next(f for f in got["fits"] if (f["kv_dtype"], f["layout"]) == ("fp16", "paged"))
    assert (got["kv"][1]["bytes_per_token"], fp16["num_blocks"], fp16["max_seqs"]) == (327_680, 7771, 15)
    assert sorted(got) == sorted(["model", "source", "family", "model_type", "num_layers", "hidden_size", "num_heads",
                                  "num_kv_heads", "head_dim", "attention", "layer_windows", "max_positions",
                                  "weights", "build_weights", "kv", "block_size", "max_model_len", "max_num_seqs",
                                  "max_num_batched_tokens", "memory_bytes", "fit_weights", "fit_weights_bytes",
                                  "weights_fit", "fits", "notes", "state_bytes_per_seq", "linear_layers"])


def test_tables(invoke, tmp_path):
    r = invoke("plan", _config(tmp_path), "--memory", "24GiB")
    assert r.exit_code == 0, r.output
    assert "327,680 (320.0 KiB)" in r.stdout and "the weights alone do not fit" in r.stdout
    assert "seqs ×" not in r.stdout  # no table of zeros
    r = invoke("plan", _config(tmp_path), "--memory", "80GiB", "--weights", "int4", "--max-num-seqs", "8",
               env={"COLUMNS": "200"})  # one line a row
    assert r.exit_code == 0, r.output
    rows = [l.split() for l in r.stdout.splitlines() if l.startswith("fp16 ")]
    assert "seqs × 8192 tokens" in r.stdout and ["fp16", "paged", "37.9", "GiB", "7,771", "15", "8,192"] in [
        row[:7] for row in rows]
    r = invoke("plan", _config(tmp_path))  # no --memory: weights and KV only
    assert r.exit_code == 0 and "give --memory" in r.stdout and "seqs ×" not in r.stdout


def test_errors_exit_2_naming_what_to_fix(invoke, tmp_path):
    cfg = _config(tmp_path)
    r = invoke("plan", cfg, "--memory", "24 gigs")
    assert r.exit_code == 2 and "--memory: size '24 gigs'" in r.output
    r = invoke("plan", str(tmp_path / "missing"))
    assert r.exit_code == 2 and "does not exist" in r.output
    (tmp_path / "m").mkdir()
    r = invoke("plan", _config(tmp_path / "m", {"model_type": "mamba"}))
    assert r.exit_code == 2 and "config field 'model_type' is 'mamba'" in r.output
    r = invoke("plan", cfg, "--weights", "int2")
    assert r.exit_code == 2 and "--weights" in r.output


def test_a_build(invoke, text_build):
    """A build is read from its manifest: its weights file, block size and context; its own row marked."""
    r = invoke("plan", text_build, "--memory", "1MiB", "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["source"] == "build" and got["block_size"] == 4 and got["max_model_len"] == 64
    assert got["fit_weights_bytes"] == got["build_weights"]["bytes"]
    assert [(f["kv_dtype"], f["layout"]) for f in got["fits"] if f["build"]] == [("fp32", "paged")]
    r = invoke("plan", text_build, "--max-model-len", "65")
    assert r.exit_code == 2 and "--max-model-len 65 exceeds the build's max_seq_len 64" in r.output
    r = invoke("plan", text_build, "--block-size", "16")
    assert r.exit_code == 2 and "--block-size 16 differs from the build's 4" in r.output
