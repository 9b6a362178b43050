"""The build's files against the sha256 checksums its manifest records (kvexport.json
`weights.sha256`; the TensorRT engines' `engines.engines[phase].sha256`): a weights file damaged
after the build (a byte range zeroed, a bad copy, another build's file of the same size) is
refused before anything is served, never served as different text.

Two callers:

  - the engine's start (runtime/engine.py): `Verification.start()` hashes the weights file on a
    thread while onnxruntime opens its sessions, and `wait()` (after the sessions are made,
    before the engine exists) raises ChecksumError on a mismatch. Serving waits for it.
  - `kvexport inspect --verify BUILD`: `verify_build()` hashes every file that has a checksum.

Cost: sha256 reads the whole file once; on this project's CI machine (2 cores, x86 SHA-NI)
hashlib's sha256 runs at 1.5-1.9 s per GiB from the page cache (docs/DEPLOYMENT.md "Checksums
at start"), which the engine overlaps with loading the sessions (that reads the same file).

NOTE: `manifest.load()` only checks each file's size (cheap); hashing is left to the callers
that are about to trust the bytes (serving) or were asked to (inspect --verify).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import ChecksumError

log = logging.getLogger(__name__)

_CHUNK = 1 << 22  # bytes per read (hashlib releases the GIL while hashing a chunk this size)
_REBUILD = ("copy the build again from where it was made, or rebuild it with "
            "`kvexport build MODEL --out BUILD --force`")


@dataclass(frozen=True, slots=True)
class Checked:
    """One file hashed: where, how big, and how long it took."""

    path: Path
    bytes: int  # file size, bytes
    seconds: float  # wall time of the hash


def sha256_file(path: Path, stop: threading.Event | None = None) -> str | None:
    """Hex sha256 of `path`, read in chunks; None when `stop` was set before the end."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            if stop is not None and stop.is_set():
                return None
            h.update(chunk)
    return h.hexdigest()


def check_file(path: Path, field: str, expected: str, stop: threading.Event | None = None) -> Checked | None:
    """Hash `path` and raise ChecksumError unless it is `expected` (the manifest's `field`);
    None when stopped before the end."""
    t0 = time.perf_counter()
    try:
        actual = sha256_file(path, stop)
    except OSError as e:
        raise ChecksumError(f"{path} could not be read to check its sha256 ({e}); {_REBUILD}") from None
    if actual is None:
        return None
    if actual != expected:
        raise ChecksumError(f"{path} does not match the sha256 its manifest records (manifest field {field!r}: "
                            f"{expected[:16]}..., the file's: {actual[:16]}...): it was damaged or replaced after "
                            f"the build, and would serve different text; {_REBUILD}")
    return Checked(path, path.stat().st_size, time.perf_counter() - t0)


def unrecorded(build_dir: Path, m) -> str:
    """Why a build's weights cannot be verified: its manifest predates `weights.sha256`."""
    return (f"{Path(build_dir) / m.weights.file}: the manifest records no sha256 for it (manifest field "
            f"'weights.sha256'; built by kvexport {m.kvexport_version}, before builds recorded one), so it "
            f"cannot be verified; rebuild with `kvexport build MODEL --out {build_dir} --force` to record one")


# NOTE: `m` below is a kvexport.manifest.Manifest (imported by report() alone: manifest.py stays free of it)
def verify_build(build_dir: str | Path, m) -> list[Checked]:
    """Every file of the build with a recorded checksum (weights, then TensorRT engines),
    hashed and compared; ChecksumError on the first mismatch, or when the weights have no
    recorded checksum (nothing would be verified)."""
    build_dir = Path(build_dir)
    if m.weights.sha256 is None:
        raise ChecksumError(unrecorded(build_dir, m))
    files = [(build_dir / m.weights.file, "weights.sha256", m.weights.sha256)]
    if m.engines is not None:
        files += [(build_dir / e.file, f"engines.engines.{phase}.sha256", e.sha256)
                  for phase, e in sorted(m.engines.engines.items())]
    out = []
    for path, field, expected in files:
        if not path.is_file():
            raise ChecksumError(f"{path}, listed in the manifest ({field!r}), is missing; {_REBUILD}")
        checked = check_file(path, field, expected)
        assert checked is not None  # NOTE: no stop event: hashed to the end
        out.append(checked)
    return out


class Verification:
    """The weights file's checksum, computed on a thread while the engine starts (its
    sessions load the same file meanwhile). `wait()` raises ChecksumError on a mismatch."""

    def __init__(self, build_dir: Path, m):
        self.path = Path(build_dir) / m.weights.file
        self.expected: str | None = m.weights.sha256
        self._why_not = unrecorded(build_dir, m) if self.expected is None else None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._done: Checked | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, build_dir: str | Path, m) -> "Verification":
        """Begin hashing `m`'s weights file in the background (nothing when none is recorded)."""
        v = cls(Path(build_dir), m)
        if v.expected is not None:
            v._thread = threading.Thread(target=v._run, name="kvexport-verify-weights", daemon=True)
            v._thread.start()
        return v

    def _run(self) -> None:
        assert self.expected is not None
        try:
            self._done = check_file(self.path, "weights.sha256", self.expected, self._stop)
        except BaseException as e:  # NOTE: re-raised by wait() in the starting thread
            self._error = e

    def wait(self) -> None:
        """Block until the hash is done; ChecksumError when it does not match. Logs the outcome
        (or, for a build without a recorded checksum, a warning that nothing was verified)."""
        if self._why_not is not None:
            log.warning("not verified: %s", self._why_not)
            return
        assert self._thread is not None, "Verification.wait() without start()"
        t0 = time.perf_counter()
        self._thread.join()
        if self._error is not None:
            raise self._error
        done = self._done
        assert done is not None  # NOTE: only cancel() stops the hash early, and nothing waits after it
        log.info("%s: sha256 verified (%.2f GiB in %.1f s, %.1f s of it waited for after the sessions loaded)",
                 done.path, done.bytes / 2**30, done.seconds, time.perf_counter() - t0)

    def cancel(self) -> None:
        """Stop hashing (the engine failed to start for another reason)."""
        self._stop.set()


def report(build_dir: str | Path) -> list[str]:
    """`kvexport inspect --verify`: the build loaded (manifest.load) and verify_build() run, one
    line per file verified; ChecksumError / ManifestError when it does not verify."""
    from . import manifest as mf

    return [f"verified: {c.path} matches its recorded sha256 ({c.bytes / 2**30:.3g} GiB in {c.seconds:.2f} s)"
            for c in verify_build(build_dir, mf.load(build_dir))]
