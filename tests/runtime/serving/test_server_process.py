"""`kvexport serve` as a process: it says "serving … on URL" only once the model is loaded
and the port is bound (so the URL answers at once, with the real port when --port is 0); a
start that cannot succeed (port in use or out of range, a host it cannot bind, a folder
that is not a build) is a non-zero exit with the reason and no "serving" line; SIGTERM
with requests running lets them finish for --shutdown-grace seconds, ends the rest (503,
or an error event in a stream) and exits within a bounded time."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from click.testing import CliRunner

from kvexport.cli import main

HOST = "127.0.0.1"


def test_the_serving_line_comes_when_the_server_answers(chat_build, serve_process):
    server = serve_process(chat_build, "--served-model-name", "tiny")
    port = int(server.base.rsplit(":", 1)[1])
    assert port != 0 and server.base == f"http://{HOST}:{port}"
    # no retry: the line promises the model is loaded and the port is listening
    assert httpx.get(f"{server.base}/health", timeout=10).json() == {"status": "ok"}
    assert httpx.get(f"{server.base}/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
    r = httpx.post(f"{server.base}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def _invoke(*args):
    r = CliRunner().invoke(main, ["serve", *map(str, args)])
    return r.exit_code, r.output


def test_failed_starts_exit_non_zero_with_the_reason(chat_build, tmp_path):
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        code, out = _invoke(chat_build, "--port", taken.getsockname()[1])
    assert code == 2 and "Address already in use" in out and "pick another --port" in out, out
    for args, expect in [
            (["--port", "70000"], "70000 is not in the range"),
            (["--port", "-1"], "not in the range"),
            (["--port", "http"], "not a valid integer"),
            (["--host", "256.1.1.1"], "cannot listen on"),
            (["--host", "10.255.255.254", "--port", "0"], "no interface of this machine has that address"),
            (["--shutdown-grace", "-1"], "--shutdown-grace"),
            (["--max-sequences-per-request", "0"], "max_sequences_per_request must be an integer >= 1")]:
        code, out = _invoke(chat_build, *args)
        assert code == 2 and expect in out and "serving" not in out, (args, out)
    (tmp_path / "notabuild").mkdir()
    code, out = _invoke(tmp_path / "notabuild", "--port", "0")
    assert code == 2 and "kvexport.json" in out and "serving" not in out, out
    code, out = _invoke(tmp_path / "missing")
    assert code == 2 and "does not exist" in out


def test_a_port_in_use_is_a_clear_exit_of_the_process(chat_build, tmp_path):
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        run = subprocess.run([sys.executable, "-m", "kvexport.cli", "serve", str(chat_build), "--port",
                              str(taken.getsockname()[1])], capture_output=True, text=True, timeout=120,
                             cwd=tmp_path)
    assert run.returncode == 2 and "Address already in use" in run.stderr and "serving" not in run.stderr
    assert "Traceback" not in run.stderr + run.stdout


@pytest.mark.slow
def test_sigterm_with_requests_running_ends_them_and_exits(smollm2_build, serve_process):
    """A short request finishes within the grace; a long non-streaming one gets a 503, a long
    stream an error event; the process exits a few seconds after the grace (CLI: 128 + 15)."""
    grace = 4
    server = serve_process(smollm2_build, "--kv-cache-memory", "64MiB", "--shutdown-grace", str(grace))
    got: dict[str, object] = {}
    long = {"prompt": "Tell me a long story.", "max_tokens": 450, "ignore_eos": True}

    def post(name, body):
        try:
            r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=120)
            got[name] = (r.status_code, r.json())
        except httpx.HTTPError as e:
            got[name] = e

    def stream():
        events = []
        try:
            with httpx.stream("POST", f"{server.base}/v1/completions", json={**long, "stream": True},
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        except httpx.HTTPError as e:
            events.append(repr(e))
        got["stream"] = events

    threads = [threading.Thread(target=post, args=("long", long)), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while "kvexport_requests_running 2" not in httpx.get(f"{server.base}/metrics", timeout=10).text:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    short = threading.Thread(target=post, args=("short", {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True}))
    short.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for t in (*threads, short):
        t.join(60)
    ended = time.monotonic() - t0
    code = server.proc.wait(timeout=grace + 30)
    exited = time.monotonic() - t0
    print(f"requests ended {ended:.1f}s, process exited {exited:.1f}s after SIGTERM (grace {grace}s), code {code}")
    status, body = got["short"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"  # finished within the grace
    status, body = got["long"]
    assert status == 503 and body["error"]["code"] == "server_shutting_down", got["long"]
    last = json.loads(got["stream"][-1])
    assert last["error"]["code"] == "server_shutting_down", got["stream"][-3:]
    assert grace - 0.5 < ended < grace + 3 and exited < grace + 10
    assert code in (128 + signal.SIGTERM, -signal.SIGTERM)
    assert "Traceback" not in server.log.read_text()
