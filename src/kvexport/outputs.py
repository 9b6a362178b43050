"""Writing kvexport's output directories into place. A build (`kvexport build`) and a Triton
model repository (`kvexport triton`) both go through `write_dir`, which owns the one rule
about what `--force` may replace; engines/ inside a build uses the same temp-folder helpers.

    PARENT/
      OUT/                     the finished output: kvexport.json (a build) or
                               kvexport-triton.json (a Triton repository) inside
      .OUT.tmp-1a2b3c4d/       being written; .kvexport-owner inside names the process
      .OUT.old-5e6f7a8b/       the output being replaced, for the moment of the swap

- An output is written into a fresh temporary sibling and renamed into place only when
  complete: OUT is always the old output or the new one, never half-written.
- `force` replaces only what kvexport made and recognises: a build by its manifest, a Triton
  repository by its marker, of the kind being written and holding nothing kvexport did not
  write. Never a protected path (the model source, the build a repository serves) nor a
  folder containing one. Anything else is refused with OutputError, even with `force`.
- Temporary folders that earlier runs for the same OUT left behind (killed, crashed) are
  removed once their process is gone; those of a run still going are left alone.
- Folders and files are created with the umask's permissions (0755/0644 under umask 022),
  never tempfile's private 0700/0600: a server may run as another user.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import threading
import time
from enum import Enum
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

from . import __version__, io
from .errors import BuildExistsError, OutputError

log = logging.getLogger(__name__)
_T = TypeVar("_T")

OWNER_FILE = ".kvexport-owner"  # inside a temporary folder: JSON naming the process writing it
TRITON_MARKER = "kvexport-triton.json"  # at the root of a Triton repository kvexport wrote
# what a build may hold besides the paths its manifest names (older schemas; engines/ added by
# `kvexport engines`); "samples" and "engines" are exporter/samples.py's and tensorrt_build.ENGINES_DIR
_BUILD_NAMES = frozenset({io.MANIFEST_NAME, io.WEIGHTS_FILE, io.PREFILL_GRAPH, io.DECODE_GRAPH, io.TOKENIZER_DIR,
                          "samples", "engines", *io.INTEROP_FILES})
_CACHE_DIR = "__pycache__"  # Python writes it when Triton's backend imports 1/model.py
_TEMP = re.compile(r"(?P<kind>tmp|old)-[0-9a-f]{8}")  # after the ".OUT." prefix
_STEM_BYTES = 240  # NAME_MAX (255) less ".", ".tmp-XXXXXXXX"


class Kind(Enum):
    """What an output directory is; the value names it in messages."""
    BUILD = "kvexport build"
    TRITON = "Triton model repository written by kvexport"


# ---- the rule -----------------------------------------------------------------------------------


def write_dir(out: str | Path, produce: Callable[[Path], _T], *, kind: Kind, force: bool,
              protect: Iterable[tuple[str, str | Path]] = ()) -> _T:
    """Write the `kind` directory `out`: check that it may be written (the module's rule;
    `protect` holds (what, path) pairs `out` must neither be nor contain), remove stale temporary
    folders of earlier runs for it, run produce(tmp) on a fresh temporary sibling, and swap tmp
    into place. Returns what produce returned.

    Raises OutputError or BuildExistsError before produce runs, and again before the swap if
    something appeared at `out` meanwhile; on any failure or interruption the temporary folder
    is removed and `out` is as it was."""
    final = location(out)
    protect = tuple(protect)
    check(final, kind, force, protect)
    clean_stale(final)
    tmp = new_temp_dir(final.parent, sibling_prefix(final))
    try:
        try:
            result = produce(tmp)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
                hint = ("choose an --out on a writable disk" if e.errno == errno.EROFS else
                        "free some space or choose an --out on another disk")
                raise OutputError(f"could not write {final}: {e.strerror} (while writing {e.filename or tmp}); "
                                  f"{hint}") from None
            raise
        check(final, kind, force, protect)  # NOTE: again, something may have appeared at out meanwhile
        replace_dir(tmp, final)
    except BaseException:
        remove_dir(tmp)
        raise
    return result


def rewrite_dir(final: Path, produce: Callable[[Path], _T], *, leave_out: Iterable[str] = ()) -> _T:
    """Change the existing output `final` the way write_dir writes one: a temporary sibling
    gets a hard-linked copy of `final` (real copies where the file system has no hard links),
    less its top-level names in `leave_out` and its own temporary entries; produce(tmp)
    changes that copy, and it is swapped into place. On any failure or interruption `final` is
    as it was, whole. A `final` that is a symbolic link is followed: the folder it names is
    rewritten, the link kept.

    NOTE: produce must replace a file it changes (write a new file, rename it over the old),
    never write into one: the copy's files are the same inodes as `final`'s until then."""
    final = Path(os.path.realpath(final))
    clean_stale(final)
    tmp = new_temp_dir(final.parent, sibling_prefix(final))
    try:
        skip = set(leave_out) | {OWNER_FILE}
        for name in os.listdir(final):
            if name not in skip and not _is_temp(final / name, _BUILD_NAMES):
                _link_tree(final / name, tmp / name)
        result = produce(tmp)
        replace_dir(tmp, final)
    except BaseException:
        remove_dir(tmp)
        raise
    return result


def _link_tree(src: Path, dst: Path) -> None:
    """`dst` as a copy of `src` made of hard links (symbolic links copied as links)."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        os.mkdir(dst)
        for name in os.listdir(src):
            _link_tree(src / name, dst / name)
    else:
        try:
            os.link(src, dst)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK, errno.EACCES):
                raise
            shutil.copy2(src, dst)


