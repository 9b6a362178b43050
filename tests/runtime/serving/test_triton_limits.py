"""The Triton model's integer inputs and request limits. Triton's HTTP front end casts a JSON
number to the declared input type without a range check, so every integer input is INT64 and
range-checked by the model (before: INT32, and `max_tokens` 2**32 + 3 was served as 3); the
OpenAI path's limits (stop strings, the request size) apply to Triton too, checked before
anything is tokenized. In process (`parse_request`), then over the real `tritonserver`
(`kvexport triton-serve`, HTTP /generate and gRPC)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvexport.runtime.config import EngineConfig
from kvexport.runtime.serving import openai_protocol, triton_model
from kvexport.runtime.serving.requests import RequestParser
from kvexport.runtime.serving.triton_model import INPUTS, MAX_TEXT_BYTES, RequestError, parse_request
from kvexport.runtime.serving.triton_repo import TritonRepoOptions, write_repository

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[3]
TRITON_ENV = Path(os.environ.get("KVEXPORT_TRITON_ENV", REPO_ROOT / ".venv-triton"))
I64 = lambda *v: np.array(v, np.int64)  # noqa: E731


def test_every_integer_input_is_int64():
    assert {name: dtype for name, dtype, *_ in INPUTS if "INT" in dtype} == {
        "input_ids": "TYPE_INT64", "max_tokens": "TYPE_INT64", "top_k": "TYPE_INT64", "seed": "TYPE_INT64",
        "kv_budget_tokens": "TYPE_INT64"}


def test_the_limits_are_one_set_of_constants_in_requests():
    """The body/text size and stop-string limits are defined once (runtime/serving/requests.py,
    no FastAPI there) and imported by `kvexport serve` and the Triton model, not copied."""
    import ast
    import inspect

    from kvexport.runtime.serving import requests, server

    assert MAX_TEXT_BYTES is server.MAX_BODY_BYTES is requests.MAX_BODY_BYTES  # one object: 1 << 20 is not interned
    for name in ("MAX_STOP_STRINGS", "MAX_STOP_CHARS"):
        assert getattr(triton_model, name) is getattr(openai_protocol, name) is getattr(requests, name)
    names = {"MAX_BODY_BYTES", "MAX_STOP_STRINGS", "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS"}
    for module in (server, openai_protocol, triton_model):  # small ints are shared objects anyway: no assignment
        tree = ast.parse(inspect.getsource(module))
        assigned = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
                    if isinstance(t, ast.Name)}
        assert not assigned & names, (module.__name__, assigned & names)


class CountingTokenizer:
    """A tokenizer stand-in that counts its calls (one token a character)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, text):
        self.calls += 1
        return {"input_ids": [5] * len(text)}


@pytest.mark.parametrize("arrays, msg", [
    ({"input_ids": I64(1, 2), "max_tokens": I64(2**31)}, r"max_tokens must be in \[1, 100\].*got 2147483648"),
    ({"input_ids": I64(1, 2), "max_tokens": I64(2**32 + 3)}, "got 4294967299"),  # INT32 made it 3
    ({"input_ids": I64(1, 2), "max_tokens": I64(-(2**40))}, "max_tokens"),
    ({"input_ids": I64(1, 2**32 + 1)}, "token id 4294967297 is outside"),  # INT32 made it 1
    ({"input_ids": I64(1, 2), "seed": I64(-1)}, "seed must be a non-negative integer"),
    ({"input_ids": I64(1, 2), "top_k": I64(-(2**33))}, "top_k must be an integer >= 0"),
    ({"input_ids": I64(1, 2), "seed": np.array([1.0], np.float32)}, "must be INT64, got numpy dtype float32"),
])
def test_integer_inputs_are_range_checked(arrays, msg):
    with pytest.raises(RequestError, match=msg):
        parse_request(arrays, RequestParser(None, 50, 100))


def test_a_repository_written_before_int64_still_sends_unsigned_seeds():
    """A repository written before the split declares seed UINT64 (and the rest INT32) and loads
    this same model code: unsigned and 32-bit integers are taken and range-checked like INT64."""
    arrays = {"input_ids": np.array([1, 2], np.int32), "seed": np.array([7], np.uint64),
              "max_tokens": np.array([3], np.int32)}
    prompt, params, _ = parse_request(arrays, RequestParser(None, 50, 100))
    assert (prompt, params.seed, params.max_tokens) == ([1, 2], 7, 3)
    with pytest.raises(RequestError, match="max_tokens"):
        parse_request({**arrays, "max_tokens": np.array([0], np.uint32)}, RequestParser(None, 50, 100))


