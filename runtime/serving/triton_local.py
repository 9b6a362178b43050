"""Start the `tritonserver` binary shipped in the `nvidia-pytriton` wheel on this machine
(CPU works) for a repository written by `kvexport triton`. This module owns finding that
binary, laying out a Python-backend folder with the stub for the execution environment's
Python version, and the server's command line; tests and users on machines without the
Triton container use it (in the container, run /opt/tritonserver/bin/tritonserver). Also
`wait_http_ready`, the readiness wait shared by everything that starts a local server
(tritonserver, `kvexport serve`), and `serve_repository`, `kvexport triton-serve`: one
command that runs a generated repository on whichever server it finds (`locate`).

    serve_repository(REPO) ─▶ tritonserver (own process group; its log on our stdout/stderr)
      SIGTERM/SIGINT ─▶ SIGTERM to tritonserver (it takes no new requests, waits for open ones)
                        after `grace` s: touch $KVEXPORT_SHUTDOWN_FILE ─▶ the models end what is open
                        ─▶ Triton unloads them (finalize) and exits; anything left in its group is killed
      SIGKILL (nothing of ours runs) ─▶ the kernel sends tritonserver SIGKILL (PR_SET_PDEATHSIG), its
                        stub follows it; the next start removes the dead run's temp folder and
                        shared memory (both named kvexport-triton-<pid>-…, see `clean_stale_runs`)

    <site-packages>/pytriton/tritonserver/bin/tritonserver
    <site-packages>/pytriton/tritonserver/backends/python/{libtriton_python.so, triton_python_backend_utils.py}
    <site-packages>/pytriton/tritonserver/python_backend_stubs/<X.Y>/triton_python_backend_stub
    <site-packages>/nvidia_pytriton.libs/      shared libraries the binaries need

NOTE: the stub in that wheel is compiled against numpy 1.x (pybind11's numpy 1 ABI); in
an environment with numpy 2 every BYTES tensor it reads is garbage and the stub dies. The
environment that runs the model (EXECUTION_ENV_PATH) therefore needs numpy<2 —
`scripts/install.sh --dev` makes one, `.venv-triton`, with kvexport's runtime dependencies.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvexport.errors import ConfigError, KvExportError

log = logging.getLogger(__name__)

TRITON_ENV_VAR = "KVEXPORT_TRITON_ENV"  # a Python environment holding nvidia-pytriton's tritonserver
SHUTDOWN_GRACE_S = 10.0  # triton-serve: after SIGTERM/SIGINT, seconds open requests may run before they are ended
# NOTE: tritonserver's --exit-timeout-secs is grace + this: after the grace the models end every
# request, so HTTP connections close and the models unload at once; a gRPC client that keeps
# its stream open holds the model (Triton 2.51) until the timeout, then Triton exits with 1
EXIT_AFTER_GRACE_S = 10
READY_TIMEOUT_S = 600.0  # longest triton-serve waits for the models to load
# triton-serve's temp folder (the Python backend + stub, the shutdown file) is TEMP_PREFIX<pid>-<random>
# in the system temp folder; the Python backend's shared-memory regions in SHM_DIR start with its name
TEMP_PREFIX = "kvexport-triton-"
SHM_DIR = Path("/dev/shm")
SERVER_PID_FILE = "pids"  # in the temp folder: "pid start-time" of triton-serve and tritonserver
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
INSTALL_HINT = ("install one: `bash scripts/install.sh --dev` makes .venv-triton with it (by hand: "
                "`/usr/bin/python3.11 -m venv .venv-triton && .venv-triton/bin/pip install --no-deps "
                "nvidia-pytriton==0.7.0` plus kvexport's runtime and numpy<2, see docs/DEPLOYMENT.md), then pass "
                "--triton-env .venv-triton; or use the NVIDIA Triton container, whose tritonserver is on PATH")


class TritonNotFoundError(KvExportError):
    """No usable tritonserver (or Python-backend stub) was found."""


class ServerStartError(KvExportError):
    """A local server process exited, or did not answer its readiness URL in time."""


def wait_http_ready(url: str, proc: subprocess.Popen, timeout: float, poll: float = 0.5) -> float:
    """Poll `url` (a health/readiness endpoint of the server `proc` runs) until it answers
    200; returns the seconds waited. Raises ServerStartError when `proc` exits first or
    `timeout` seconds pass (the caller adds the server's log)."""
    import httpx

    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise ServerStartError(f"the server exited with code {proc.returncode} before {url} was ready")
        if time.monotonic() - t0 > timeout:
            raise ServerStartError(f"{url} was not ready after {timeout:.0f} s")
        time.sleep(poll)


@dataclass(frozen=True, slots=True)
class TritonInstall:
    root: Path  # .../site-packages/pytriton/tritonserver (or the container's /opt/tritonserver)
    libs: Path  # .../site-packages/nvidia_pytriton.libs
    env: Path | None = None  # the Python environment it was found in (None: a tritonserver on PATH)

    @property
    def server(self) -> Path:
        return self.root / "bin" / "tritonserver"

    def stub(self, python_version: str) -> Path:
        return self.root / "python_backend_stubs" / python_version / "triton_python_backend_stub"


def python_version(env: str | Path) -> str:
    """'3.11' for the Python environment (venv) at env."""
    exe = Path(env) / "bin" / "python3"
    if not exe.exists():
        raise TritonNotFoundError(f"{env} is not a Python environment (no bin/python3)")
    out = subprocess.run([str(exe), "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def find_triton(env: str | Path) -> TritonInstall:
    """The nvidia-pytriton install inside the Python environment env."""
    for sp in sorted(Path(env).glob("lib/python3*/site-packages")):
        root = sp / "pytriton" / "tritonserver"
        if (root / "bin" / "tritonserver").exists():
            return TritonInstall(root, sp / "nvidia_pytriton.libs", Path(env).absolute())
    raise TritonNotFoundError(f"no tritonserver in {env}: install it with "
                              f"`{env}/bin/pip install --no-deps nvidia-pytriton==0.7.0` (see scripts/install_dev.sh)")


def _candidate_envs() -> list[str]:
    """Where `locate` looks for nvidia-pytriton, in order."""
    candidates = [os.environ.get(TRITON_ENV_VAR), sys.prefix, Path.cwd() / ".venv-triton",
                  Path(__file__).resolve().parents[1] / ".venv-triton"]  # the source checkout's
    return list(dict.fromkeys(str(c) for c in candidates if c))


def locate(triton_env: str | Path | None = None) -> TritonInstall:
    """The tritonserver to run: the one in `triton_env` when given; else the first of
    $KVEXPORT_TRITON_ENV, this Python's environment, ./.venv-triton, the source checkout's
    .venv-triton (nvidia-pytriton in each), and a `tritonserver` on PATH (the NVIDIA
    container). Raises TritonNotFoundError saying how to install one."""
    if triton_env is not None:
        if not Path(triton_env).is_dir():
            raise TritonNotFoundError(f"--triton-env {triton_env}: no such folder; {INSTALL_HINT}")
        return find_triton(triton_env)
    looked = []
    for env in _candidate_envs():
        looked.append(env)
        try:
            return find_triton(env)
        except TritonNotFoundError:
            continue
    on_path = shutil.which("tritonserver")
    if on_path:
        root = Path(on_path).resolve().parents[1]
        return TritonInstall(root, root / "lib")
    raise TritonNotFoundError(f"no tritonserver found (looked for nvidia-pytriton in {', '.join(looked)} and for "
                              f"`tritonserver` on PATH); {INSTALL_HINT}")


def backend_dir(triton: TritonInstall, python_version: str, dest: str | Path) -> Path:
    """A --backend-directory with the Python backend and the stub for python_version."""
    stub = triton.stub(python_version)
    if not stub.exists():
        have = sorted(p.name for p in (triton.root / "python_backend_stubs").iterdir())
        raise TritonNotFoundError(f"no Python-backend stub for Python {python_version} (have {', '.join(have)}): "
                                  f"make the execution environment with one of those versions")
    dest = Path(dest)
    py = dest / "python"
    if py.exists():
        shutil.rmtree(py)
    shutil.copytree(triton.root / "backends" / "python", py, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, py / "triton_python_backend_stub")
    return dest


@dataclass(frozen=True, slots=True)
class Ports:
    http: int
    grpc: int
    metrics: int


def server_command(triton: TritonInstall, repo: str | Path, backends: str | Path | None, ports: Ports,
                   host: str = "127.0.0.1") -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that start tritonserver on host for the repository (backends:
    a `backend_dir`, or None for the server's own, as in the container)."""
    argv = [str(triton.server), f"--model-repository={repo}",
            *([f"--backend-directory={backends}"] if backends is not None else []),
            f"--http-address={host}", f"--http-port={ports.http}", f"--grpc-address={host}",
            f"--grpc-port={ports.grpc}", f"--metrics-address={host}", f"--metrics-port={ports.metrics}",
            "--allow-gpu-metrics=false", "--exit-on-error=true", "--log-verbose=0"]
    env = dict(os.environ)
    if triton.env is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(triton.libs), env.get("LD_LIBRARY_PATH")) if p)
    return argv, env


# ---- kvexport triton-serve ---------------------------------------------------------------------
def _stub_python(repo: Path, triton: TritonInstall) -> tuple[str, Path | None]:
    """(Python version the stub must be built for, environment to put first on PATH or None):
    the models' EXECUTION_ENV_PATH, or the Triton environment's own Python (put first on PATH,
    so the stub's `python3` is it)."""
    from .triton_repo import check_repository, load_config

    check_repository(repo)
    envs = {p.string_value for cfg in map(load_config, sorted(repo.glob("*/config.pbtxt")))
            for k, p in cfg.parameters.items() if k == "EXECUTION_ENV_PATH" and p.string_value}
    versions = {e: python_version(e) for e in sorted(envs) if Path(e).is_dir()}  # (not a packed .tar.gz)
    if len(set(versions.values())) > 1:
        raise ConfigError(f"the models run in environments of different Python versions ({versions}); one "
                          f"tritonserver has one Python-backend stub: regenerate them with one --execution-env")
    if versions:
        return next(iter(versions.values())), None
    if triton.env is None:
        return "", None
    return python_version(triton.env), triton.env


def serve_repository(repo: str | Path, triton_env: str | Path | None = None, host: str = "127.0.0.1",
                     ports: Ports = Ports(8000, 8001, 8002), grace: float = SHUTDOWN_GRACE_S,
                     on_ready: Callable[[str], None] | None = None, ready_timeout: float = READY_TIMEOUT_S) -> int:
    """Run tritonserver on a repository written by `kvexport triton` until it exits or this
    process gets SIGTERM/SIGINT; returns its exit code (128 + N when signal N ended it).
    `on_ready(url)` is called once every model is loaded. On SIGTERM/SIGINT open requests
    have `grace` s to finish, then get an error response (the models watch the file named
    by $KVEXPORT_SHUTDOWN_FILE); whatever is left of the server's processes (the
    Python-backend stub) is killed at the end."""
    from .triton_model import SHUTDOWN_FILE_ENV

    repo = Path(repo).resolve()
    if not repo.is_dir():
        raise ConfigError(f"{repo}: no such model repository; write one with `kvexport triton BUILD --out {repo}`")
    triton = locate(triton_env)
    version, path_env = _stub_python(repo, triton)
    clean_stale_runs()
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-"))
    try:
        backends = backend_dir(triton, version, tmp) if triton.env is not None else None
        shutdown_file = tmp / "shutdown"
        argv, env = server_command(triton, repo, backends, ports, host)
        argv.append(f"--exit-timeout-secs={math.ceil(grace) + EXIT_AFTER_GRACE_S}")
        if backends is not None:  # its shared memory named after this run, so a later start can remove it
            argv.append(f"--backend-config=python,shm-region-prefix-name={tmp.name}")
        env[SHUTDOWN_FILE_ENV] = str(shutdown_file)
        if path_env is not None:
            env["PATH"] = os.pathsep.join((str(path_env / "bin"), env.get("PATH", "")))
        with _stop_signals() as stopping:
            # NOTE: its own session, so a terminal's Ctrl-C reaches only us and we shut it down in order;
            # and it dies with us (SIGKILL from the kernel when this thread ends), so `kill -9` of
            # triton-serve leaves no server holding the ports
            proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_die_with_parent())
            pids = "".join(f"{p} {_start_time(p) or ''}\n" for p in (os.getpid(), proc.pid))
            (tmp / SERVER_PID_FILE).write_text(pids)
            try:
                try:
                    _wait_ready(f"http://{host}:{ports.http}/v2/health/ready", proc, ready_timeout, stopping)
                    if not stopping.is_set() and on_ready is not None:
                        on_ready(f"http://{host}:{ports.http}")
                    while proc.poll() is None and not stopping.wait(0.2):
                        pass
                finally:
                    if proc.poll() is None:
                        _stop_server(proc, shutdown_file, grace)
            finally:
                _kill_group(proc.pid)
    finally:
        _remove_run(tmp)
    code = proc.returncode
    return 128 - code if code < 0 else code


class _stop_signals:
    """While active (main thread only): the first SIGTERM or SIGINT sets the event (an orderly
    shutdown), a second one raises KeyboardInterrupt (kill now); the previous handlers come
    back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self) -> threading.Event:
        self.event, self.previous = threading.Event(), {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self.event

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float, stopping: threading.Event) -> None:
    import httpx

    t0 = time.monotonic()
    while not stopping.is_set():
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise ServerStartError(f"tritonserver exited with code {proc.returncode} before its models were ready "
                                   f"(its log is above)")
        if time.monotonic() - t0 > timeout:
            raise ServerStartError(f"tritonserver's models were not ready after {timeout:.0f} s")
        stopping.wait(0.5)


def _stop_server(proc: subprocess.Popen, shutdown_file: Path, grace: float) -> None:
    """SIGTERM; after `grace` s the models end what is open; SIGKILL if it still runs after
    Triton's own exit timeout."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
        return
    except subprocess.TimeoutExpired:
        pass
    shutdown_file.touch()
    try:
        proc.wait(EXIT_AFTER_GRACE_S + 10)
    except subprocess.TimeoutExpired:
        log.warning("tritonserver did not exit %.0f s after SIGTERM; killing it", grace + EXIT_AFTER_GRACE_S + 10)
        proc.kill()
        proc.wait()


def _kill_group(pgid: int) -> None:
    """Kill what is left of the server's process group (a Python-backend stub ignores SIGTERM)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- a run that was killed ------------------------------------------------------------------------
def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get SIGKILL when the thread that starts it ends
    (Linux prctl PR_SET_PDEATHSIG); None where there is no prctl. NOTE: the signal follows
    the starting *thread*: serve_repository starts and waits for the server on one thread."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _start_time(pid: int) -> str | None:
    """Process pid's start time (clock ticks after boot, /proc/PID/stat field 22); None when it
    is gone, or a zombie (exited, not yet reaped), or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _alive(pid: int, start: str | None) -> bool:
    """Whether process pid runs and, where its start time was recorded, is the same process
    (NOTE: pids are reused; pid_max is often 32768)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    now = _start_time(pid)
    if now is None:  # a zombie (an orphan's lingers until init reaps it); or no /proc to tell: alive
        return not Path("/proc/self/stat").exists()
    return start is None or now == start


def _run_pids(folder: Path) -> list[tuple[int, str | None]] | None:
    """(pid, start time) of triton-serve and tritonserver of a run's temp folder (SERVER_PID_FILE:
    a line "pid start" each); None for a name that is not TEMP_PREFIX<pid>-<random>."""
    pid, sep, _ = folder.name[len(TEMP_PREFIX):].partition("-")
    if not (sep and pid.isdigit()):
        return None
    pids: dict[int, str | None] = {int(pid): None}
    try:
        for line in (folder / SERVER_PID_FILE).read_text().splitlines():
            p, _, start = line.partition(" ")
            pids[int(p)] = start or None
    except (OSError, ValueError):
        pass
    return list(pids.items())


def _remove_run(folder: Path) -> None:
    """A run's temp folder and the Python backend's shared-memory regions named after it."""
    shutil.rmtree(folder, ignore_errors=True)
    for region in SHM_DIR.glob(f"{folder.name}*") if SHM_DIR.is_dir() else ():
        try:
            region.unlink()
        except OSError:
            pass


def clean_stale_runs(temp_root: str | Path | None = None) -> list[Path]:
    """Remove what triton-serve runs that were killed (SIGKILL: no cleanup ran) left behind:
    their temp folders and shared-memory regions, for runs of this user whose triton-serve
    and tritonserver processes are both gone. Returns the folders removed."""
    removed = []
    for folder in sorted(Path(temp_root or tempfile.gettempdir()).glob(f"{TEMP_PREFIX}*")):
        pids = _run_pids(folder)
        try:
            mine = folder.is_dir() and not folder.is_symlink() and folder.stat().st_uid == os.getuid()
        except OSError:
            continue
        if pids is None or not mine or any(_alive(p, start) for p, start in pids):
            continue
        log.info("removing %s, left by a triton-serve run that was killed", folder)
        _remove_run(folder)
        removed.append(folder)
    return removed