def location(out: str | Path) -> Path:
    """The absolute path `out` names (its folder's symlinks resolved, not a link at `out`
    itself); OutputError for a path no folder can be written at."""
    text = os.fspath(out)
    if "\0" in text:
        raise OutputError(f"--out {text!r} contains a NUL character: choose another name")
    parent, name = os.path.split(os.path.abspath(text))
    if not name:
        raise OutputError(f"--out {text}: that is the root folder; name a folder to write, e.g. --out /models/NAME")
    if len(os.fsencode(name)) > 255:
        raise OutputError(f"--out: the name {name[:40]!r}… is {len(os.fsencode(name))} bytes long; file systems "
                          f"allow 255: choose a shorter name")
    return Path(os.path.realpath(parent)) / name


def check(final: Path, kind: Kind, force: bool, protect: Iterable[tuple[str, str | Path]] = ()) -> None:
    """Raise OutputError unless `final` (from location()) may be written as a `kind` output, or
    BuildExistsError when it holds one and `force` is not set."""
    real = Path(os.path.realpath(final))
    for what, path in protect:
        p = Path(os.path.realpath(path))
        if real == p or real in p.parents:
            how = "" if real == p else "a folder containing "
            raise OutputError(f"--out {final} is {how}{what} {p}: kvexport never writes over it, even with "
                              f"--force; choose another --out")
    if not os.path.lexists(final):
        return
    try:
        st = os.lstat(final)
        if stat.S_ISDIR(st.st_mode) and os.path.ismount(final):
            raise OutputError(f"--out {final} is a mount point, which cannot be replaced: write into a folder "
                              f"inside it, e.g. --out {final / 'NAME'}")
        empty = stat.S_ISDIR(st.st_mode) and not os.listdir(final)
        found = kind if empty else recognise(final)  # an empty folder: nothing in it to lose
        foreign = foreign_entries(final, kind) if found is kind and not empty else []
        what = describe(final)
    except OSError as e:
        raise OutputError(f"--out {final} cannot be inspected ({e.strerror}): kvexport replaces only a "
                          f"{kind.value} it can check; choose another --out") from None
    if found is None:
        raise OutputError(f"--out {final} is {what}, not a {kind.value}: kvexport replaces only a "
                          f"{kind.value}, even with --force; choose another --out, or move that away yourself")
    if found is not kind:
        raise OutputError(f"--out {final} is a {found.value}, not a {kind.value}: --force replaces only a "
                          f"{kind.value}; choose another --out")
    if foreign:
        raise OutputError(f"--out {final} is a {kind.value} but also holds what kvexport did not write "
                          f"({_listing(foreign)}): move that out of it first, or choose another --out")
    if not force:
        held = "is an empty folder" if empty else f"already holds a {kind.value}"
        raise BuildExistsError(f"{final} {held}; pass --force to replace it, or choose another --out")


