"""A grammar's compile tried first in a child process that is killed at the deadline, so a compile a
client made too costly stops costing CPU and memory the moment it is refused (issue 48: eight
5,000-property schemas each left an uninterruptible compile thread running; 0.17 s -> 3.3 s per
request, RSS 1.5 -> 2.6 GiB, for 90 s).

    StructuredOutputManager.compile(spec)
        └─ CompileTrials.run(spec, param)   TRIAL_WORKERS children (`python -m` this module; xgrammar on one
               │                             thread, the server's tokenizer tables), one trial each at a time:
               │                             compile_spec + the first mask, one JSON line each way;
               │                             past the deadline the child is killed (a new one starts on
               │                             the next trial) -> GrammarError
               │                             more than MAX_PENDING trials waiting -> GrammarBusyError (503)
               ▼
        the in-process compile (structured.py) of a spec its trial compiled in time

NOTE: the trial's grammar is not handed back: a compiled grammar serializes to hundreds of MB for a
schema that compiles in 0.3 s (xgrammar 0.2.8, 1,000 required properties: 227 MB, 35 s to serialize),
so the server compiles it again, which costs about what the trial took (bounded by the deadline, and
one at a time: the manager's compile thread).

NOTE: children are plain subprocesses, not multiprocessing's: a fork would copy a server holding
onnxruntime's and the engine's threads, and a spawn re-imports the parent's main module (an
unguarded user script would start again). A child's start (importing xgrammar, ~2 s) is not on
the clock: it is ready before a trial is sent.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict
from typing import Any

from .grammars import GrammarError

log = logging.getLogger(__name__)

TRIAL_WORKERS = 1  # child processes compiling at once (each one thread): what refused grammars can cost
MAX_PENDING = 8  # trials waiting or running at most; more are refused as busy (503)
START_TIMEOUT_S = 120.0  # a child's start (imports, the tokenizer's tables): not the client's grammar
IDLE_EXIT_S = 300.0  # a child idle this long exits (~300 MB each); the server starts another when it needs one


def _python() -> str:
    """The interpreter for children: this one, unless it is an embedding host (Triton's Python
    backend stub), then the environment's own python."""
    exe = sys.executable or ""
    if os.path.basename(exe).startswith("python"):
        return exe
    for name in ("python3", "python"):
        cand = os.path.join(sys.prefix, "bin", name)
        if os.path.exists(cand):
            return cand
    return exe


class _Child:
    """One child process and the bytes it has written that are not a whole line yet."""

    def __init__(self, tokenizer_info_json: str):
        # NOTE: the parent's import path, so the child finds kvexport and xgrammar wherever the parent did (an
        # embedding host's interpreter may not be the environment's)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([_python(), "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, bufsize=0, env=env)
        self._buf = b""
        self.last_used = time.monotonic()
        self.send(tokenizer_info_json)
        if self.read_line(START_TIMEOUT_S) != "ready":
            self.kill()
            raise RuntimeError("the grammar compiler's child process did not start")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        data = memoryview(line.encode() + b"\n")
        while data:  # NOTE: unbuffered: a write may take part of it (the tokenizer's tables are ~1.6 MB)
            data = data[self.proc.stdin.write(data):]

    def read_line(self, timeout_s: float) -> str | None:
        """The next line the child writes, or None when `timeout_s` passes (or it died) first."""
        assert self.proc.stdout is not None
        fd, end = self.proc.stdout.fileno(), time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the child died
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class GrammarBusyError(GrammarError):
    """Too many grammars are being compiled right now; the client may retry (HTTP 503)."""

    status = 503


