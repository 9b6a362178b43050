"""`kvexport serve` against what used to stall it, refuse OpenAI clients' defaults or misreport a
mistake (issue 22, the HTTP half). One real `kvexport serve` subprocess (127.0.0.1, any free port)
serves a copy of the tiny chat build whose chat template spins for hours on one message ("spin"):

- stalls: /health answers while four big requests are being tokenized (in worker threads, not on
  the event loop), and the spinning template is stopped at its time limit with a 400 naming the
  template while /health and another chat client are answered meanwhile;
- compatibility: OpenAI fields sent with values that change nothing (`echo: false`, `best_of: 1`,
  `logit_bias: null` / `{}`, `suffix: null`, `tools: []`, `response_format: {"type": "text"}`, ...)
  are taken; values that would change the result are refused with a 400 naming the field;
- wrong-way messages: a gzip body (with or without Content-Encoding) and a latin-1 body say what
  is wrong (not "nested too deeply"); a build without its tokenizer/ folder and a model source
  given to `serve` / `generate` say what to do (the CLI in process).
"""

import gzip
import json
import shutil
import statistics
import threading
import time

import httpx
import pytest
from testkit.serving import health_while
from click.testing import CliRunner

from kvexport.cli import main
from kvexport.runtime.serving.requests import CHAT_TEMPLATE_TIMEOUT_S

# a chat template that spins for hours (10^10 loop turns) on a first message "spin", and renders
# like smollm2's otherwise
SPIN = ("{%- if messages[0]['content'] == 'spin' %}{%- for i in range(100000) %}{%- for j in range(100000) %}"
        "{%- endfor %}{%- endfor %}{%- endif %}")
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def spin_build(chat_build, tmp_path_factory):
    """A copy of the tiny chat build whose chat template spins on the message "spin"."""
    out = tmp_path_factory.mktemp("spin") / "tiny-spin"
    shutil.copytree(chat_build, out)
    tok = out / "tokenizer"
    template = (tok / "chat_template.jinja").read_text()
    (tok / "chat_template.jinja").write_text(SPIN + template)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    if "chat_template" in cfg:
        cfg["chat_template"] = SPIN + cfg["chat_template"]
        (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def base(spin_build, serve_module):
    return serve_module(spin_build, "--kv-cache-memory", "16MiB").base


def test_health_answers_while_big_requests_are_tokenized(base):
    client = httpx.Client(timeout=120)
    idle = [client.get(f"{base}/health").elapsed.total_seconds() for _ in range(5)]
    # 4 requests x 16 prompts x 30,000 characters: seconds of tokenizing on 2 cores (on the loop before,
    # /health waited for all of it: ~10 s for four 1 MiB requests); each prompt is then too long
    body = json.dumps({"prompt": ["word " * 6000] * 16, "max_tokens": 1})
    answers: list[httpx.Response] = []

    def send():
        answers.append(httpx.post(f"{base}/v1/completions", content=body, timeout=120,
                                  headers={"content-type": "application/json"}))

    lat = health_while(client, base, [threading.Thread(target=send) for _ in range(4)])
    assert [r.status_code for r in answers] == [400] * 4
    assert {r.json()["error"]["code"] for r in answers} == {"context_length_exceeded"}  # they were tokenized
    print(f"/health while 4 big requests were tokenized: {len(lat)} answers, median {statistics.median(lat):.3f} s, "
          f"max {max(lat):.3f} s (idle median {statistics.median(idle):.3f} s)")
    assert len(lat) >= 3 and statistics.median(lat) < 1.0  # generous: tens of ms on an idle machine
    # too many prompts: refused by their count, before any is tokenized
    r = client.post(f"{base}/v1/completions", json={"prompt": ["word " * 20] * 5000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"


def test_a_spinning_chat_template_is_stopped_and_others_are_served(base):
    client = httpx.Client(timeout=120)
    spun: list[httpx.Response] = []
    t0 = time.monotonic()
    spin = threading.Thread(target=lambda: spun.append(httpx.post(
        f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "spin"}]}, timeout=120)))
    others: list[httpx.Response] = []

    def chats():  # other clients, while the template spins (for CHAT_TEMPLATE_TIMEOUT_S)
        time.sleep(1.0)
        while spin.is_alive() and len(others) < 3:
            others.append(client.post(f"{base}/v1/chat/completions", json=CHAT))

    lat = health_while(client, base, [spin, threading.Thread(target=chats)])
    took = time.monotonic() - t0
    (r,) = spun
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "chat_template_timeout" and err["param"] == "messages", err
    assert "chat template" in err["message"] and f"{CHAT_TEMPLATE_TIMEOUT_S:g} s" in err["message"]
    assert CHAT_TEMPLATE_TIMEOUT_S <= took < CHAT_TEMPLATE_TIMEOUT_S + 30  # stopped, not left spinning for hours
    assert others and all(o.status_code == 200 for o in others), [o.text for o in others]
    assert others[0].json()["choices"][0]["message"]["content"] is not None
    assert len(lat) >= 3 and statistics.median(lat) < 1.0
    # the worker thread was freed: the server goes on rendering templates
    assert client.post(f"{base}/v1/chat/completions", json=CHAT).status_code == 200


COMPLETION = {"prompt": "hello", "max_tokens": 1}


