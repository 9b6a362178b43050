"""`kvexport triton-serve`: one command that runs a repository written by `kvexport triton` on
the local tritonserver. Without a server it says how to get one; `kvexport triton` ends by
printing the command; and SIGTERM with requests in flight (streamed over HTTP, whole over
HTTP /generate, streamed over gRPC) ends them with an error response after the grace
period, tritonserver unloads the model and exits 0, and no process of it (the
Python-backend stub included) is left."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from kvexport.cli import main
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.serving import triton_local
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.serving.triton_local import TritonNotFoundError, locate
from kvexport.runtime.serving.triton_repo import TritonRepoOptions, write_repository

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[2]
TRITON_ENV = Path(os.environ.get("KVEXPORT_TRITON_ENV", REPO_ROOT / ".venv-triton"))


def test_without_a_server_the_error_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setattr(triton_local, "_candidate_envs", lambda: [str(tmp_path / "nowhere")])
    monkeypatch.setenv("PATH", str(tmp_path))  # no tritonserver on PATH either
    with pytest.raises(TritonNotFoundError) as e:
        locate()
    msg = str(e.value)
    assert "no tritonserver found" in msg and "scripts/install.sh" in msg and "--triton-env" in msg
    assert "container" in msg and str(tmp_path / "nowhere") in msg
    (tmp_path / "env" / "bin").mkdir(parents=True)
    with pytest.raises(TritonNotFoundError, match="nvidia-pytriton"):
        locate(tmp_path / "env")
    with pytest.raises(TritonNotFoundError, match="no such folder"):
        locate(tmp_path / "missing")


def test_triton_prints_the_command_that_serves_the_repository(hf_folder, tmp_path):
    out, _ = build(str(hf_folder("llama")), tmp_path / "tiny", BuildOptions(max_seq_len=64, validate=False))
    r = CliRunner().invoke(main, ["triton", str(out), "--out", str(tmp_path / "repo")])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert f"kvexport triton-serve {tmp_path / 'repo'}" in text and "tritonserver --model-repository" in text


def test_triton_serve_refuses_a_folder_that_is_not_a_repository(tmp_path):
    r = CliRunner().invoke(main, ["triton-serve", str(tmp_path)])
    assert r.exit_code == 2 and "holds no model" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["triton-serve", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "does not exist" in r.output
    r = CliRunner().invoke(main, ["triton-serve", str(tmp_path), "--http-port", "70000"])
    assert r.exit_code == 2 and "70000" in r.output


# ---- the real server ------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone
    except FileNotFoundError:
        return False


def _descendants(pid: int) -> set[int]:
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p}
        out |= kids
        todo += kids
    return out


@pytest.mark.slow
def test_sigterm_ends_open_requests_and_leaves_no_process(smollm2_build, tmp_path, free_ports):
    if not (TRITON_ENV / "bin" / "python3").exists():
        pytest.skip(f"no Triton execution environment at {TRITON_ENV}: run scripts/install.sh --dev")
    grace = 2
    write_repository(smollm2_build, tmp_path / "repo", TritonRepoOptions(
        engine=EngineConfig(kv_cache_memory="64MiB", threads=2), name="smol", execution_env=str(TRITON_ENV)))
    http, grpc, metrics = free_ports(3)
    log = tmp_path / "triton-serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvexport.cli", "triton-serve", str(tmp_path / "repo"),
                                 "--triton-env", str(TRITON_ENV), "--http-port", str(http), "--grpc-port", str(grpc),
                                 "--metrics-port", str(metrics), "--shutdown-grace", str(grace)],
                                stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path, env=dict(os.environ, COLUMNS="400"))
    try:
        deadline = time.monotonic() + 240
        while "Triton serving" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-5000:]
            time.sleep(0.2)
        assert httpx.get(f"http://{HOST}:{http}/v2/health/ready", timeout=10).status_code == 200
        server_pids = _descendants(proc.pid)
        assert len(server_pids) >= 2  # tritonserver and the model's stub
        base = f"http://{HOST}:{http}/v2/models/smol"
        body = {"text_input": "Tell me a long story.", "max_tokens": 450, "ignore_eos": True}
        got: dict[str, object] = {}

        def stream():
            events = []
            with httpx.stream("POST", f"{base}/generate_stream", json={**body, "stream": True}, timeout=120) as r:
                events += [line for line in r.iter_lines() if line.startswith("data: ")]
            got["stream"] = events

        def whole():
            got["generate"] = httpx.post(f"{base}/generate", json=body, timeout=120).text

        def grpc_stream():
            import queue

            import tritonclient.grpc as grpcclient

            client, q = grpcclient.InferenceServerClient(f"{HOST}:{grpc}"), queue.Queue()
            client.start_stream(callback=lambda result, error: q.put(error))
            inputs = []
            for name, a, kind in (("text_input", np.array([body["text_input"].encode()], dtype=object), "BYTES"),
                                  ("max_tokens", np.array([450], np.int32), "INT32"),
                                  ("ignore_eos", np.array([True]), "BOOL"), ("stream", np.array([True]), "BOOL")):
                inputs.append(grpcclient.InferInput(name, list(a.shape), kind))
                inputs[-1].set_data_from_numpy(a)
            client.async_stream_infer("smol", inputs, request_id="g")
            error = None
            while error is None:
                error = q.get(timeout=120)
            got["grpc"] = str(error)
            client.stop_stream()  # NOTE: a stream left open holds the model in Triton until its exit timeout
            client.close()

        threads = [threading.Thread(target=f) for f in (stream, whole, grpc_stream)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not re.search(r'kvexport_requests_running\{[^}]*\} 3\b',
                            httpx.get(f"http://{HOST}:{metrics}/metrics", timeout=10).text):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        ended = time.monotonic() - t0
        code = proc.wait(timeout=grace + 60)
        exited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text(errors="replace")
    print(f"requests ended {ended:.1f}s, triton-serve exited {exited:.1f}s after SIGTERM (grace {grace}s), "
          f"code {code}")
    assert "the server is shutting down" in got["stream"][-1] and len(got["stream"]) > 1
    assert "the server is shutting down" in got["generate"] and "the server is shutting down" in got["grpc"]
    assert code == 0 and "tritonserver exited with code 0" in text
    assert ended < grace + 5 and exited < grace + 20
    assert not [p for p in server_pids if _alive(p)]  # neither tritonserver nor the stub is left
    assert "Signal (11)" not in text and "Exit timeout expired" not in text
