"""Fixtures shared by the runtime's server tests (the tiny build with a tokenizer and chat
template, `chat_build`, is in tests/conftest.py): `kvexport serve` as a
subprocess on 127.0.0.1, found ready by the line it prints once the model is loaded and
the port bound."""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

READY = re.compile(r"serving .* on (http://\S+)/v1")


class Served:
    """A `kvexport serve` subprocess: its base URL, its process, its log (stdout + stderr)."""

    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log, self.base = proc, log, ""

    def wait_ready(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            m = READY.search(self.log.read_text(errors="replace"))
            if m:
                self.base = m.group(1)
                return self.base
            if self.proc.poll() is not None:
                raise AssertionError(f"kvexport serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"kvexport serve not ready after {timeout} s:\n{self.log.read_text()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_serve(build_dir, log: Path, *args: str) -> Served:
    """`kvexport serve build_dir --port 0 ...args` (any free port), logging to `log`."""
    with open(log, "w") as f:
        # NOTE: cwd outside the repository, so `kvexport` is the installed package
        proc = subprocess.Popen([sys.executable, "-m", "kvexport.cli", "serve", str(build_dir), "--port", "0",
                                 "--threads", "1", *args], cwd=str(log.parent), stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, COLUMNS="400"))
    return Served(proc, log)


@pytest.fixture
def serve_process(tmp_path):
    """start(build_dir, *args) -> a ready Served; every one started is stopped at the end."""
    started: list[Served] = []

    def start(build_dir, *args: str, ready: bool = True) -> Served:
        s = start_serve(build_dir, tmp_path / f"serve{len(started)}.log", *args)
        started.append(s)
        if ready:
            s.wait_ready()
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def free_ports():
    """free_ports(n): n distinct TCP ports free on 127.0.0.1 now."""
    def get(n: int) -> list[int]:
        socks = [socket.socket() for _ in range(n)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            return [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()

    return get


@pytest.fixture(scope="module")
def serve_module(tmp_path_factory):
    """serve_process for a whole test module: start(build_dir, *args) -> a ready Served."""
    started: list[Served] = []
    logs = tmp_path_factory.mktemp("serve-module")

    def start(build_dir, *args: str) -> Served:
        s = start_serve(build_dir, logs / f"serve{len(started)}.log", *args)
        started.append(s)
        s.wait_ready()
        return s

    yield start
    for s in started:
        s.stop()
