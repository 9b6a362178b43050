"""`kvexport serve` against issue 31 (hardening round 3) §3, §4, §6: no slow work on the event loop,
echo edge cases, and messages that neither leak the server's paths nor misname a malformed header.

- §3: eight concurrent maximum-size requests (a prompt of 130,000 one-token lists, 650 KB, under
  the body limit) are parsed and validated off the event loop: /health answers meanwhile, each
  request is refused naming the prompt count (a real `kvexport serve` subprocess).
- §4: `echo` with `max_tokens: 0` scores a prompt that fills the whole context; with `echo`,
  `logprobs: k` and `n > 1` every generated token's top_logprobs holds the sampled token.
- §6: the echo refusal on a build without --all-logits names no path of the server; a malformed
  `Authorization` header is called malformed (not "no key").
"""

import json
import shutil
import statistics
import threading
import time

import httpx
import pytest
from testkit.serving import health_while

# 130,000 one-token lists: 650 KB, under the 1 MiB body limit; refused by its count (64 at most)
MANY_LISTS = json.dumps({"prompt": [[1]] * 130_000, "max_tokens": 1})
# /health with 8 such requests in flight, each: generous for a shared 2-core machine (measured: 20 ms median,
# 48 ms at most; 0.18 s at most with the machine's load at 5; before the fix 1.25 s, as the parses ran one
# after another on the event loop)
HEALTH_BOUND_S = 0.5


def test_health_answers_while_eight_max_size_bodies_are_parsed(chat_build, serve_process):
    base = serve_process(chat_build, "--kv-cache-memory", "16MiB").base
    assert len(MANY_LISTS) < 1 << 20
    answers: list[httpx.Response] = []
    start = threading.Barrier(8)

    def send():
        with httpx.Client(timeout=120) as c:
            start.wait()
            answers.append(c.post(f"{base}/v1/completions", content=MANY_LISTS,
                                  headers={"content-type": "application/json"}))

    idle = [httpx.get(f"{base}/health").elapsed.total_seconds() for _ in range(5)]
    lat = health_while(httpx.Client(timeout=60), base, [threading.Thread(target=send) for _ in range(8)])
    assert [r.status_code for r in answers] == [400] * 8
    assert {r.json()["error"]["code"] for r in answers} == {"too_many_sequences"}
    print(f"\n/health while 8 max-size bodies were parsed: {len(lat)} answers, median "
          f"{statistics.median(lat) * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms (idle: median "
          f"{statistics.median(idle) * 1e3:.1f} ms)")
    assert len(lat) >= 3 and max(lat) <= HEALTH_BOUND_S, [round(x, 3) for x in lat]


@pytest.mark.parametrize("model, body, param", [
    ("completion", {"prompt": [1.5] * 200_000}, "prompt"),  # was 600,000 union errors
    ("completion", {"prompt": [[1.5]] * 63 + [[2] * 100_000]}, "prompt[63]"),
    ("chat", {"messages": [5] * 300_000}, "messages"),
    ("completion", {"prompt": "x", "stop_token_ids": [1.5] * 200_000}, "stop_token_ids"),
    ("chat", {"messages": [], "tools": [5] * 300_000}, "tools"),
    ("completion", {"prompt": "x", "logit_bias": {str(i): "a" for i in range(50_000)}}, "logit_bias"),  # was minutes
])
def test_max_size_bodies_of_wrong_items_are_refused_by_their_lengths(model, body, param):
    from kvexport.runtime.serving import bodies
    from kvexport.runtime.serving.openai_protocol import ApiError, ChatCompletionRequest, CompletionRequest
    from kvexport.runtime.serving.requests import RequestParser

    raw = json.dumps(body).encode()
    assert len(raw) < 1 << 20
    limits = bodies.SizeLimits(64, RequestParser(None, 49152, 8192))
    t0 = time.monotonic()
    with pytest.raises(ApiError) as e:
        bodies.parse(CompletionRequest if model == "completion" else ChatCompletionRequest, raw, None, limits)
    took = time.monotonic() - t0
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert took < 2.0, took  # generous (2 cores, shared): tens of ms to 0.3 s measured


# ---- §4: echo -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scoring(hf_folder, tmp_path_factory):
    """A TestClient of `kvexport serve`'s app over a tiny --all-logits build (context 64) with
    smollm2-135m's tokenizer, and the build's context."""
    from fastapi.testclient import TestClient

    from kvexport.exporter.build import BuildOptions, build
    from kvexport.exporter.source import load_tokenizer, resolve
    from kvexport.runtime.serving.server import create_app

    folder = tmp_path_factory.mktemp("echo-hf") / "tiny-echo"
    shutil.copytree(hf_folder("llama", vocab_size=49152), folder)
    load_tokenizer(resolve("smollm2-135m")).save_pretrained(folder)
    out, _ = build(str(folder), tmp_path_factory.mktemp("echo") / "tiny-echo",
                   BuildOptions(max_seq_len=64, validate=False, all_logits=True))
    with TestClient(create_app(out, served_model_name="tiny-echo")) as c:
        yield c, c.get("/v1/models").json()["data"][0]["max_model_len"]


