"""`kvexport serve --api-keys FILE`: the key file (comments, several keys of one tenant, and
each bad kind: empty, malformed, repeated, short or non-ASCII key, non-UTF-8, missing, a
directory: an error naming --api-keys and the line, never the key), the CLI refusing a bad
file (also through $KVEXPORT_API_KEYS) before it loads the model, and the app over a real
tiny engine (in-process): OpenAI's 401 without a key or with a wrong one (no body read
first), /health and /metrics open, every other path closed, and `cache_salt` checked on both
routes."""

import json

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from kvexport.cli import main
from kvexport.runtime.engine import LLMEngine
from kvexport.runtime.serving.auth import ApiKeyFileError, ApiKeys, bearer_key
from kvexport.runtime.serving.server import OpenAIServer, build_app

KEY_A = "a" * 15 + "-key-of-alice"
KEY_A2 = "rotated-key-of-alice-0001"
KEY_B = "bob-s-key-0123456789"
KEYS_TEXT = f"\ufeff# tenants of this server\n\n{KEY_A} alice\n  {KEY_B}\tbob  \n# rotation\n{KEY_A2} alice\n"


def write(tmp_path, text: str | bytes, name: str = "keys") -> str:
    p = tmp_path / name
    (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    p.chmod(0o600)
    return str(p)


def test_key_file_maps_keys_to_tenants(tmp_path, caplog):
    keys = ApiKeys.load(write(tmp_path, KEYS_TEXT))
    assert len(keys) == 3 and keys.tenants == {"alice", "bob"}
    assert [keys.tenant(k) for k in (KEY_A, KEY_A2, KEY_B, KEY_B.encode())] == ["alice", "alice", "bob", "bob"]
    assert [keys.tenant(k) for k in (None, "", KEY_A[:-1], KEY_A + "x", KEY_A.upper(), "alice")] == [None] * 6
    assert KEY_A not in repr(keys) and "3 keys, 2 tenants" in repr(keys)
    assert not caplog.records  # chmod 600: no warning
    (tmp_path / "keys").chmod(0o644)
    ApiKeys.load(tmp_path / "keys")
    assert "can be read by other users" in caplog.text and "chmod 600" in caplog.text


@pytest.mark.parametrize("text, line, what", [
    ("", None, "holds no keys"),
    ("# only a comment\n\n   \n", None, "holds no keys"),
    (f"{KEY_A} alice\n\n{KEY_B}\n", 3, "expected 2 fields (a key and a tenant), got 1"),
    (f"{KEY_A} alice extra\n", 1, "got 3"),
    ("short alice\n", 1, "the key has 5 characters; use 16 to 1024"),
    (f"{KEY_A}é alice\n", 1, "visible ASCII"),
    (f"{KEY_A} alice\n{KEY_B} bob\n# x\n{KEY_A} mallory\n", 4, "repeats the key of line 1"),
    (f"{KEY_A} {'t' * 257}\n", 1, "at most 256 printable characters"),
    (f"{KEY_A} alice\n".encode() + b"\n" + KEY_B.encode() + b" b\xffb\n", 3, "not UTF-8"),
])
def test_bad_key_files_name_the_option_and_the_line(tmp_path, text, line, what):
    path = write(tmp_path, text)
    with pytest.raises(ApiKeyFileError) as e:
        ApiKeys.load(path)
    msg = str(e.value)
    assert msg.startswith(f"--api-keys (or $KVEXPORT_API_KEYS) {path}") and what in msg
    if line is not None:
        assert f", line {line}:" in msg
    assert KEY_A not in msg and KEY_B not in msg


def test_unreadable_key_files(tmp_path):
    with pytest.raises(ApiKeyFileError, match=r"--api-keys .*missing: cannot read it: No such file"):
        ApiKeys.load(tmp_path / "missing")
    with pytest.raises(ApiKeyFileError, match=r"--api-keys .* is a directory; give the key file"):
        ApiKeys.load(tmp_path)


def test_bearer_header_parsing():
    h = lambda v: [(b"host", b"x"), (b"Authorization", v)]  # noqa: E731
    assert bearer_key(h(b"Bearer abc")) == b"abc" and bearer_key(h(b"bearer  abc ")) == b"abc"
    assert [bearer_key(h(v)) for v in (b"Basic abc", b"Bearer", b"Bearer ", b"abc")] == [None] * 4
    assert bearer_key([(b"host", b"x")]) is None


def test_cli_refuses_a_bad_key_file_before_loading_the_model(tmp_path):
    bad = write(tmp_path, f"{KEY_A} alice\n{KEY_A} bob\n")
    not_a_build = tmp_path / "empty-folder"  # the model is never loaded: the key file fails first
    not_a_build.mkdir()
    for args, env in (([str(not_a_build), "--api-keys", bad], {}),
                      ([str(not_a_build)], {"KVEXPORT_API_KEYS": bad})):
        r = CliRunner().invoke(main, ["serve", *args, "--port", "0"], env=env)
        assert r.exit_code == 2, r.output
        assert "--api-keys (or $KVEXPORT_API_KEYS)" in r.output and "line 2: repeats the key of line 1" in r.output
        assert KEY_A not in r.output


@pytest.fixture(scope="module")
def client(chat_build, tmp_path_factory):
    path = write(tmp_path_factory.mktemp("keys"), KEYS_TEXT)
    engine = LLMEngine(chat_build)
    app = build_app(OpenAIServer(engine, "tiny"), max_body_bytes=4096, api_keys=ApiKeys.load(path))
    with TestClient(app) as c:
        yield c


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_requests_need_a_valid_key(client):
    body = {"prompt": "hello", "max_tokens": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {"error": {"message": "You didn't provide an API key. Send it in an Authorization header "
                                             "using Bearer auth (Authorization: Bearer YOUR_KEY).",
                                  "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    wrong = KEY_A[:-1] + "X"
    r = client.post("/v1/completions", json=body, headers=auth(wrong))
    assert r.status_code == 401 and r.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    assert r.json()["error"]["code"] == "invalid_api_key" and wrong not in r.text and KEY_A not in r.text
    assert client.post("/v1/completions", json=body, headers={"Authorization": f"Basic {KEY_A}"}).status_code == 401
    for key in (KEY_A, KEY_A2, KEY_B):
        r = client.post("/v1/completions", json=body, headers=auth(key))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                    headers={"Authorization": f"bearer {KEY_B}"})
    assert r.status_code == 200


def test_only_health_and_metrics_are_open(client):
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    for path in ("/v1/models", "/v1/nope", "/nope", "/docs", "/openapi.json"):
        assert client.get(path).status_code == 401, path
    assert client.get("/v1/models", headers=auth(KEY_A)).json()["data"][0]["id"] == "tiny"
    assert client.get("/v1/nope", headers=auth(KEY_A)).status_code == 404
    # the key is checked before the body is read: an oversized body without a key is a 401, not a 413
    assert client.post("/v1/completions", content=b"x" * 10_000).status_code == 401
    assert client.post("/v1/completions", content=b"x" * 10_000, headers=auth(KEY_A)).status_code == 413


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
])
def test_cache_salt_is_checked_on_both_routes(client, route, body):
    ok = client.post(route, json={**body, "cache_salt": "s" * 1024}, headers=auth(KEY_A))
    assert ok.status_code == 200, ok.json()
    for salt, what in (("", "non-empty string"), (7, "string"), ("s" * 1025, "at most 1024 characters"),
                       ("\ud800", "lone surrogate")):
        # NOTE: json.dumps escapes a lone surrogate as \\ud800, as a client's JSON would
        r = client.post(route, content=json.dumps({**body, "cache_salt": salt}),
                        headers={**auth(KEY_A), "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", (salt, r.json())
        assert what in r.json()["error"]["message"] and "s" * 100 not in r.text

