"""The click CLI: help texts and a tiny build through the command line."""

from click.testing import CliRunner

from kvexport.cli import main


def test_help_lists_commands_with_descriptions():
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0
    for cmd in ("build", "inspect"):
        line = [l for l in r.output.splitlines() if l.strip().startswith(cmd)]
        assert line and len(line[0].split()) > 2, r.output


def test_build_and_inspect_tiny(hf_folder, tmp_path):
    out = tmp_path / "b"
    r = CliRunner().invoke(main, ["build", str(hf_folder("qwen2")), "--out", str(out), "--block-size", "8",
                                  "--max-seq-len", "64"])
    assert r.exit_code == 0, r.output
    verdicts = [l for l in r.output.splitlines() if l.startswith("validation (")]
    assert len(verdicts) in (1, 2) and all(": PASS (fp32 bound: |Δ| ≤ 0.001, greedy identical): max |Δ| " in v
                                           and "100.0% greedy agreement" in v for v in verdicts), r.output
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0 and "qwen2" in r.output and "block size 8" in r.output
    assert [l for l in r.output.splitlines() if l.startswith("validation (")] == verdicts


def test_recipe_options_and_flag_override(hf_folder, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("layout: contiguous\nmax_seq_len: 48\nvalidate: false\n")
    out = tmp_path / "b"
    r = CliRunner().invoke(main, ["build", str(hf_folder("llama")), "--out", str(out), "--recipe", str(recipe),
                                  "--max-seq-len", "40"])
    assert r.exit_code == 0, r.output
    from kvexport.manifest import load

    m = load(out)
    assert m.kv.layout == "contiguous" and m.kv.max_seq_len == 40 and m.validation is None


def test_existing_output_needs_force(hf_folder, tmp_path):
    args = ["build", str(hf_folder("llama")), "--out", str(tmp_path / "b"), "--no-validate", "--max-seq-len", "32"]
    assert CliRunner().invoke(main, args).exit_code == 0
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "--force" in r.output
    assert CliRunner().invoke(main, args + ["--force"]).exit_code == 0


def test_generate_command_on_a_tiny_build(hf_folder, tmp_path):
    """A tiny random model has no tokenizer, so text prompts are refused with a clear error."""
    out = tmp_path / "b"
    assert CliRunner().invoke(main, ["build", str(hf_folder("llama")), "--out", str(out), "--no-validate",
                                     "--max-seq-len", "64", "--block-size", "4"]).exit_code == 0
    r = CliRunner().invoke(main, ["generate", str(out), "hello", "--max-tokens", "4"])
    assert r.exit_code == 2 and "no tokenizer" in r.output
    r = CliRunner().invoke(main, ["generate", str(out), "hello", "--temperature", "-1"])
    assert r.exit_code == 2 and "temperature" in r.output


def test_recipe_carries_model_out_and_force(hf_folder, tmp_path):
    out = tmp_path / "from-recipe"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {hf_folder('llama')}\nout: {out}\nforce: true\nvalidate: false\nmax_seq_len: 32\n")
    for _ in range(2):  # the second run replaces the first because the recipe says force
        r = CliRunner().invoke(main, ["build", "--recipe", str(recipe)])
        assert r.exit_code == 0, r.output
    assert (out / "kvexport.json").is_file()


def test_quantized_defaults_and_the_exact_forms_one_flag_away(hf_folder, tmp_path):
    """`--weights int8` builds the fast CPU form (per-channel smoothquant, served int8 x int8) and
    `inspect` says so; `--weight-block-size 32` is the exact form (round-to-nearest blocks, int8
    pairs for large steps); `--weight-matmul-accuracy` records another serving default, and a
    serving command's flag overrides the recorded one."""
    from kvexport.manifest import load
    from kvexport.runtime.execution.ort_backends import ort_backend

    src = str(hf_folder("llama", num_key_value_heads=2))
    common = ["--no-validate", "--max-seq-len", "64", "--block-size", "4"]
    forms = {}
    for name, flags in (("int8", ["--weights", "int8", "--calibration-tokens", "64"]),
                        ("int8-b32", ["--weights", "int8", "--weight-block-size", "32"]),
                        ("int4-float", ["--weights", "int4", "--quant-method", "rtn", "--weight-matmul-accuracy",
                                        "float"])):
        r = CliRunner().invoke(main, ["build", src, "--out", str(tmp_path / name), *flags, *common])
        assert r.exit_code == 0, r.output
        q = load(tmp_path / name).weights.quantization
        forms[name] = (q.form(), q.matmul_accuracy)
        r = CliRunner().invoke(main, ["inspect", str(tmp_path / name)])
        served = [line for line in r.output.splitlines() if line.strip().startswith("served:")]
        assert r.exit_code == 0 and len(served) == 1, r.output
        forms[name] += (served[0].strip(),)
    assert forms["int8"][:2] == ("int8 per-channel, smoothquant", "int8")
    assert forms["int8"][2].startswith("served: onnxruntime CPU, weight_matmul_accuracy int8 (the build's default; "
                                       "--weight-matmul-accuracy auto|float to serve otherwise): every step: int8 x "
                                       "int8 MatMulIntegerToFloat")
    assert forms["int8-b32"][:2] == ("int8 blocks of 32, rtn", "auto") and "int8 pairs" in forms["int8-b32"][2]
    assert forms["int4-float"][:2] == ("int4 blocks of 32, rtn", "float")
    assert "every step: MatMulNBits (float activations, exact)" in forms["int4-float"][2]
    m = load(tmp_path / "int4-float")
    assert ort_backend(tmp_path / "int4-float", m, 8).accuracy == "float"  # the build's
    assert ort_backend(tmp_path / "int4-float", m, 8, accuracy="auto").large_form == "pair"  # the setting's