def recognise(path: Path) -> Kind | None:
    """The kind of kvexport output `path` is, by its manifest or marker; None when neither."""
    if not _is_dir(path):
        return None
    if _is_file(path / io.MANIFEST_NAME):
        return Kind.BUILD
    if _is_file(path / TRITON_MARKER):
        return Kind.TRITON
    return None


def foreign_entries(path: Path, kind: Kind) -> list[str]:
    """Paths inside the `kind` output `path` (relative, sorted) that kvexport did not write."""
    if kind is Kind.BUILD:
        known = _BUILD_NAMES | _manifest_names(path) | {OWNER_FILE}  # an owner file a crash left
        foreign = []
        for name in sorted(os.listdir(path)):
            p = path / name
            if name in known or _is_temp(p, known):
                continue
            if recognise(p) is Kind.TRITON:  # a repository inside the build: BUILD/triton/
                foreign += [f"{name}/{x}" for x in foreign_entries(p, Kind.TRITON)]
            else:
                foreign.append(name)
        return foreign
    entries = _read_json(path / TRITON_MARKER).get("entries")
    entries = entries if isinstance(entries, dict) else {}
    foreign = []

    def walk(d: Path, rel: str) -> None:
        for name in sorted(os.listdir(d)):
            p, r = d / name, rel + name
            what = entries.get(r)
            ours = r in (TRITON_MARKER, OWNER_FILE) or (not rel and _is_temp(p, set()))
            if ours or (name == _CACHE_DIR and _is_dir(p)):
                continue
            if what == "dir" and _is_dir(p):
                walk(p, r + "/")
            elif what == "build" and recognise(p) is Kind.BUILD:
                foreign.extend(f"{r}/{x}" for x in foreign_entries(p, Kind.BUILD))
            elif not (what == "file" and _is_file(p)):
                foreign.append(r)

    walk(path, "")
    return foreign


def mark_triton_repository(repo: Path, models: Iterable[str]) -> None:
    """Write the marker by which `check` recognises the Triton repository `repo` (not yet in
    place) later: every path in it, a copied build as one entry."""
    entries: dict[str, str] = {}

    def walk(d: Path, rel: str) -> None:
        for name in sorted(os.listdir(d)):
            p, r = d / name, rel + name
            if not rel and name == OWNER_FILE:
                continue
            if recognise(p) is Kind.BUILD:
                entries[r] = "build"
            elif _is_dir(p):
                entries[r] = "dir"
                walk(p, r + "/")
            else:
                entries[r] = "file"

    walk(repo, "")
    text = json.dumps({"kvexport_version": __version__, "models": sorted(models), "entries": entries}, indent=2)
    (repo / TRITON_MARKER).write_text(text + "\n")