@pytest.mark.parametrize("route, fields", [
    ("completions", {"echo": False}), ("completions", {"best_of": 1}), ("completions", {"best_of": 2, "n": 2}),
    ("completions", {"logit_bias": None}), ("completions", {"logit_bias": {}}),
    ("completions", {"logit_bias": {"5": 0}}), ("completions", {"suffix": None}), ("completions", {"suffix": ""}),
    ("completions", {"n": 1, "logprobs": None, "stream_options": None, "user": "u1", "stop": None}),
    ("chat", {"tools": []}), ("chat", {"tools": None, "tool_choice": "none"}), ("chat", {"tool_choice": "auto"}),
    ("chat", {"parallel_tool_calls": True}), ("chat", {"response_format": {"type": "text"}}),
    ("chat", {"response_format": None, "logit_bias": {}, "functions": [], "function_call": "none"}),
    ("chat", {"n": 1, "logprobs": False, "top_logprobs": None, "stream_options": None, "user": "u1"}),
])
def test_fields_at_their_defaults_are_taken(base, route, fields):
    body = {**(COMPLETION if route == "completions" else CHAT), **fields}
    r = httpx.post(f"{base}/v1/{'completions' if route == 'completions' else 'chat/completions'}", json=body,
                   timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == (fields.get("n") or 1)


@pytest.mark.parametrize("route, fields, param", [
    ("completions", {"best_of": 2}, "best_of"), ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {"suffix": " the end"}, "suffix"),
    ("chat", {"logit_bias": {"5": -100}}, "logit_bias"),  # (functions: taken as tools, test_structured.py)
])
def test_values_that_change_the_result_are_refused_naming_the_field(base, route, fields, param):
    body = {**(COMPLETION if route == "completions" else CHAT), **fields}
    r = httpx.post(f"{base}/v1/{'completions' if route == 'completions' else 'chat/completions'}", json=body,
                   timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["code"] == "unsupported_value", err
    assert err["message"].startswith(f"{param}: this server does not support {param}; it takes only ")


def test_bodies_the_wrong_way_say_what_is_wrong(base):
    url = f"{base}/v1/completions"
    body = json.dumps({"prompt": "café", "max_tokens": 1}, ensure_ascii=False)
    for coding in ("gzip", "br", "deflate"):
        r = httpx.post(url, content=gzip.compress(body.encode()), timeout=60,
                       headers={"content-type": "application/json", "content-encoding": coding})
        err = r.json()["error"]
        assert r.status_code == 415 and err["code"] == "unsupported_content_encoding", err
        assert err["message"].startswith(f"Content-Encoding '{coding}': this server does not take compressed")
        assert r.headers["accept-encoding"] == "identity"
    r = httpx.post(url, content=gzip.compress(body.encode()), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "is gzip-compressed" in r.json()["error"]["message"], r.text
    r = httpx.post(url, content=body.encode("latin-1"), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == ("the request body is not UTF-8 text (byte b'\\xe9' at offset 15: latin-1 "
                                            "or another encoding?); send the JSON encoded as UTF-8")
    for ok in (body.encode(), b"\xef\xbb\xbf" + body.encode()):  # UTF-8, with or without a byte-order mark
        r = httpx.post(url, content=ok, headers={"content-type": "application/json", "content-encoding": "identity"},
                       timeout=60)
        assert r.status_code == 200, r.text
    nested = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(url, content=nested, headers={"content-type": "application/json"}, timeout=60)
    assert r.json()["error"]["message"] == "the request body could not be parsed as JSON: it is nested too deeply"


def _cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    return r.exit_code, " ".join(r.output.split())  # one line: the console wraps long messages


def test_a_build_without_its_tokenizer_and_a_model_source_say_what_to_do(chat_build, hf_folder, tmp_path):
    gone = tmp_path / "no-tokenizer"
    shutil.copytree(chat_build, gone, ignore=shutil.ignore_patterns("tokenizer"))
    code, out = _cli("serve", gone, "--port", "0", "--kv-cache-memory", "16MiB")
    assert code == 2 and "couldn't" not in out.lower() and "repo id" not in out.lower(), out
    assert f"{gone / 'tokenizer'}, the build's tokenizer listed in its manifest, is missing: copy the model's " \
           f"tokenizer files" in out and f"kvexport build MODEL --out {gone} --force" in out, out
    (gone / "tokenizer").mkdir()
    code, out = _cli("generate", gone, "hi", "--kv-cache-memory", "16MiB")
    assert code == 2 and "cannot be loaded (the folder is empty): copy the model's tokenizer files" in out, out
    (gone / "tokenizer" / "tokenizer_config.json").write_text("{}")
    code, out = _cli("generate", gone, "hi", "--kv-cache-memory", "16MiB")
    assert code == 2 and "internal error" not in out and "cannot be loaded (ValueError: " in out, out
    # a model source where a build belongs (before: "run `kvexport build MODEL --out <the source>`")
    src = hf_folder("llama", vocab_size=49152)
    for args, then in ((("serve", src, "--port", "0"), "then pass BUILD"),
                       (("generate", src, "hi"), "then `kvexport generate BUILD ...`")):
        code, out = _cli(*args)
        assert code == 2 and f"{src} is a model source (a Hugging Face folder), not a kvexport build: build it " \
                             f"first with `kvexport build {src} --out BUILD`, {then}" in out, out
