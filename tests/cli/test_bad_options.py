"""Out-of-range numbers, malformed recipes, paths that cannot be written and other bad input to
build / bench / calibrate / inspect / engines: exit code 2 and a message naming the option or
field; never a traceback. (generate: tests/cli/test_generate.py.)"""

import json
import os

import pytest

BIG = str(10**12)


@pytest.fixture(scope="module")
def int8_build(text_model, tmp_path_factory):
    from kvexport import io
    from kvexport.exporter.build import BuildOptions, build

    out, _ = build(str(text_model), tmp_path_factory.mktemp("int8") / "b",
                   BuildOptions(kv_dtype=io.DType.INT8, block_size=4, max_seq_len=64, validate=False,
                                calibration_tokens=64))
    return out


def expect_refusal(r, *words):
    assert r.exit_code == 2, r.output[-1500:]
    assert "Traceback" not in r.output and "internal error" not in r.output, r.output[-1500:]
    for w in words:
        assert w in r.output, (w, r.output[-1500:])


@pytest.mark.parametrize("args,words", [
    (["--block-size", "0"], ["'--block-size': 0 is not in the range 1<=x<=1024"]),
    (["--block-size", "-1"], ["'--block-size'"]),
    (["--block-size", BIG], ["'--block-size'"]),
    (["--max-seq-len", "0"], ["'--max-seq-len': 0 is not in the range 2<=x<=262144"]),
    (["--max-seq-len", BIG], ["'--max-seq-len'"]),
    (["--kv-dtype", "int8", "--calibration-tokens", "0"], ["'--calibration-tokens'"]),
    (["--kv-dtype", "int8", "--calibration-tokens", BIG], ["'--calibration-tokens'"]),
    (["--calibration-tokens", "64"], ["only apply to --kv-dtype int8"]),
    (["--dtype", "int8"], ["'--dtype'"]),
    (["--layout", "contiguous", "--attention", "plugin"], ["--attention plugin needs --layout paged"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0].startswith("-") else None)
def test_build_option_ranges(invoke, hf_folder, tmp_path, args, words):
    expect_refusal(invoke("build", hf_folder("llama"), "--out", tmp_path / "b", "--no-validate", *args), *words)
    assert not (tmp_path / "b").exists()


def test_build_paths(invoke, hf_folder, tmp_path):
    model = hf_folder("llama")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    expect_refusal(invoke("build", model, "--out", a_file / "b"), "'--out'", "is a file, not a folder")
    expect_refusal(invoke("build", model, "--out", tmp_path / ("n" * 300)), "'--out'", "longer than 255 bytes")
    expect_refusal(invoke("build", model, "--out", f"{tmp_path}/a\0b"), "'--out'", "NUL")
    expect_refusal(invoke("build", model, "--out", ""), "'--out'")
    expect_refusal(invoke("build", model, "--out", f"{tmp_path}/\ud800"), "'--out'", "cannot be a file name")
    expect_refusal(invoke("build", "\ud800", "--out", tmp_path / "b"), "is neither a folder")
    expect_refusal(invoke("build", "", "--out", tmp_path / "b"), "MODEL", "is empty")
    expect_refusal(invoke("build", tmp_path / "missing", "--out", tmp_path / "b"), "is neither a folder")
    expect_refusal(invoke("build", model, "--out", tmp_path / "b", "--kv-dtype", "int8", "--calibration-text",
                          tmp_path / "none.txt"), "'--calibration-text'", "does not exist")


def test_int8_default_without_calibration_text(invoke, text_model, tmp_path, monkeypatch):
    """--weights int8 defaults to per-channel smoothquant, whose scales are searched on text: with
    no text installed the build stops before quantizing, saying why and what to do, and leaves
    nothing at --out; the exact form (--weight-block-size 32, round-to-nearest) needs none."""
    monkeypatch.setenv("KVEXPORT_TEXT_DIR", str(tmp_path / "no-texts"))
    expect_refusal(invoke("build", text_model, "--out", tmp_path / "b", "--weights", "int8", "--no-validate"),
                   "--weights int8 defaults to --weight-block-size channel --quant-method smoothquant",
                   "scripts/fetch_texts.sh", "--calibration-text FILE", "--weight-block-size 32")
    assert not (tmp_path / "b").exists()
    r = invoke("build", text_model, "--out", tmp_path / "b32", "--weights", "int8", "--weight-block-size", "32",
               "--no-validate", "--block-size", "4", "--max-seq-len", "64")
    assert r.exit_code == 0, r.output[-1500:]


def test_build_out_in_a_folder_it_cannot_write(invoke, hf_folder, tmp_path, monkeypatch):
    """Permission bits do not stop root (these machines run tests as root): os.access decides."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(tmp_path) else real(p, mode, **kw))
    expect_refusal(invoke("build", hf_folder("llama"), "--out", tmp_path / "x" / "b"), "'--out'",
                   f"cannot write in {tmp_path} (permission denied)")


@pytest.mark.parametrize("text,words", [
    ("blocksize: 3\n", "unknown option(s) blocksize"),
    ("block_size: x\n", "block_size must be an integer, got 'x'"),
    ("block_size: true\n", "block_size must be an integer, got True"),
    ("block_size: 0\n", "block_size must be in 1..1024, got 0"),
    ("max_seq_len: 1000000000\n", "max_seq_len must be in 2..262144"),
    ("layout: ring\n", "layout must be one of contiguous, paged, got 'ring'"),
    ("layout: [paged]\n", "layout must be a string, got ['paged']"),
    ("validate: maybe\n", "validate must be true or false, got 'maybe'"),
    ("out: ''\n", "out must be a non-empty string"),
    ("engines: 5\n", "engines must be a mapping"),
    ("engines:\n  max_seqs: 4\n", "engines: unknown option 'max_seqs'"),
    ("engines:\n  max_num_seqs: x\n", "engines.max_num_seqs must be an integer, got 'x'"),
    ("engines:\n  max_num_seqs: 0\n", "engine option max_num_seqs must be >= 1, got 0"),
    ("engines:\n  precision: int4\n", "engines.precision must be one of fp32, fp16, bf16"),
    ("1: 2\n", "unknown option(s) 1"),
    ("- a\n", "must be a mapping"),
    ("layout: [1, 2\n", "not valid YAML"),
])
def test_bad_recipes_name_the_key(invoke, hf_folder, tmp_path, text, words):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    expect_refusal(invoke("build", hf_folder("llama"), "--recipe", recipe), f"recipe {recipe}", words)


def test_unreadable_recipes(invoke, tmp_path):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    expect_refusal(invoke("build", "--recipe", binary), "cannot read recipe", "utf-8")
    expect_refusal(invoke("build", "--recipe", tmp_path), "cannot read recipe", "Is a directory")
    expect_refusal(invoke("build", "--recipe", tmp_path / "none"), "cannot read recipe")


@pytest.mark.parametrize("args,words", [
    (["--limit", "0"], ["'--limit': 0 is not in the range x>=1"]),
    (["--limit", "-1"], ["'--limit': -1 is not in the range x>=1"]),
    (["--arrival-rate", "0"], ["'--arrival-rate'"]),
    (["--arrival-rate", "nan"], ["'--arrival-rate': nan is not a finite number"]),
    (["--arrival-rate", "inf"], ["'--arrival-rate'"]),
    (["--prefix-ttft", "0"], ["'--prefix-ttft'"]),
    (["--trace", "nope"], ["trace 'nope' is neither a readable file nor a shipped trace"]),
    (["--limit", "1", "--kv-cache-memory", "999TiB"], ["more than this machine's memory"]),
    (["--limit", "1", "--threads", "-3"], ["threads must be an integer >= 1"]),
])
def test_bench_arguments(invoke, text_build, args, words):
    expect_refusal(invoke("bench", text_build, *args), *words)


def test_bench_traces_and_json_paths(invoke, text_build, tmp_path):
    bad = tmp_path / "t.json"
    for trace, words in [({"seed": 1, "requests": [{"prompt_len": -4, "output_len": 3}]}, "in 1..1048576"),
                         ([1, 2], "malformed"), ({"seed": "x", "requests": []}, "seed 'x'"),
                         ({"seed": 1, "requests": []}, "at least one request")]:
        bad.write_text(json.dumps(trace))
        expect_refusal(invoke("bench", text_build, "--trace", bad), "is malformed", words)
    expect_refusal(invoke("bench", text_build, "--limit", 1, "--json", tmp_path), "'--json'", "is a directory")
    (tmp_path / "f").write_text("")
    expect_refusal(invoke("bench", text_build, "--limit", 1, "--json", tmp_path / "f" / "x.json"), "'--json'")


def test_bench_whose_requests_are_all_refused(invoke, text_build, tmp_path):
    """mixed-64's prompts (16..512 tokens) do not fit a 64-token build: the figures are printed,
    then the failure (before: an IndexError once the last request was refused)."""
    r = invoke("bench", text_build, "--limit", 2, "--json", tmp_path / "r.json")
    expect_refusal(r, "error: ")
    assert json.loads((tmp_path / "r.json").read_text())["requests"] == 2


def test_calibrate_arguments(invoke, int8_build, text_build, tmp_path):
    expect_refusal(invoke("calibrate", text_build), "only int8 builds have scales")
    expect_refusal(invoke("calibrate", int8_build, "--tokens", 0), "'--tokens'")
    expect_refusal(invoke("calibrate", int8_build, "--tokens", BIG), "'--tokens'")
    expect_refusal(invoke("calibrate", int8_build, "--text", tmp_path / "none.txt"), "'--text'")
    (tmp_path / "empty").mkdir()
    before = (int8_build / "kvexport.json").read_bytes()
    # an unusable --model is refused, not silently replaced by the recorded source
    expect_refusal(invoke("calibrate", int8_build, "--model", tmp_path / "empty"), f"--model {tmp_path / 'empty'}",
                   "has no config.json")
    expect_refusal(invoke("calibrate", int8_build, "--model", tmp_path / "missing"), "--model", "is neither a folder")
    assert (int8_build / "kvexport.json").read_bytes() == before


def test_inspect_and_engines_arguments(invoke, text_build, tmp_path):
    (tmp_path / "empty").mkdir()
    expect_refusal(invoke("inspect", tmp_path / "missing"), "does not exist")
    expect_refusal(invoke("inspect", tmp_path / "empty"), "has no kvexport.json")
    expect_refusal(invoke("inspect", f"{tmp_path}/x\0"), "NUL")
    for args, words in [(["--max-num-seqs", "0"], "'--max-num-seqs'"),
                        (["--max-num-blocks", "1"], "'--max-num-blocks'"), (["--max-seq-len", "-5"], "'--max-seq-len'"),
                        (["--max-num-batched-tokens", BIG, "--max-num-seqs", "abc"], "'--max-num-seqs'")]:
        expect_refusal(invoke("engines", text_build, *args), words)
    expect_refusal(invoke("engines", text_build), "fp16")  # an fp32 build: the plugin kernels take fp16


def test_bench_json_schema(invoke, text_build, tmp_path):
    """`kvexport bench --json-schema`: every request constrained (an enum of two strings: each output ends
    where the grammar does, before its output length); a file that is not JSON, or with --chat, is refused."""
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"seed": 3, "requests": [{"prompt_len": 8, "output_len": 12}] * 3}))
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"enum": ["ab", "cd"]}))
    r = invoke("bench", text_build, "--trace", trace, "--json-schema", schema, "--json", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["structured"]["finished_by_grammar"] == 3 and res["structured"]["compile_s"] >= 0
    assert res["output_tokens"] < 3 * 12  # cut by the grammar, not by the trace's lengths
    schema.write_text("{not json")
    expect_refusal(invoke("bench", text_build, "--trace", trace, "--json-schema", schema), "--json-schema",
                   "not a readable JSON schema file")
    expect_refusal(invoke("bench", text_build, "--chat", "2x2x16", "--json-schema", trace), "--json-schema",
                   "not to --chat")