def describe(path: Path) -> str:
    """What is at `path`, in words, for a message."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link (to {os.readlink(path)}; pass that folder itself, or another --out)"
    if stat.S_ISREG(st.st_mode):
        return f"a file ({st.st_size} bytes)"
    if stat.S_ISDIR(st.st_mode):
        names = sorted(os.listdir(path))
        return f"a folder holding {_listing(names)}" if names else "an empty folder"
    kinds = {stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device", stat.S_ISFIFO: "a named pipe",
             stat.S_ISSOCK: "a socket"}
    return next((w for test, w in kinds.items() if test(st.st_mode)), "not a folder")


# ---- temporary folders --------------------------------------------------------------------------


def sibling_prefix(final: Path) -> str:
    """The name prefix of the temporary folders of `final`: ".NAME." (NAME cut to fit)."""
    b = os.fsencode(final.name)
    stem = final.name if len(b) <= _STEM_BYTES else b[:_STEM_BYTES].decode("utf-8", "ignore")
    return f".{stem}."


def new_temp_dir(parent: Path, prefix: str) -> Path:
    """A fresh folder `parent/PREFIXtmp-XXXXXXXX` with the umask's permissions and an owner
    file naming this process; `parent` is created when missing. OutputError when it cannot be."""
    try:
        os.makedirs(parent, exist_ok=True)  # NOTE: 0o777 less the umask, like every folder below
        for _ in range(100):
            d = parent / f"{prefix}tmp-{secrets.token_hex(4)}"
            try:
                os.mkdir(d)  # NOTE: 0o777 less the umask (tempfile.mkdtemp would make it 0700)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(errno.EEXIST, "no free temporary name", str(parent))
        try:
            _write_owner(d)
        except BaseException:
            os.rmdir(d)
            raise
    except OSError as e:
        raise OutputError(_cannot_write(parent, e)) from None
    return d


def new_temp_file(directory: Path, prefix: str) -> tuple[int, str]:
    """(fd, path) of a fresh file `directory/PREFIXXXXXXXXX` opened for writing, like
    tempfile.mkstemp but with the umask's permissions (0644 under umask 022), not 0600."""
    for _ in range(100):
        path = os.path.join(directory, f"{prefix}{secrets.token_hex(4)}")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(directory))


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the finished temporary folder `tmp` to `final`, swapping out what is there (the
    caller checked that it may go), which is removed after. Signals are held meanwhile, so an
    interrupt never leaves `final` missing."""
    with _signals_held():
        (tmp / OWNER_FILE).unlink(missing_ok=True)
        old = None
        try:
            if os.path.lexists(final):
                old = final.parent / f"{sibling_prefix(final)}old-{secrets.token_hex(4)}"
                os.rename(final, old)
                with contextlib.suppress(OSError):  # a folder we may not write in: removed right below anyway
                    _write_owner(old)
            try:
                os.rename(tmp, final)
            except BaseException:
                if old is not None:
                    os.rename(old, final)
                raise
        except OSError as e:
            hint = ("it is a mount point: write into a folder inside it" if e.errno == errno.EBUSY else
                    "check that you may write there, or choose another --out")
            raise OutputError(f"could not move the finished output into place at {final}: {e.strerror}; "
                              f"{hint}") from None
        if old is not None:
            remove_dir(old)
            if os.path.lexists(old):
                log.warning("could not remove all of %s (the replaced output): delete it yourself", old)


def remove_dir(d: Path) -> None:
    """Remove the temporary folder `d`, its owner file last (so an interrupted removal is still
    recognisably ours and finished by a later run). Signals are held meanwhile."""
    with _signals_held():
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(d):
                if e.name == OWNER_FILE:
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)
        with contextlib.suppress(OSError):
            os.unlink(d / OWNER_FILE)
        with contextlib.suppress(OSError):
            os.rmdir(d)


def clean_stale(final: Path) -> None:
    """Remove the temporary folders next to `final` that earlier runs writing it left behind:
    only ours (".NAME.tmp-…"/".NAME.old-…" holding an owner file) whose process has ended; an
    ".old-" folder only when `final` exists (otherwise it may be the only copy left); and ours
    that were never written into (`_remove_if_unborn`)."""
    prefix = sibling_prefix(final)
    try:
        entries = [e for e in os.scandir(final.parent) if e.name.startswith(prefix)]
    except OSError:  # the folder does not exist yet, or cannot be read: nothing of ours there
        return
    for e in entries:
        m = _TEMP.fullmatch(e.name[len(prefix):])
        if m is None or not e.is_dir(follow_symlinks=False):
            continue
        owner = _read_json(Path(e.path) / OWNER_FILE)
        if not owner:
            if m["kind"] == "tmp":  # an ".old-" folder is a renamed output: never "unborn"
                _remove_if_unborn(Path(e.path))
            continue
        if not _process_gone(owner):
            continue
        if m["kind"] == "old" and not os.path.lexists(final):
            log.warning("%s holds the previous %s (an earlier run stopped while replacing it): rename it back, or "
                        "delete it", e.path, final)
            continue
        log.warning("removing %s, left by an earlier run (process %s has ended)", e.path, owner.get("pid"))
        remove_dir(Path(e.path))


# ---- helpers ------------------------------------------------------------------------------------


UNBORN_AGE_S = 60.0  # a temporary folder this old with no owner record was never written into


def _remove_if_unborn(d: Path) -> None:
    """A temporary folder with no owner record is nobody's to remove, except one its run never
    wrote into: killed between the mkdir and the owner file's write (new_temp_dir), it holds
    nothing or an empty / half-written owner file. Removed once older than UNBORN_AGE_S (no run
    takes that long from mkdir to the write), so nothing is lost and nothing in use is touched."""
    try:
        names = os.listdir(d)
        if set(names) - {OWNER_FILE} or time.time() - os.stat(d).st_mtime < UNBORN_AGE_S:
            return
        if names:
            os.unlink(d / OWNER_FILE)
        os.rmdir(d)  # NOTE: fails (kept) if anything appeared meanwhile
    except OSError:
        return
    log.warning("removed %s: an earlier run's temporary folder it never wrote into", d)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Defer SIGINT/SIGTERM until the block ends (then raise them again), so a swap or a
    removal is never cut half-way. NOTE: swaps the Python-level handlers rather than blocking
    the signals (pthread_sigmask): a process-directed signal goes to any other thread that does
    not block it, and Python then runs the handler in the main thread anyway. Only the main
    thread has handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    saved = {}
    for s in (signal.SIGINT, signal.SIGTERM):
        h = signal.getsignal(s)
        if h is not None:  # None: a handler not installed from Python, which cannot be restored
            saved[s] = signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        for signum in dict.fromkeys(got):
            signal.raise_signal(signum)


def _owner() -> dict:
    return {"pid": os.getpid(), "started": _start_time(os.getpid()), "boot": _boot_id(),
            "host": socket.gethostname()}


def _write_owner(d: Path) -> None:
    fd = os.open(d / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(_owner()) + "\n")


def _process_gone(owner: dict) -> bool:
    """Whether the process an owner file names has ended (False when unsure: another machine
    sharing the folder, an unreadable file)."""
    pid, started = owner.get("pid"), owner.get("started")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    boot, host = _boot_id(), socket.gethostname()
    if boot and owner.get("boot") and owner["boot"] != boot:
        return owner.get("host") == host  # this machine rebooted since; another machine's: unsure
    if not (boot and owner.get("boot")) and owner.get("host") != host:
        return False
    now = _start_time(pid)
    if now is not None:
        return started is not None and now != started  # the pid was reused by another process
    if os.path.isdir("/proc/self"):
        return True  # /proc works and has no such process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot, /proc/PID/stat field 22)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _manifest_names(build: Path) -> set[str]:
    """Top-level names of the relative paths a build's manifest mentions (any schema)."""
    names: set[str] = set()

    def walk(v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                if k != "source":  # the model's own paths and name, not the build's
                    walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str) and v and not os.path.isabs(v):
            first = v.split("/", 1)[0]
            if first not in ("", ".", ".."):
                names.add(first)

    walk(_read_json(build / io.MANIFEST_NAME))
    return names