def test_limits_are_checked_before_tokenizing():
    tok = CountingTokenizer()
    parser = RequestParser(tok, 50, 100)
    text = lambda s: np.array([s], dtype=object)  # noqa: E731
    cases = [
        ({"text_input": text(b"x" * (MAX_TEXT_BYTES + 1))}, "text_input", "bytes is more than"),
        ({"text_input": text(b"hi"), "stop": np.array([b"s"] * 100_000, dtype=object)}, "stop", "got 100000 strings"),
        ({"text_input": text(b"hi"), "stop": np.array([b"s" * 5000], dtype=object)}, "stop", "5000 bytes"),
        ({"text_input": text(b"hi"), "stop": np.array(["\u00e9" * 257], dtype=object)}, "stop", "257 characters"),
        ({"input_ids": np.ones(10_000_000, np.int64)}, "input_ids", "context holds 100"),
    ]
    for arrays, param, msg in cases:
        t0 = time.perf_counter()
        with pytest.raises(RequestError, match=msg) as e:
            parse_request(arrays, parser)
        assert e.value.param == param and time.perf_counter() - t0 < 0.5, (param, msg)
    assert tok.calls == 0  # none was tokenized
    # within the limits: served
    prompt, params, _ = parse_request({"text_input": text(b"hi"), "stop": np.array([b"a"] * 16, dtype=object)},
                                      parser)
    assert prompt == [5, 5] and params.stop == ("a",) * 16


# ---- the real server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def triton(chat_build, tmp_path_factory, free_ports):
    """`kvexport triton-serve` of the tiny chat build (a tokenizer, context 64): its HTTP and gRPC ports."""
    if not (TRITON_ENV / "bin" / "python3").exists():
        pytest.skip(f"no Triton execution environment at {TRITON_ENV}: run scripts/install.sh --dev")
    d = tmp_path_factory.mktemp("triton-limits")
    write_repository(chat_build, d / "repo", TritonRepoOptions(
        engine=EngineConfig(kv_cache_memory="1MiB", threads=1), name="m", execution_env=str(TRITON_ENV)))
    http, grpc, metrics = free_ports(3)
    log = d / "triton-serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvexport.cli", "triton-serve", str(d / "repo"), "--triton-env",
                                 str(TRITON_ENV), "--http-port", str(http), "--grpc-port", str(grpc),
                                 "--metrics-port", str(metrics)], stdout=f, stderr=subprocess.STDOUT, cwd=d,
                                env=dict(os.environ, COLUMNS="400"))
    try:
        deadline = time.monotonic() + 180
        while "Triton serving" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-5000:]
            time.sleep(0.2)
        yield http, grpc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_out_of_range_json_integers_are_refused_not_wrapped(triton):
    http, _ = triton
    url = f"http://{HOST}:{http}/v2/models/m/generate"
    ok = {"input_ids": [1, 2, 3], "max_tokens": 3}
    for body, expect in [
            ({"max_tokens": 2**31}, "max_tokens must be in [1, 64] (this deployment's context), got 2147483648"),
            ({"max_tokens": 2**32 + 3}, "got 4294967299"),  # INT32: served 3 tokens
            ({"input_ids": [1, 2**32 + 1]}, "token id 4294967297 is outside"),  # INT32: token 1
            ({"seed": -1}, "seed must be a non-negative integer"),
            ({"top_k": -(2**32) + 1}, "top_k must be an integer >= 0"),  # INT32: top_k 1
            ({"max_tokens": 2**63}, "attempt to access JSON non-signed-integer"),  # Triton's own refusal
    ]:
        r = httpx.post(url, json={**ok, **body}, timeout=60)
        assert expect in r.text, (body, r.text)
    r = httpx.post(url, json={**ok, "top_k": 2**32 + 1}, timeout=60).json()  # larger than the vocabulary: off
    assert r["finish_reason"] == "length" and len(r["token_ids"]) == 3


def test_request_limits_over_http_and_grpc(triton):
    import tritonclient.grpc as grpcclient

    http, grpc = triton
    url = f"http://{HOST}:{http}/v2/models/m/generate"
    t0 = time.monotonic()
    r = httpx.post(url, json={"text_input": "word " * (MAX_TEXT_BYTES // 5 + 1), "max_tokens": 2}, timeout=60)
    assert "text_input" in r.text and "bytes is more than" in r.text, r.text
    refused_in = time.monotonic() - t0
    r = httpx.post(url, json={"text_input": "hi", "stop": ["x"] * 100_000}, timeout=60)
    assert "at most 16 stop strings" in r.text, r.text
    r = httpx.post(url, json={"text_input": "hi", "stop": ["x" * 300]}, timeout=60)
    assert "300 characters" in r.text, r.text
    client = grpcclient.InferenceServerClient(f"{HOST}:{grpc}")
    import queue

    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        for ids, expect in [(np.array([1, 2], np.int64), None),
                            (np.array([1, 2], np.int32), "but model 'm' expects 'INT64'")]:
            t = grpcclient.InferInput("input_ids", [2], "INT64" if ids.dtype == np.int64 else "INT32")
            t.set_data_from_numpy(ids)
            m = grpcclient.InferInput("max_tokens", [1], "INT64")
            m.set_data_from_numpy(np.array([2**33], np.int64))
            client.async_stream_infer("m", [t, m], request_id="g")
            result, error = q.get(timeout=60)
            assert error is not None and (expect or "got 8589934592") in str(error), error
    finally:
        client.stop_stream()
        client.close()
    r = httpx.post(url, json={"text_input": "hi", "max_tokens": 2, "stop": ["x"] * 16}, timeout=60).json()
    assert r["finish_reason"] == "length"  # within the limits: served, and the server is healthy
    print(f"a {MAX_TEXT_BYTES >> 20} MiB+ text_input refused in {refused_in:.2f}s")
