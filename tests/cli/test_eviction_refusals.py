"""Importance-eviction settings refused from the CLI (issue 48 §4): `generate` and `serve` (the HTTP
front end) exit 2 before serving, naming the options; the fix a message names then runs. Before,
h2o with speculation ran and changed greedy text, and `--kv-observation-tokens 100000` was blamed on
--kv-recent-tokens with a budget above the context as the fix."""

from __future__ import annotations

import re

import pytest

H2O = ("--kv-eviction", "h2o", "--kv-budget-tokens", "32", "--kv-observation-tokens", "8")


def _words(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_h2o_with_speculation_exits_2_naming_both(invoke, text_build, command, monkeypatch):
    from kvexport.runtime.serving import server

    def served(*a, **k):
        raise AssertionError("the server started with the refused settings")

    monkeypatch.setattr(server, "serve", served)  # (serve would otherwise run until stopped)
    args = [command, text_build, *(["hello"] if command == "generate" else ["--port", "0"]), *H2O,
            "--speculative", "ngram"]
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    assert "--kv-eviction h2o cannot be combined with --speculative ngram" in _words(r.output)
    assert "Traceback" not in r.output


def test_an_observation_window_past_the_context_names_it_and_its_fix_runs(invoke, text_build):
    r = invoke("generate", text_build, "hello", "--max-tokens", "4", *H2O[:4], "--kv-observation-tokens", "100000")
    assert r.exit_code == 2, r.output
    msg = _words(r.output)
    # text_build: a 64-token context, blocks of 4; --kv-sink-tokens 4 is one block
    assert "--kv-observation-tokens 100000 (the observation window, always kept) + one block to evict is more than " \
           "the context (max_model_len 64)" in msg, msg
    bound = re.search(r"lower --kv-observation-tokens to <= (\d+)", msg)
    assert bound and bound.group(1) == "24", msg  # budget 32 - sinks 4 - one block 4
    r = invoke("generate", text_build, "hello", "--max-tokens", "4", *H2O[:4], "--kv-observation-tokens",
               bound.group(1))
    assert r.exit_code == 0, r.output
