"""hypothesis-generated arguments for `kvexport build` and `kvexport generate` on a tiny model,
run in process: whatever the values (ints negative or huge, floats incl. nan/inf, odd strings,
paths with odd characters), the CLI answers with exit code 0, or 2 and an error line; never an
exception, a traceback or the "internal error" of kvexport/cli/__init__.py's last-resort handler.
Bounded: a few dozen examples each, `--no-validate`, a 2-layer model (~1 minute on 2 cores)."""

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvexport.cli import main

FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

# what argv can carry: any text but surrogates (tests/cli/test_generate.py has the non-UTF-8 case)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
NAME = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0"), min_size=1, max_size=30)
INTS = st.one_of(st.integers(-3, 300), st.integers(-2**70, 2**70), st.sampled_from([0, 1, 2, 1024, 1025, 2**31]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1.0, 1e-300]))
ODD = st.one_of(TEXT, st.sampled_from(["", " ", "-1", "1e30", "[bold]", "--force", "NaN", "0x10"]))


def value(ints=INTS):
    """An option value as argv has it: an int, a float or any text."""
    return st.one_of(ints.map(str), FLOATS.map(repr), ODD)


def check(result) -> None:
    out = result.output
    event(f"exit code {result.exit_code}")  # pytest --hypothesis-show-statistics: the share that ran
    assert result.exit_code in (0, 2), (result.exit_code, out[-2000:], result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in out and "internal error" not in out, out[-2000:]
    if result.exit_code == 2:
        assert any(l.startswith(("error: ", "Error: ")) for l in out.splitlines()), out[-2000:]


BUILD_OPTIONS = {
    "--block-size": value(), "--max-seq-len": value(st.one_of(INTS, st.integers(2, 512))),
    "--calibration-tokens": value(), "--layout": st.one_of(st.sampled_from(["paged", "contiguous"]), ODD),
    "--dtype": st.one_of(st.sampled_from(["fp32", "fp16"]), ODD),
    "--attention": st.one_of(st.sampled_from(["onnx", "plugin"]), ODD),
    "--kv-dtype": st.one_of(st.sampled_from(["fp32", "fp16", "int8", "int4"]), ODD),
    "--backend": st.one_of(st.sampled_from(["onnxruntime", "tensorrt"]), ODD),
}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-out")


@FUZZ
@given(options=st.dictionaries(st.sampled_from(sorted(BUILD_OPTIONS)), st.just(None), max_size=4).flatmap(
    lambda d: st.fixed_dictionaries({k: BUILD_OPTIONS[k] for k in d})), name=NAME)
def test_build_arguments(hf_folder, out_root, options, name):
    args = ["build", str(hf_folder("llama", num_key_value_heads=2)), "--out", str(out_root / name), "--no-validate",
            "--force"]
    if "--max-seq-len" not in options:
        args += ["--max-seq-len", "32"]  # keeps valid builds small
    for k, v in options.items():
        args += [k, v]
    check(CliRunner().invoke(main, args))


GENERATE_OPTIONS = {
    "--max-tokens": value(st.one_of(INTS, st.integers(1, 8))), "--temperature": value(),
    "--top-p": value(), "--top-k": value(), "--seed": value(), "--stop": ODD,
    "--kv-cache-memory": st.one_of(ODD, st.sampled_from(["1MiB", "999TiB", "50%", "0", "1B", "1.5GiB", "100%"]),
                                   INTS.map(str)),
    "--threads": value(), "--max-num-seqs": value(), "--max-num-batched-tokens": value(),
    "--max-model-len": value(), "--cuda-graph-batch-sizes": ODD,
}


@FUZZ
@given(prompts=st.lists(st.one_of(TEXT, st.sampled_from(["", "x" * 5000, "Hello"])), min_size=1, max_size=3),
       options=st.dictionaries(st.sampled_from(sorted(GENERATE_OPTIONS)), st.just(None), max_size=4).flatmap(
           lambda d: st.fixed_dictionaries({k: GENERATE_OPTIONS[k] for k in d})),
       stream=st.booleans())
def test_generate_arguments(text_build, prompts, options, stream):
    args = ["generate", str(text_build), *prompts]
    if "--max-tokens" not in options:
        args += ["--max-tokens", "4"]
    if stream:
        args.append("--stream")
    for k, v in options.items():
        args += [k, v]
    check(CliRunner().invoke(main, args))