class CompileTrials:
    """The child processes that try compiles against a deadline. Thread-safe; children start on first
    use and after a kill. `started` / `killed`: children started and killed so far."""

    def __init__(self, tokenizer_info_json: str, timeout_s: float, workers: int = TRIAL_WORKERS,
                 max_pending: int = MAX_PENDING):
        self._info = tokenizer_info_json
        self.timeout_s, self.max_pending = timeout_s, max_pending
        self._idle: list[_Child | None] = [None] * workers  # a free slot: a child, or None (start one)
        self._free = threading.Semaphore(workers)
        self._lock = threading.Lock()
        self._pending = 0
        self.started = self.killed = 0
        # NOTE: an engine dropped without close() (a script's LLM) takes its children with it
        weakref.finalize(self, _kill_all, self._idle)

    def run(self, spec: Any, param: str) -> None:
        """Compile `spec` in a child within timeout_s (the wait for a free child not counted). Returns
        when it compiled and admits output; raises GrammarError naming `param` when it is refused or
        took longer (the child is killed), GrammarBusyError when MAX_PENDING trials are already queued."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise GrammarBusyError(f"{param}: the server is compiling {self._pending} other grammars; retry "
                                       f"in a few seconds", param, code="grammar_compile_busy")
            self._pending += 1
        try:
            with self._free:
                with self._lock:
                    child = self._idle.pop()
                try:
                    if child is not None and (child.proc.poll() is not None
                                              or time.monotonic() - child.last_used > IDLE_EXIT_S - 10):
                        child.kill()  # NOTE: gone (killed from outside), or about to exit idle: replaced, not raced
                        child = None
                    if child is None:
                        child = _Child(self._info)
                        self.started += 1
                    child.last_used = time.monotonic()
                    child.send(json.dumps({"spec": asdict(spec), "param": param}))
                    line = child.read_line(self.timeout_s)
                    died = line is None and child.proc.poll() is not None
                    if line is None:
                        child.kill()
                        self.killed += 1
                        child = None
                finally:
                    with self._lock:
                        self._idle.append(child)
        finally:
            with self._lock:
                self._pending -= 1
        if died:
            raise GrammarError(f"{param}: the grammar compiler crashed on this {spec.kind}; simplify it", param,
                               code="invalid_grammar")
        if line is None:
            raise GrammarError(f"{param}: compiling this {spec.kind} took longer than {self.timeout_s:g} s, so it "
                               f"was refused; simplify it", param, code="grammar_compile_timeout")
        verdict = json.loads(line)
        if verdict["error"] is not None:
            raise GrammarError(verdict["error"], param, code=verdict["code"])

    def close(self) -> None:
        """Stop the children."""
        with self._lock:
            _kill_all(self._idle)


def _kill_all(slots: list[_Child | None]) -> None:
    """Kill the children in `slots` (left empty: a later trial starts new ones)."""
    for i, c in enumerate(slots):
        if c is not None:
            c.kill()
            slots[i] = None


def _serve() -> None:
    """The child: the tokenizer's tables on the first line of stdin, then one trial per line
    ({"spec": StructuredOutputs fields, "param"}) answered with {"error", "code"} (null when it
    compiled and admits output)."""
    import xgrammar as xgr

    from ..sampling_params import StructuredOutputs
    from .grammars import GrammarError, check_admits_output, compile_spec  # NOTE: not __main__'s own class

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(sys.stdin.readline()), max_threads=1,
                                   cache_enabled=False)
    print("ready", flush=True)
    while select.select([sys.stdin], [], [], IDLE_EXIT_S)[0]:  # NOTE: one line at a time: nothing sits buffered
        line = sys.stdin.readline()
        if not line:  # the server is gone
            return
        ask = json.loads(line)
        spec, param = StructuredOutputs(**ask["spec"]), ask["param"]
        try:
            check_admits_output(compile_spec(compiler, spec, param), spec, param)
            print(json.dumps({"error": None, "code": None}), flush=True)
        except GrammarError as e:
            print(json.dumps({"error": str(e), "code": e.code}), flush=True)
        except Exception as e:  # noqa: BLE001 - the compiler's own failure on this spec: the client's input
            print(json.dumps({"error": f"{param}: compiling this {spec.kind} failed: {str(e)[:300]}",
                              "code": "invalid_grammar"}), flush=True)


if __name__ == "__main__":
    _serve()
