"""`kvexport generate`: a failed request is exit code 2 with a short message on stderr (the
prompt is never echoed whole); stdout carries the answers only, separated when there are
several."""

import pytest


def test_one_prompt_answers_on_stdout_only(invoke, text_build):
    r = invoke("generate", text_build, "Hello", "--max-tokens", 4)
    assert r.exit_code == 0, r.output
    assert r.stdout.endswith("\n") and r.stdout.count("\n") == 1  # the answer (may be empty) and its newline
    assert "[1/1]" not in r.stderr and "finish:" in r.stderr


def test_empty_prompt_is_an_error(invoke, text_build):
    r = invoke("generate", text_build, "")
    assert r.exit_code == 2, r.output
    assert r.stdout == ""
    assert r.stderr.startswith("error: prompt 1 ('')") and "empty" in r.stderr


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
def test_prompt_longer_than_the_context(invoke, text_build, stream):
    prompt = "word " * 10_800  # 54,000 characters, far beyond the 64-token context
    r = invoke("generate", text_build, prompt, *(["--stream"] if stream else []))
    assert r.exit_code == 2, r.output[-500:]
    assert r.stdout == ""  # not even a bare newline
    assert "54000 tokens" in r.stderr and "64" in r.stderr  # what the engine says: tokens vs context
    assert len(r.stderr) < 400 and "(54000 characters)" in r.stderr  # the prompt clipped, its length named


def test_several_prompts_are_separated_and_one_failure_fails_the_run(invoke, text_build):
    r = invoke("generate", text_build, "Hello", "", "abc", "--max-tokens", 3)
    assert r.exit_code == 2, r.output
    err = r.stderr.splitlines()
    assert [l.split()[0] for l in err if l.startswith("[")] == ["[1/3]", "[2/3]", "[3/3]"]
    assert any(l.startswith("error: prompt 2 ('')") for l in err)
    assert r.stdout.count("\n\n") >= 1  # a blank line after the first answer; the failed one prints nothing
    assert "Traceback" not in r.output


def test_stream_serves_every_prompt(invoke, text_build):
    r = invoke("generate", text_build, "Hi", "there", "--stream", "--max-tokens", 3)
    assert r.exit_code == 0, r.output
    assert "[1/2]" in r.stderr and "[2/2]" in r.stderr
    assert r.stdout.endswith("\n") and "\n\n" in r.stdout


@pytest.mark.parametrize("args,words", [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-k", "-1"], "top_k"),
    (["--seed", "-5"], "seed"),
    (["--stop", ""], "stop"),
    (["--threads", "-3"], "threads"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--max-model-len", "1"], "max_model_len"),
    (["--kv-cache-memory", "1e30"], "size '1e30'"),
    (["--kv-cache-memory", "999TiB"], "more than this machine's memory"),
    (["--kv-cache-memory", "95%"], "percentage"),
    (["--kv-cache-memory", "0"], "kv_cache_memory '0' is 0 bytes"),
    (["--cuda-graph-batch-sizes", "a,b"], "comma-separated"),
    (["--backend", "cuda"], "--backend"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_bad_generate_options(invoke, text_build, args, words):
    r = invoke("generate", text_build, "Hello", *args)
    assert r.exit_code == 2, r.output
    assert words in r.output and "Traceback" not in r.output


def test_prompt_bytes_that_are_not_utf8(invoke, text_build):
    """What Python makes of argv bytes that are not UTF-8 (surrogate escapes)."""
    r = invoke("generate", text_build, "caf\udce9")
    assert r.exit_code == 2 and "not valid UTF-8" in r.output


def test_odd_characters_in_prompts(invoke, text_build):
    r = invoke("generate", text_build, "[bold]x[/bold] :smile: \x00 é 日本 \t\n", "--max-tokens", 2)
    assert r.exit_code == 0, r.output
