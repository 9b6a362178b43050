"""`kvexport serve`: the OpenAI-compatible server, driven by the real `openai` client
against a real smollm2-135m build served by a `kvexport serve` subprocess on 127.0.0.1;
the error paths a tokenizer-less tiny build takes (in-process, TestClient); and the app's
routes, errors and streaming over a stand-in engine thread (in-process, no model)."""

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from kvexport import LLM, SamplingParams
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.serving import metrics as mx
from kvexport.runtime.core.stats import SchedulerStats
from kvexport.runtime.serving.engine_thread import Counters, Event
from kvexport.runtime.serving.triton_local import ServerStartError, wait_http_ready

HOST = "127.0.0.1"
PROMPT = "The capital of France is"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {k: float(v) for k, v in (line.split() for line in text.splitlines() if line and not line.startswith("#"))}


@pytest.fixture(scope="module")
def smol_build(smollm2_build):
    return smollm2_build


@pytest.fixture(scope="module")
def server(smol_build, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("srvlog") / "serve.log"
    with open(log, "w") as f:
        # NOTE: cwd outside the repository, so `kvexport` is the installed package
        proc = subprocess.Popen([sys.executable, "-m", "kvexport.cli", "serve", str(smol_build), "--port", str(port),
                                 "--kv-cache-memory", "64MiB", "--threads", "2"], cwd=str(log.parent),
                                stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ))
    base = f"http://{HOST}:{port}"
    try:
        try:
            wait_http_ready(f"{base}/health", proc, 90)
        except ServerStartError as e:
            pytest.fail(f"server did not start ({e}):\n{log.read_text()[-3000:]}")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def llm(smol_build):
    return LLM(smol_build, kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def model(client):
    (m,) = client.models.list().data
    return m.id


@pytest.mark.slow
def test_completion_matches_llm_generate(client, model, llm):
    want = llm.generate(PROMPT, SamplingParams(max_tokens=12))[0]
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    by_ids = client.completions.create(model=model, prompt=llm._tokens(PROMPT), max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == want.text


@pytest.mark.slow
def test_streaming_concatenates_to_the_full_text(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0]
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True))
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks) == full.text
    assert chunks[-1].choices[0].finish_reason == full.finish_reason


@pytest.mark.slow
def test_chat_and_chat_streaming(client, model, llm):
    messages = [{"role": "user", "content": "Name a fruit."}]
    want = llm.generate([messages], SamplingParams(max_tokens=12))[0]
    got = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    parts = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == want.text
    assert parts[-1].choices[0].finish_reason == got.choices[0].finish_reason


@pytest.mark.slow
def test_stop_strings(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = full.strip().split()[1]  # a word inside the greedy continuation
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]).choices[0]
    assert got.finish_reason == "stop" and got.text == full[:full.index(stop)]


@pytest.mark.slow
def test_n_samples(client, model):
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3, n=2)
    assert sorted(c.index for c in got.choices) == [0, 1]
    assert all(c.finish_reason in ("stop", "length") and c.text for c in got.choices)
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3, n=2)
    assert [c.text for c in again.choices] == [c.text for c in got.choices]  # seeded


@pytest.mark.slow
def test_errors_are_openai_shaped(client, model, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.body["message"]
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[5] * 600, max_tokens=4)
    assert "context" in e.value.body["message"]
    r = httpx.post(f"{server}/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{server}/v1/completions", content=b" " * (2 << 20), timeout=30)
    assert r.status_code == 413
    # max_tokens beyond the context is capped, not refused
    long = client.completions.create(model=model, prompt=[5] * 505, max_tokens=1000, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 7 and long.choices[0].finish_reason == "length"


@pytest.mark.slow
def test_health_and_metrics(server, client, model):
    assert httpx.get(f"{server}/health", timeout=10).json() == {"status": "ok"}
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi."}], max_tokens=2)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hey."}], max_tokens=2)
    m = metrics(server)
    assert list(m) == list(mx.NAMES)  # runtime/serving/metrics.py's table, as the Triton model publishes it
    assert m["kvexport_kv_blocks_total"] > 0 and m["kvexport_generation_tokens_total"] >= 4
    assert 0 < m["kvexport_prefix_cache_hit_rate"] <= 1  # the chat template's system prefix is shared


