"""Start the `tritonserver` binary shipped in the `nvidia-pytriton` wheel on this machine
(CPU works) for a repository written by `kvexport triton`. This module owns finding that
binary, laying out a Python-backend folder with the stub for the execution environment's
Python version, and the server's command line; tests and users on machines without the
Triton container use it (in the container, run /opt/tritonserver/bin/tritonserver). Also
`wait_http_ready`, the readiness wait shared by everything that starts a local server
(tritonserver, `kvexport serve`).

    <site-packages>/pytriton/tritonserver/bin/tritonserver
    <site-packages>/pytriton/tritonserver/backends/python/{libtriton_python.so, triton_python_backend_utils.py}
    <site-packages>/pytriton/tritonserver/python_backend_stubs/<X.Y>/triton_python_backend_stub
    <site-packages>/nvidia_pytriton.libs/      shared libraries the binaries need

NOTE: the stub in that wheel is compiled against numpy 1.x (pybind11's numpy 1 ABI); in
an environment with numpy 2 every BYTES tensor it reads is garbage and the stub dies. The
environment that runs the model (EXECUTION_ENV_PATH) therefore needs numpy<2 —
`scripts/install.sh` makes one, `.venv-triton`, with kvexport's runtime dependencies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvexport.errors import KvExportError


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
    root: Path  # .../site-packages/pytriton/tritonserver
    libs: Path  # .../site-packages/nvidia_pytriton.libs

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
            return TritonInstall(root, sp / "nvidia_pytriton.libs")
    raise TritonNotFoundError(f"no tritonserver in {env}: install it with "
                              f"`{env}/bin/pip install --no-deps nvidia-pytriton==0.7.0` (see scripts/install.sh)")


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


def server_command(triton: TritonInstall, repo: str | Path, backends: str | Path, ports: Ports,
                   host: str = "127.0.0.1") -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that start tritonserver on host for the repository."""
    argv = [str(triton.server), f"--model-repository={repo}", f"--backend-directory={backends}",
            f"--http-address={host}", f"--http-port={ports.http}", f"--grpc-address={host}",
            f"--grpc-port={ports.grpc}", f"--metrics-address={host}", f"--metrics-port={ports.metrics}",
            "--allow-gpu-metrics=false", "--exit-on-error=true", "--log-verbose=0"]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(triton.libs), env.get("LD_LIBRARY_PATH")) if p)
    return argv, env
