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
REPO_ROOT = Path(__file__).resolve().parents[3]
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
                                  ("max_tokens", np.array([450], np.int64), "INT64"),
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


def _start_triton_serve(build_dir, tmp_path, ports, name: str, temp_root) -> tuple[subprocess.Popen, Path]:
    """`kvexport triton-serve` of a one-model repository of build_dir, temp folders under temp_root."""
    repo = tmp_path / f"repo-{name}"
    if not repo.exists():
        write_repository(build_dir, repo, TritonRepoOptions(
            engine=EngineConfig(kv_cache_memory="1MiB", threads=1), name="m", execution_env=str(TRITON_ENV)))
    log = tmp_path / f"{name}.log"
    http, grpc, metrics = ports
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvexport.cli", "triton-serve", str(repo), "--triton-env",
                                 str(TRITON_ENV), "--http-port", str(http), "--grpc-port", str(grpc),
                                 "--metrics-port", str(metrics)], stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env=dict(os.environ, COLUMNS="400", TMPDIR=str(temp_root)))
    deadline = time.monotonic() + 180
    while "Triton serving" not in log.read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-5000:]
        time.sleep(0.2)
    return proc, log


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_sigkill_takes_the_server_along_and_the_next_start_cleans_up(chat_build, tmp_path, free_ports):
    """`kill -9` of triton-serve: tritonserver (PR_SET_PDEATHSIG) and the model's stub (it sees its
    parent gone) exit within seconds and the ports are free; the dead run's temp folder and
    shared memory stay until the next start removes them."""
    if not (TRITON_ENV / "bin" / "python3").exists():
        pytest.skip(f"no Triton execution environment at {TRITON_ENV}: run scripts/install.sh --dev")
    temp_root = tmp_path / "tmp"
    temp_root.mkdir()
    ports = free_ports(3)
    proc, log = _start_triton_serve(chat_build, tmp_path, ports, "first", temp_root)
    server_pids: set[int] = set()
    try:
        server_pids = _descendants(proc.pid)
        assert len(server_pids) >= 2  # tritonserver and the model's stub
        (run,) = temp_root.glob(f"{triton_local.TEMP_PREFIX}{proc.pid}-*")
        shm = sorted(triton_local.SHM_DIR.glob(f"{run.name}*"))
        assert shm  # the Python backend's regions are named after the run
        t0 = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        while [p for p in server_pids if _alive(p)] and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        gone = time.monotonic() - t0
    finally:
        proc.kill()
        for p in server_pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    print(f"tritonserver and its stub gone {gone:.1f}s after SIGKILL of triton-serve")
    assert not [p for p in server_pids if _alive(p)] and gone < 10
    assert all(_port_free(p) for p in ports)
    assert run.is_dir() and all(r.exists() for r in shm)  # nothing of ours ran to remove them
    second, log2 = _start_triton_serve(chat_build, tmp_path, free_ports(3), "second", temp_root)
    try:
        assert not run.exists() and not [r for r in shm if r.exists()]  # the dead run's, removed
        assert len(list(temp_root.glob(f"{triton_local.TEMP_PREFIX}{second.pid}-*"))) == 1  # its own, kept
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0, log2.read_text(errors="replace")[-3000:]
    assert not list(temp_root.iterdir())  # an orderly exit leaves nothing


def test_clean_stale_runs_keeps_live_and_foreign_folders(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{triton_local.TEMP_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{triton_local.TEMP_PREFIX}{os.getpid()}-def"  # this process: alive
    server_alive = tmp_path / f"{triton_local.TEMP_PREFIX}{dead.pid}-ghi"  # its tritonserver still runs
    unnamed = tmp_path / f"{triton_local.TEMP_PREFIX}xyz"  # an older run's name, without a pid: unknown
    for d in (stale, live, server_alive, unnamed):
        (d / "python").mkdir(parents=True)
    (server_alive / triton_local.SERVER_PID_FILE).write_text(f"{dead.pid} \n{os.getpid()} \n")
    reused = tmp_path / f"{triton_local.TEMP_PREFIX}{dead.pid}-jkl"  # its server's pid now names another process
    (reused / "python").mkdir(parents=True)
    (reused / triton_local.SERVER_PID_FILE).write_text(f"{dead.pid} 1\n{os.getpid()} 1\n")
    assert triton_local.clean_stale_runs(tmp_path) == [stale, reused]
    assert not stale.exists() and live.exists() and server_alive.exists() and unnamed.exists()