@pytest.mark.slow
def test_closing_a_stream_frees_its_kv_blocks(server, client, model):
    cancelled = metrics(server)["kvexport_requests_cancelled_total"]
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert metrics(server)["kvexport_kv_blocks_used"] > 0
    stream.close()
    deadline = time.monotonic() + 30
    while True:
        m = metrics(server)
        if m["kvexport_kv_blocks_used"] == 0 and m["kvexport_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["kvexport_requests_cancelled_total"] == cancelled + 1
    assert m["kvexport_generation_tokens_total"] < 400 + 100  # stopped well before max_tokens


def _wait_freed(server: str, cancelled_before: float, within: float) -> dict[str, float]:
    deadline = time.monotonic() + within
    while True:
        m = metrics(server)
        if (m["kvexport_kv_blocks_used"] == 0 and m["kvexport_requests_running"] == 0
                and m["kvexport_requests_cancelled_total"] > cancelled_before):
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story."}]}),
])
def test_a_client_that_leaves_a_non_streaming_request_frees_its_kv_blocks(server, model, route, body):
    """The client gives up after 3 s (its read timeout closes the connection) while tokens
    are still being generated: within a few seconds its KV blocks are free and it counts as
    cancelled (the server checks by the clock, not only when no token came for a while)."""
    before = metrics(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}{route}", json={**body, "model": model, "max_tokens": 450, "ignore_eos": True},
                   timeout=httpx.Timeout(10, read=3))
    left = time.monotonic()
    m = _wait_freed(server, before["kvexport_requests_cancelled_total"], within=8)
    assert m["kvexport_requests_cancelled_total"] == before["kvexport_requests_cancelled_total"] + 1
    assert m["kvexport_generation_tokens_total"] - before["kvexport_generation_tokens_total"] < 450
    print(f"{route}: blocks free {time.monotonic() - left:.1f}s after the client left")


