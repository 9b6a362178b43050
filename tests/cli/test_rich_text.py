"""Rich never interprets user or error text: "[...]" and ":name:" in messages, paths, prompts
and manifests print literally (before: `kvexport[tensorrt]` printed as `kvexport`, and a path
containing `[/old]` crashed the CLI with a MarkupError)."""

import json

import pytest

ODD = ["x[/old]", "[bold]y[/bold]", "a:smile:b", "[red", "back\\slash[/]"]


def test_error_message_brackets_print_literally(invoke, hf_folder, tmp_path):
    r = invoke("build", hf_folder("llama"), "--out", tmp_path / "b", "--backend", "tensorrt", "--dtype", "fp16",
               "--no-validate", "--max-seq-len", 32, "--block-size", 4)
    assert r.exit_code == 2, r.output
    assert 'pip install "kvexport[tensorrt]"' in r.stderr  # TensorRT is not installed on these machines


@pytest.mark.parametrize("name", ODD)
def test_missing_model_path_with_markup(invoke, tmp_path, name):
    r = invoke("build", tmp_path / name / "model", "--out", tmp_path / "b", "--no-validate")
    assert r.exit_code == 2, r.output
    assert repr(str(tmp_path / name / "model")) in r.stderr and "Traceback" not in r.output  # quoted by the message


@pytest.mark.parametrize("name", ODD)
def test_build_and_inspect_in_a_folder_with_markup(invoke, hf_folder, tmp_path, name):
    out = tmp_path / name / "b"
    r = invoke("build", hf_folder("llama"), "--out", out, "--no-validate", "--max-seq-len", 32, "--block-size", 4)
    assert r.exit_code == 0, r.output
    assert f"build ready: {out}" in r.stderr
    r = invoke("inspect", out)
    assert r.exit_code == 0, r.output
    assert str(out) in r.stdout


def test_manifest_text_prints_literally(invoke, hf_folder, tmp_path):
    out = tmp_path / "b"
    assert invoke("build", hf_folder("llama"), "--out", out, "--no-validate", "--max-seq-len", 32,
                  "--block-size", 4).exit_code == 0
    m = json.loads((out / "kvexport.json").read_text())
    m["notes"] = ["see [/old] and [bold]this[/bold] :smile:"]
    m["source"]["name"] = "model[v2]"
    (out / "kvexport.json").write_text(json.dumps(m))
    r = invoke("inspect", out)
    assert r.exit_code == 0, r.output
    assert "note: see [/old] and [bold]this[/bold] :smile:" in r.stdout and "model[v2]" in r.stdout


def test_recipe_error_with_brackets(invoke, tmp_path):
    recipe = tmp_path / "r[1].yaml"
    recipe.write_text("layout: [paged]\n")
    r = invoke("build", "--recipe", recipe)
    assert r.exit_code == 2, r.output
    assert "r[1].yaml" in r.stderr and "['paged']" in r.stderr
