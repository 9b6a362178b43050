"""`kvexport serve`: the OpenAI-compatible server, driven by the real `openai` client
against a real smollm2-135m build served by a `kvexport serve` subprocess on 127.0.0.1;
plus the error paths a tokenizer-less tiny build takes (in-process, TestClient)."""

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
from kvexport.runtime.triton_local import ServerStartError, wait_http_ready

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
    for k in ("kvexport_requests_running", "kvexport_requests_waiting", "kvexport_kv_blocks_used",
              "kvexport_kv_blocks_total", "kvexport_prefix_cache_hit_rate", "kvexport_generation_tokens_total"):
        assert k in m
    assert m["kvexport_kv_blocks_total"] > 0 and m["kvexport_generation_tokens_total"] >= 4
    assert 0 < m["kvexport_prefix_cache_hit_rate"] <= 1  # the chat template's system prefix is shared


@pytest.mark.slow
def test_closing_a_stream_frees_its_kv_blocks(server, client, model):
    aborted = metrics(server)["kvexport_requests_aborted_total"]
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
    assert m["kvexport_requests_aborted_total"] == aborted + 1
    assert m["kvexport_generation_tokens_total"] < 400 + 100  # stopped well before max_tokens


# -- a tiny build without a tokenizer, in process --------------------------------------------
def test_tokenizerless_build_errors(hf_folder, tmp_path):
    from fastapi.testclient import TestClient

    from kvexport.runtime.server import create_app

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
        assert c.get("/metrics").text.count("kvexport_kv_blocks_used 0") == 1