# -- a tiny build without a tokenizer, in process --------------------------------------------
def test_tokenizerless_build_errors(hf_folder, tmp_path):
    from fastapi.testclient import TestClient

    from kvexport.runtime.serving.server import create_app

    out, _ = build(str(hf_folder("llama")), tmp_path / "tiny", BuildOptions(block_size=4, max_seq_len=64,
                                                                            validate=False))
    with TestClient(create_app(out, served_model_name="tiny", max_body_bytes=4096)) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hello"})
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = c.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 3, "n": 2, "temperature": 0.8,
                                            "ignore_eos": True})
        assert r.status_code == 200 and [len(ch["text"]) >= 0 for ch in r.json()["choices"]] == [True, True]
        assert r.json()["usage"]["completion_tokens"] == 6
        r = c.post("/v1/completions", json={"prompt": [3] * 3000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = c.post("/v1/completions", json={"prompt": [3] * 64})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = c.post("/v1/completions", json={"prompt": [3, 4], "top_p": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
        r = c.post("/v1/completions", json={"prompt": [3, 4], "model": "other"})
        assert r.status_code == 404
        for prompt in ([3, -1], [3, 128]):  # the tiny model's vocabulary is 128: nothing wraps
            r = c.post("/v1/completions", json={"prompt": prompt})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.json()
            assert "outside this model's vocabulary" in r.json()["error"]["message"]
        assert c.get("/metrics").text.count("kvexport_kv_blocks_used 0") == 1
        assert c.get("/health").json() == {"status": "ok"}


def test_a_bad_request_fails_alone_next_to_a_running_stream(hf_folder, tmp_path):
    """In process, a real tiny build: while a stream runs, a request with a token id that
    breaks the backend (injected: the real backend raises on it) gets a 500 naming the
    failure and out-of-vocabulary ids get a 400; the stream finishes with the tokens it
    gets alone, and every KV block is free afterwards."""
    import threading

    from fastapi.testclient import TestClient

    from kvexport.runtime.serving.server import create_app

    out, _ = build(str(hf_folder("llama")), tmp_path / "tiny", BuildOptions(block_size=4, max_seq_len=64,
                                                                            validate=False))
    # no tokenizer in a tiny build: the tokens are compared through their logprobs entries
    body = {"prompt": [3, 4, 5, 6], "max_tokens": 24, "ignore_eos": True, "temperature": 0, "logprobs": 0}
    with TestClient(create_app(out, served_model_name="tiny")) as c:
        alone = c.post("/v1/completions", json=body).json()["choices"][0]
    app = create_app(out, served_model_name="tiny")
    backend = app.state.worker.engine.backend
    real = backend.execute

    def execute(inp, all_tokens=False):  # injected failure
        if 77 in inp.token_ids.tolist():
            raise RuntimeError("injected backend failure")
        return real(inp, all_tokens)

    backend.execute = execute
    with TestClient(app) as c:
        got = {}

        def stream():
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                got["chunks"] = [line for line in r.iter_lines() if line.startswith("data: {")]

        t = threading.Thread(target=stream)
        t.start()
        bad = c.post("/v1/completions", json={"prompt": [3, 77, 4], "max_tokens": 4})
        oov = c.post("/v1/completions", json={"prompt": [999999], "max_tokens": 4})
        t.join(60)
        assert bad.status_code == 500 and "injected backend failure" in bad.json()["error"]["message"]
        assert oov.status_code == 400 and oov.json()["error"]["param"] == "prompt"
        tokens = [t for line in got["chunks"] for t in (json.loads(line[6:])["choices"][0]["logprobs"] or {}).get("tokens", [])]
        assert len(tokens) == 24 and tokens == alone["logprobs"]["tokens"]
        assert json.loads(got["chunks"][-1][6:])["choices"][0]["finish_reason"] == "length"
        assert "kvexport_kv_blocks_used 0" in c.get("/metrics").text


# -- the app over a stand-in engine thread: routes, errors, streaming (no model) --------------
class FakeTokenizer:
    chat_template = "x"

    def __call__(self, text):
        return {"input_ids": [ord(c) % 40 for c in text]}

    def decode(self, ids, **kw):
        return "".join("ab"[i % 2] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [1] + [t for m in messages for t in self(m["content"])["input_ids"]] + [2]


class FakeWorker:
    """EngineThread's interface: each sample yields tokens 0, 1, ... ("a", "b", ...) up to
    max_tokens, delivered at submit; with `fail`, sample 0 fails with that error and the
    others never finish (as if still running)."""

    def __init__(self):
        self.counters = Counters(stats=SchedulerStats(kv_blocks_total=8))
        self.submitted, self.aborted, self.groups, self.fail = [], [], [], None

    def start(self):
        pass

    def stop(self):
        pass

    def is_alive(self):
        return True

    def submit(self, prompt, params, deliver, first_index=0, request_ids=None, group=None, salt=None):
        self.submitted.append((prompt, params))
        self.groups.append(group)
        rids = [f"r{len(self.submitted)}-{i}" for i in range(params.n)]
        if self.fail:
            deliver(Event(first_index, "", [], 0, True, "error", self.fail))
            return rids
        for i in range(params.n):
            for k in range(params.max_tokens):
                last = k == params.max_tokens - 1
                deliver(Event(first_index + i, "ab"[k % 2], [k], k + 1, last, "length" if last else None, None,
                              [-0.5] if params.logprobs is not None else None,
                              [[(k, -0.5)]] if params.logprobs else None))
        return rids

    def abort(self, request_ids):
        self.aborted += request_ids


@pytest.fixture
def fake():
    """(TestClient, FakeWorker) of an app serving model "m" (vocabulary 50, context 32)."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from kvexport.runtime.serving.server import OpenAIServer, build_app

    from kvexport.runtime.config import EngineConfig

    worker = FakeWorker()
    engine = SimpleNamespace(tokenizer=FakeTokenizer(), vocab_size=50, max_model_len=32,
                             config=EngineConfig(max_sequences_per_request=8),
                             manifest=SimpleNamespace(all_logits=True, scores_prompts=True), build_dir="m", streaming=False,
                             check_params=lambda params: None)
    from kvexport.runtime.frontend import RequestPrep

    engine.prep = RequestPrep(engine.tokenizer, 50, 32, engine.check_params, lambda spec, param: None)
    with TestClient(build_app(OpenAIServer(engine, "m", worker), max_body_bytes=2048)) as c:
        yield c, worker


def test_completions_and_chat_over_the_app(fake):
    c, worker = fake
    r = c.post("/v1/completions", json={"model": "m", "prompt": ["ab", "c"], "max_tokens": 3, "n": 2,
                                        "logprobs": 1})
    assert r.status_code == 200, r.json()
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3] and body["choices"][3]["text"] == "aba"
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 1, 2]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert [p for p, _ in worker.submitted] == [[17, 18], [19]] and worker.submitted[0][1].n == 2
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                                             "max_completion_tokens": 2})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert worker.submitted[-1][0] == [1, 17, 2]
    assert c.post("/v1/completions", json={"prompt": "a"}).json()["usage"]["completion_tokens"] == 16  # default 16
    r = c.get("/v1/models").json()
    assert r["data"][0]["id"] == "m" and r["data"][0]["max_model_len"] == 32


def test_streams_over_the_app(fake):
    c, _ = fake
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                             "stream": True, "stream_options": {"include_usage": True}})
    events = [line[6:] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [ch["choices"][0]["delta"].get("content") for ch in chunks[1:3]] == ["a", "b"]
    assert chunks[2]["choices"][0]["finish_reason"] == "length" and chunks[1]["usage"] is None
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    r = c.post("/v1/completions", json={"prompt": [3], "max_tokens": 2, "stream": True})
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in r.text.split("\n\n") if line[6:7] == "{"]
    assert texts == ["a", "b"] and "usage" not in r.text


@pytest.mark.parametrize("body, param, text", [
    ({"prompt": [1, "a"]}, "prompt[1]", "valid integer"),
    ({"prompt": "x", "stop": [1]}, "stop[0]", "valid string"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "boolean"),
    ({"prompt": "x", "max_tokens": "4"}, "max_tokens", "valid integer"),
    ({"prompt": [3, -1]}, "prompt", "outside this model's vocabulary"),
    ({"prompt": [3, 50]}, "prompt", "outside this model's vocabulary"),
    ({"prompt": [[3], [1] * 32]}, "prompt[1]", "context holds 32"),
    ({"prompt": "x", "top_p": 0}, "top_p", "top_p"),
    ({"prompt": "x", "stop_token_ids": [-5]}, "stop_token_ids", "outside"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text",
     "valid string"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, "top_logprobs", "20"),
    ({"messages": []}, "messages", "non-empty"),
    # fields this server does not implement are refused, at any depth, not ignored
    ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias", "does not support logit_bias; it takes only {}"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "does not support"),
    ({"prompt": "x", "best_of": 2}, "best_of", "does not support"),
    ({"prompt": "x", "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x", "does not support"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]",
     '{"type": "function", "function"'),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format.type",
     '"json_schema"'),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls[0].function.name", "must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}]},
     "messages[0].content[0].cache", "does not support"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[0].type", "'text'"),
    # out of range / wrongly typed, at every depth
    ({"prompt": "x", "n": 0}, "n", "n must be"),
    ({"prompt": "x", "n": 9}, "n", "at most 8 per request"),
    ({"prompt": ["a", "b", "c"], "n": 3}, "n", "9 sequences (3 prompts x n=3)"),
    ({"prompt": ["a"] * 9}, "prompt", "9 sequences (9 prompts x n=1)"),
    ({"prompt": [[3], [-4]]}, "prompt[1]", "outside"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature", "finite number"),
    ({"prompt": "x", "top_p": float("inf")}, "top_p", "finite number"),
    ({"prompt": "x", "seed": -1}, "seed", "non-negative"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "valid integer"),
    ({"prompt": "x", "stop_token_ids": ["3"]}, "stop_token_ids[0]", "valid integer"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop", "at most 16 stop strings"),
    ({"prompt": "x", "stop": "s" * 257}, "stop", "at most 256 characters"),
    ({"prompt": "x", "stop_token_ids": [3] * 257}, "stop_token_ids", "at most 256"),
    ({"prompt": "x", "stream_options": []}, "stream_options", "dictionary"),
    ({"prompt": "\ud800"}, "prompt", "not valid Unicode"),
    ({"prompt": "x", "user": "\udfff"}, "user", "not valid Unicode"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs", "valid boolean"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs", "set logprobs to true"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
    ({"messages": [{"role": "user", "content": "x"}], "metadata": []}, "metadata", "dictionary"),
])
def test_bad_bodies_get_openai_400s_naming_the_field(fake, body, param, text):
    c, worker = fake
    # NaN and Infinity as Python's JSON parser reads them; a lone surrogate as its JSON escape
    raw = json.dumps(body, allow_nan=True)
    r = c.post("/v1/chat/completions" if "messages" in body else "/v1/completions", content=raw,
               headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and text in err["message"], err
    assert err["type"] == "invalid_request_error" and not worker.submitted


def test_accepted_and_ignored_fields_and_one_group_per_request(fake):
    c, worker = fake
    r = c.post("/v1/chat/completions", json={
        "messages": [{"role": "assistant", "content": "x", "refusal": None, "tool_calls": None, "function_call": None,
                      "audio": None, "annotations": None, "name": "bot"}, {"role": "user", "content": "y"}],
        "user": "u1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto", "max_tokens": 2})
    assert r.status_code == 200, r.json()
    r = c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1, "user": "u2"})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    # fair admission: both prompts of one request share one group; another request has its own
    assert worker.groups[1] == worker.groups[2] != worker.groups[0] and worker.groups[1].startswith("cmpl-")


def test_transport_and_unexpected_errors_are_openai_shaped(fake):
    from fastapi.testclient import TestClient

    from kvexport.runtime.serving.server import build_app

    c, worker = fake
    with TestClient(build_app(c.app.state.server)) as big:  # 1 MiB bodies
        for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"prompt": [1' + b"0" * 5000 + b"]}"):
            r = big.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "could not be parsed as JSON" in r.json()["error"]["message"]
    r = c.request("TRACE", "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "error" in r.json()

    def boom(*a, **k):  # injected: a bug in the server
        raise RuntimeError("secret internal detail")

    worker.submit = boom
    with TestClient(c.app, raise_server_exceptions=False) as c2:
        r = c2.post("/v1/completions", json={"prompt": [3], "max_tokens": 1})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "secret" not in r.text and "Traceback" not in r.text


def test_transport_errors_over_the_app(fake):
    c, worker = fake
    r = c.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert c.post("/v1/completions", content=b'{"prompt": [3], "max_tokens": 1}').status_code == 200  # no Content-Type
    r = c.post("/v1/completions", content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    r = c.post("/v1/completions", content=iter([b" " * 1024] * 3))  # chunked: no Content-Length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert c.post("/v1/completions", json={"prompt": "x", "model": "n"}).json()["error"]["code"] == "model_not_found"
    assert c.get("/v1/completions").status_code == 405 and c.get("/nope").json()["error"]["code"] == "not_found"
    assert len(worker.submitted) == 1  # only the valid one


def test_openapi_schema_describes_the_bodies(fake):
    c, _ = fake
    schema = c.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])
    ref = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ref["$ref"].endswith("/ChatCompletionRequest")
    comps = schema["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "ChatMessage", "TextContentPart"} <= set(comps)
    assert "prompt" in comps["CompletionRequest"]["required"]
    assert comps["CompletionRequest"]["additionalProperties"] is False  # unknown fields are refused
    # every status a route answers is documented, with its body; validation errors are 400, not 422
    post = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "415", "499", "500", "503"} <= set(post)
    assert post["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionResponse")
    assert "text/event-stream" in post["200"]["content"]
    assert post["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "HTTPValidationError" not in comps and "422" not in json.dumps(schema["paths"])
    assert schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"].keys() == {"text/plain"}


def test_metrics_count_client_cancellations(fake):
    c, worker = fake
    c.app.state.server.cancelled = 3
    text = c.get("/metrics").text
    assert "kvexport_requests_cancelled_total 3\n" in text
    assert [line.split()[0] for line in text.splitlines() if not line.startswith("#")] == list(mx.NAMES)


def test_a_failed_request_aborts_its_other_samples(fake):
    c, worker = fake
    worker.fail = "engine error: boom"
    r = c.post("/v1/completions", json={"prompt": [3], "n": 2, "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert worker.aborted == ["r1-1"]  # sample 1 is aborted at once, its blocks freed
    assert "kvexport_requests_cancelled_total 0\n" in c.get("/metrics").text  # no client cancelled it
    worker.fail = "the prompt is empty"
    assert c.post("/v1/completions", json={"prompt": [3]}).status_code == 400


def test_prompt_counts_are_checked_before_anything_is_tokenized(fake):
    """The cheap limits come first, on the event loop: a request for too many sequences is refused
    by its counts, before its prompts are tokenized (in a worker thread)."""
    import dataclasses

    c, worker = fake
    server, calls = c.app.state.server, []

    class Counting(FakeTokenizer):
        def __call__(self, text):
            calls.append(text)
            return super().__call__(text)

    server.parser = dataclasses.replace(server.parser, tokenizer=Counting())
    for body in ({"prompt": ["ab"] * 9}, {"prompt": ["ab"] * 3, "n": 3}, {"prompt": "ab", "n": 9}):
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences", r.json()
    assert calls == [] and not worker.submitted
    assert c.post("/v1/completions", json={"prompt": ["ab"] * 8, "max_tokens": 1}).status_code == 200
    assert len(calls) == 8