def _is_temp(p: Path, known: set[str] | frozenset[str]) -> bool:
    """Whether `p` is a hidden temporary entry kvexport makes inside an output: a temp folder
    of ours (owner file inside), or ".KNOWN.…" (an atomic save of the known file KNOWN)."""
    if not p.name.startswith("."):
        return False
    return _is_file(p / OWNER_FILE) or any(p.name.startswith(f".{k}.") for k in known)


def _is_dir(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink()


def _is_file(p: Path) -> bool:
    return p.is_file() and not p.is_symlink()


def _listing(names: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _cannot_write(parent: Path, e: OSError) -> str:
    """The message for an OSError creating `parent` or a folder in it, naming the nearest
    existing folder on the way (the one that refused)."""
    where = parent
    while not os.path.lexists(where) and where != where.parent:
        where = where.parent
    if not where.is_dir():
        return f"cannot write in {parent}: {where} is {describe(where)}, not a folder; choose another --out"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"cannot write in {where}: permission denied; choose an --out in a folder you can write to"
    if e.errno == errno.EROFS:
        return f"cannot write in {where}: read-only file system; choose an --out on a writable disk"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"cannot write in {where}: no space left; free some space or choose an --out on another disk"
    return f"cannot write in {where}: {e.strerror}; choose another --out"