def test_echo_with_max_tokens_0_scores_a_prompt_that_fills_the_context(scoring):
    c, ctx = scoring
    ids = [(37 * i) % 4000 + 1 for i in range(ctx)]
    for body in ({"prompt": ids}, {"prompt": [ids, ids[:5]]}):
        r = c.post("/v1/completions", json={**body, "echo": True, "logprobs": 1, "max_tokens": 0})
        assert r.status_code == 200, r.text
        first = r.json()["choices"][0]
        lp = first["logprobs"]
        assert len(lp["tokens"]) == ctx and lp["token_logprobs"][0] is None and first["finish_reason"] == "length"
        assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
        assert r.json()["usage"]["completion_tokens"] == 0
    # a token to generate needs room: refused as before; so is a prompt longer than the context
    for extra, prompt in (({"max_tokens": 1}, ids), ({}, ids), ({"max_tokens": 0}, ids + [5])):
        r = c.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1, **extra})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 0})  # without echo: no room for the output
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = c.post("/v1/completions", json={"prompt": ids[:5], "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_echo_top_logprobs_hold_each_sampled_token(scoring):
    c, _ = scoring
    ids = [(37 * i) % 4000 + 1 for i in range(12)]
    r = c.post("/v1/completions", json={"prompt": ids, "echo": True, "logprobs": 2, "n": 3, "max_tokens": 6,
                                        "temperature": 2.0, "seed": 7, "ignore_eos": True})
    assert r.status_code == 200, r.text
    below_top = 0  # sampled tokens that are not the most likely: the case the fix is for
    for choice in r.json()["choices"]:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 6
        for tok, v, top in zip(lp["tokens"][len(ids):], lp["token_logprobs"][len(ids):], lp["top_logprobs"][len(ids):]):
            assert top[tok] == v and len(top) <= 3, (tok, v, top)  # the top 2 and the sampled token
            below_top += max(top.values()) > v
    assert below_top > 0


# ---- §6: messages -------------------------------------------------------------------------------
def test_the_echo_refusal_names_no_server_path(chat_build, hf_folder, tmp_path):
    """Builds made now score prompt rows (io.LOGITS_INDICES): echo and prompt_logprobs answer. A build
    made before, without --all-logits, refuses them naming the rebuild and no server path."""
    import shutil

    from fastapi.testclient import TestClient

    from kvexport.exporter.build import BuildOptions
    from kvexport.exporter.source import load_tokenizer, resolve
    from kvexport.runtime.serving import openai_protocol as proto
    from kvexport.runtime.serving.server import create_app
    from testkit.legacy_builds import build_without_logits_indices

    asks = (({"echo": True, "logprobs": 0}, "echo"), ({"prompt_logprobs": 1}, "prompt_logprobs"))
    with TestClient(create_app(chat_build, served_model_name="tiny")) as c:
        for extra, _ in asks:
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder("llama", vocab_size=49152), folder)
    load_tokenizer(resolve("smollm2-135m")).save_pretrained(folder)
    old, _ = build_without_logits_indices(str(folder), tmp_path / "old", BuildOptions(max_seq_len=64, validate=False))
    with TestClient(create_app(old, served_model_name="tiny")) as c:
        for extra, param in asks:
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1, **extra})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and "kvexport build" in err["message"], err
            assert "this build" in err["message"] and str(tmp_path) not in r.text, err
    # an engine's error (a backend naming its graph file) reaches a client without the path
    err = proto.engine_failure(f"engine error: [ONNXRuntimeError] Load model from {chat_build}/decode.onnx failed")
    assert err.status == 500 and str(chat_build) not in err.message and "<server path>" in err.message


@pytest.fixture(scope="module")
def keyed(chat_build):
    from fastapi.testclient import TestClient

    from kvexport.runtime.engine import LLMEngine
    from kvexport.runtime.serving.auth import ApiKeys
    from kvexport.runtime.serving.server import OpenAIServer, build_app

    app = build_app(OpenAIServer(LLMEngine(chat_build), "tiny"), api_keys=ApiKeys.parse(f"{KEY} alice\n"))
    with TestClient(app) as c:
        yield c


KEY = "k" * 32


@pytest.mark.parametrize("value", [f"Bearer\t{KEY}", "Bearer", "Bearer ", f"Basic {KEY}", "Basic x", KEY,
                                   f"Token {KEY}"])
def test_a_malformed_authorization_header_is_called_malformed(keyed, value):
    r = keyed.get("/v1/models", headers={"Authorization": value})
    err = r.json()["error"]
    assert r.status_code == 401 and err["code"] == "invalid_api_key", err
    assert "malformed" in err["message"] and "didn't provide" not in err["message"], err
    assert r.headers["www-authenticate"] == 'Bearer error="invalid_request"' and KEY not in r.text


def test_no_header_and_a_wrong_key_keep_their_messages(keyed):
    r = keyed.get("/v1/models")
    assert r.status_code == 401 and "didn't provide an API key" in r.json()["error"]["message"]
    r = keyed.get("/v1/models", headers={"Authorization": f"Bearer {'x' * 32}"})
    assert r.status_code == 401 and "Incorrect API key" in r.json()["error"]["message"]
    assert keyed.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_settings_the_engine_lacks_are_a_400_naming_the_field(chat_build):
    """A request asking for what the server was not started with (a KV budget without importance
    eviction, speculation without a proposer) is refused before it is queued: a 400, not a failed request."""
    from fastapi.testclient import TestClient

    from kvexport.runtime.serving.server import create_app

    with TestClient(create_app(chat_build, served_model_name="tiny")) as c:
        for extra, param in (({"kv_budget_tokens": 32}, "kv_budget_tokens"), ({"speculative": True}, "speculative")):
            for path, body in (("/v1/completions", {"prompt": "hello"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                r = c.post(path, json={**body, "max_tokens": 1, **extra})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
