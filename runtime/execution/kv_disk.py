"""The disk tier's folder (`--kv-offload-dir`): one file per KV block, a marker naming the build
they belong to, and the index rebuilt from the files at start. This module owns the folder's
layout, the block file format and every check that keeps a wrong block out of the pool; it
knows nothing of tensors (a block is bytes, runtime/execution/kv_offload.py).

    DIR/kvexport-kv-offload.json   marker: format, version, the build identity (what may be read)
    DIR/blocks/<group>-<key>.kvb   one block: header + payload

    block file = MAGIC (8) | identity (32) | group (16, NUL-padded) | key (32) | payload bytes (8, LE)
                 | sha256(payload) (32) | payload

NOTE (never wrong tokens): a file is served only if its magic, build identity, group, key, length
and checksum all match; anything else (truncated, a flipped byte, another build's file copied in)
is refused, removed (it is kvexport's own file in a marked folder) and the block recomputed.
Files are written to a temporary name in blocks/ and renamed into place, so a reader never sees
half a block; a crash leaves at most a temporary file, removed at the next start. No fsync: a
torn file after a power cut fails its checksum like any other corrupt one.

NOTE (never user data deleted): the folder must be empty, new, or already marked for this
build. A folder with other files, or marked for another build, is refused at start naming
--kv-offload-dir; nothing in it is touched.

NOTE (the folder is untrusted input): whatever sits under a block's name is opened with
O_NOFOLLOW | O_NONBLOCK and served only if fstat says it is a regular file, and the folder is
scanned with lstat: a FIFO, a symlink (dangling or not), a device or a directory never blocks a
read or stops start-up; it is refused like a corrupt file (removed unless it is a directory,
counted as a disk error, the block recomputed), and a symlink is never followed.

NOTE (one process per folder): a server holds an exclusive lock (flock) on DIR/kvexport-kv-offload.lock
while it uses the folder: a second one pointed at it is refused at start naming --kv-offload-dir
(it would remove the first's temporary files at its start, and each would drop the other's blocks
from its budget). The lock goes when the process ends or `close()` releases it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import fcntl
import re
import stat
import struct
from pathlib import Path

from kvexport.errors import ConfigError

log = logging.getLogger(__name__)

MARKER = "kvexport-kv-offload.json"
LOCK = "kvexport-kv-offload.lock"
BLOCKS = "blocks"
FORMAT, VERSION = "kvexport-kv-offload", 1
MAGIC = b"KVXBLK01"
_GROUP_BYTES = 16
_HEADER = struct.Struct(f"<8s32s{_GROUP_BYTES}s32sQ32s")  # magic, identity, group, key, payload bytes, sha256
_NAME = re.compile(r"([a-z]{1,16})-([0-9a-f]{64})\.kvb")
_TMP_PREFIX = ".tmp-"
_TMP_NAME = re.compile(r"\.tmp-[0-9]+-[0-9]+")  # _write_atomic's temporary names: .tmp-<pid>-<sequence>
_OPTION = "kv_offload_dir (--kv-offload-dir)"
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a symlink, never a FIFO's wait


class CorruptBlock(Exception):
    """A block file that must not be served (the message says why)."""


class DiskFull(Exception):
    """The disk tier cannot write (a full disk, a quota, an I/O error): turn it off."""


class NotAFile(OSError):
    """Something other than a regular file sits under a name kvexport reads (a FIFO, a device, a
    directory); a symlink fails its O_NOFOLLOW open with ELOOP instead."""


def read_regular(path: Path) -> bytearray:
    """The bytes of `path` if it is a regular file, without following a symlink (OSError ELOOP)
    or waiting on a FIFO or device (NotAFile): the folder is untrusted input."""
    mode = os.lstat(path).st_mode  # NOTE: a device is not even opened (opening some has effects)
    if stat.S_ISLNK(mode):
        raise OSError(errno.ELOOP, "a symbolic link")
    if not stat.S_ISREG(mode):
        raise NotAFile(errno.EINVAL, f"not a regular file ({_kind(mode)})")
    fd = os.open(path, _OPEN_READ)  # NOTE: checked again on the open file: it may have been swapped
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(errno.EINVAL, f"not a regular file ({_kind(st.st_mode)})")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = bytearray(st.st_size)
            return data[:f.readinto(data)]
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


class DiskTier:
    """The block files of one build in `root` (see the module doc). `identity`: 32 bytes
    naming the build and its KV layout (kv_offload.build_identity). Opening checks the folder
    and raises ConfigError naming --kv-offload-dir when it cannot be used."""

    def __init__(self, root: str | Path, identity: bytes, describe: dict):
        self.root, self.identity = Path(root).expanduser(), identity
        self.blocks = self.root / BLOCKS
        self._lock_fd: int | None = None
        self.bad_entries = 0  # entries of blocks/ refused at `scan` (not regular files): disk errors
        self.torn_files = 0  # temporary files a killed process left (half-written blocks or marker), removed
        self._check_folder(describe)
        self._tmp_seq = 0

    def close(self) -> None:
        """Release the folder's lock (another process may use it from now on)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # NOTE: closing the descriptor releases the flock
            self._lock_fd = None

    # ---- the folder ------------------------------------------------------------------
    def _check_folder(self, describe: dict) -> None:
        root = self.root
        if root.exists() and not root.is_dir():
            raise ConfigError(f"{_OPTION} {root} is not a folder; give a folder (it is created if missing)")
        if not root.exists():
            try:
                root.mkdir(parents=True)
            except OSError as e:
                raise ConfigError(f"{_OPTION} {root} cannot be created ({e.strerror}); give a writable folder") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise ConfigError(f"{_OPTION} {root} is not writable; give a folder this user can write")
        marker = root / MARKER
        entries = sorted(p.name for p in root.iterdir() if p.name != LOCK)
        if os.path.lexists(marker):
            try:
                data = json.loads(read_regular(marker))
                ok = data.get("format") == FORMAT and data.get("version") == VERSION
            except (OSError, ValueError, AttributeError):
                ok = False
            if not ok:
                raise ConfigError(f"{_OPTION} {root}: {MARKER} is not a kvexport KV offload marker of version "
                                  f"{VERSION}; give another folder (nothing in it was touched)")
            theirs, ours = data.get("tier_dtype", "auto"), describe.get("tier_dtype", "auto")
            if data.get("identity") != self.identity.hex() and theirs != ours:
                raise ConfigError(f"{_OPTION} {root} holds KV blocks stored at --kv-offload-dtype {theirs}, and this "
                                  f"engine stores them at {ours}; give --kv-offload-dtype {theirs}, or another folder")
            if data.get("identity") != self.identity.hex():
                raise ConfigError(f"{_OPTION} {root} holds the KV blocks of another build ({data.get('build', '?')}); "
                                  f"give this build its own folder, or empty that one yourself")
            other = [n for n in entries if n not in (MARKER, BLOCKS)]
            if other or (os.path.lexists(self.blocks) and not stat.S_ISDIR(os.lstat(self.blocks).st_mode)):
                raise ConfigError(f"{_OPTION} {root} holds files kvexport did not write ({', '.join(other[:3]) or BLOCKS}"
                                  f"{'' if other else ' is not a folder'}); give a folder that holds only kvexport's "
                                  f"KV blocks")
        elif entries and not self._aborted_first_start(entries):
            raise ConfigError(f"{_OPTION} {root} is not empty and not a kvexport KV offload folder (it holds "
                              f"{', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}); give an empty "
                              f"or new folder: kvexport never deletes files it did not write")
        self._lock()  # NOTE: only now: nothing of a folder refused above is touched
        try:
            if not os.path.lexists(marker):
                for name in entries:  # NOTE: only kvexport's temporary marker files (_aborted_first_start)
                    self.torn_files += 1
                    self._unlink(root / name)
                self._write_atomic(marker, json.dumps({"format": FORMAT, "version": VERSION,
                                                       "identity": self.identity.hex(), **describe}, indent=1).encode())
            self.blocks.mkdir(exist_ok=True)
            stray = [p.name for p in self.blocks.iterdir() if not (_NAME.fullmatch(p.name) or
                                                                   p.name.startswith(_TMP_PREFIX))]
            if stray:
                raise ConfigError(f"{_OPTION} {root}: {BLOCKS}/ holds files kvexport did not write "
                                  f"({', '.join(stray[:3])}); give a folder that holds only kvexport's KV blocks")
        except BaseException:
            self.close()  # the lock goes with the refusal
            raise

    def _aborted_first_start(self, entries: list[str]) -> bool:
        """Whether a folder without a marker is one a kvexport process was killed in while writing its
        marker (kill -9 between `_lock` and the marker's rename): it holds kvexport's lock file and
        nothing but temporary files under kvexport's temporary names, which are then removed."""
        return os.path.lexists(self.root / LOCK) and all(_TMP_NAME.fullmatch(n) for n in entries)

    def _lock(self) -> None:
        """Take the folder's exclusive lock (module NOTE), or ConfigError naming --kv-offload-dir.
        A symlink, FIFO or device under the lock's name is replaced by a lock file (never followed)."""
        path = self.root / LOCK
        for _ in range(2):
            try:
                if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
                    raise OSError(errno.ELOOP, "not a regular file")  # never opened: replaced below
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP and (os.path.islink(path) or not os.path.isdir(path)):
                    log.warning("disk KV tier: %s is not a lock file; replaced", path)
                    self._unlink(path)  # NOTE: a symlink's link goes, never its target
                    continue
                raise ConfigError(f"{_OPTION} {self.root}: its lock file {LOCK} cannot be opened ({e.strerror}); "
                                  f"remove it (no kvexport process may be using the folder) and start again") from None
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode):
                break
            os.close(fd)
            log.warning("disk KV tier: %s is %s, not a lock file; replaced", path, _kind(mode))
            self._unlink(path)
        else:
            raise ConfigError(f"{_OPTION} {self.root}: {LOCK} is not a regular file and cannot be replaced; "
                              f"remove it and start again")
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ConfigError(f"{_OPTION} {self.root}: cannot lock {LOCK} ({e.strerror}); give a folder on a "
                                      f"local disk") from None
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise ConfigError(f"{_OPTION} {self.root} is in use by another kvexport process (pid {holder}): two "
                                  f"servers must not share a KV offload folder (each would remove the other's "
                                  f"files); give each server its own --kv-offload-dir, or stop the other "
                                  f"first") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd

    def scan(self) -> list[tuple[str, bytes, int]]:
        """(group, key, bytes) of every block file, least recently written first (the index after
        a restart). Temporary files a killed run left are removed and counted in `torn_files`
        (logged once); entries under a block's name
        that are not regular files (lstat: a symlink, a FIFO, a device, a directory) are removed
        (a directory is left) and counted in `bad_entries`, never followed or opened."""
        found = []
        with os.scandir(self.blocks) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:  # gone meanwhile
                    continue
                m = _NAME.fullmatch(e.name)
                if e.name.startswith(_TMP_PREFIX) and not stat.S_ISDIR(st.st_mode):
                    self.torn_files += 1  # NOTE: a write a killed process never finished (never a block)
                    self._unlink(Path(e.path))
                elif m and stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime_ns, m.group(1), bytes.fromhex(m.group(2)), st.st_size))
                else:
                    self.bad_entries += 1
                    log.warning("disk KV tier: %s is %s, not a block file; %s", e.path, _kind(st.st_mode),
                                "skipped" if stat.S_ISDIR(st.st_mode) else "removed")
                    if not stat.S_ISDIR(st.st_mode):
                        self._unlink(Path(e.path))
        if self.torn_files:
            log.warning("disk KV tier: removed %d temporary files a killed kvexport process left in %s (writes it "
                        "never finished; those blocks are recomputed)", self.torn_files, self.root)
        found.sort()
        return [(g, k, n) for _, g, k, n in found]

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)  # NOTE: a symlink's link goes, never its target
        except OSError as e:
            log.warning("could not remove %s: %s", path, e)

    def path(self, group: str, key: bytes) -> Path:
        return self.blocks / f"{group}-{key.hex()}.kvb"

    # ---- blocks ----------------------------------------------------------------------------
    def write(self, group: str, key: bytes, payload: bytes | memoryview, mtime_ns: int | None = None) -> int:
        """Write one block atomically (its modification time `mtime_ns` when given: the restart's
        recency order); returns the bytes written. Raises CorruptBlock when a directory sits under
        the block's name (that block is not kept), DiskFull on any other OSError (the temporary
        file is removed)."""
        head = _HEADER.pack(MAGIC, self.identity, group.encode().ljust(_GROUP_BYTES, b"\0"), key, len(payload),
                            hashlib.sha256(payload).digest())
        path = self.path(group, key)
        try:
            self._write_atomic(path, head, payload)
            if mtime_ns is not None:
                os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
        except OSError as e:
            if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):  # NOTE: this name only, not the disk
                raise CorruptBlock(f"{path.name}: cannot be written ({e.strerror}: something other than a block "
                                   f"file holds its name)") from None
            raise DiskFull(f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})") from None
        return len(head) + len(payload)

    def read(self, group: str, key: bytes) -> memoryview:
        """The payload of a block (writable memory), verified; raises CorruptBlock (and removes the
        file) for any mismatch. A missing or unreadable file is CorruptBlock too."""
        p = self.path(group, key)
        try:
            data = read_regular(p)
        except OSError as e:
            why = "a symbolic link" if e.errno == errno.ELOOP else e.strerror
            if e.errno == errno.ELOOP or (isinstance(e, NotAFile) and not p.is_dir()):
                self.remove(group, key)  # NOTE: a FIFO, a device or a symlink goes (a directory stays)
            raise CorruptBlock(f"{p.name}: unreadable ({why})") from None
        why = self._check(data, group, key)
        if why:
            p.unlink(missing_ok=True)
            raise CorruptBlock(f"{p.name}: {why}")
        return memoryview(data)[_HEADER.size:]

    def _check(self, data: bytearray, group: str, key: bytes) -> str | None:
        if len(data) < _HEADER.size:
            return f"truncated ({len(data)} bytes)"
        magic, ident, g, k, n, digest = _HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a kvexport KV block"
        if ident != self.identity:
            return "a block of another build"
        if g.rstrip(b"\0") != group.encode() or k != key:
            return "a block under another name"
        if len(data) - _HEADER.size != n:
            return f"truncated ({len(data) - _HEADER.size} of {n} payload bytes)"
        if hashlib.sha256(memoryview(data)[_HEADER.size:]).digest() != digest:
            return "checksum mismatch"
        return None

    def remove(self, group: str, key: bytes) -> None:
        try:
            self.path(group, key).unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not remove %s: %s", self.path(group, key), e)

    def _write_atomic(self, path: Path, *parts: bytes | memoryview) -> None:
        self._tmp_seq = getattr(self, "_tmp_seq", 0) + 1
        tmp = path.parent / f"{_TMP_PREFIX}{os.getpid()}-{self._tmp_seq}"
        try:
            # NOTE: O_EXCL | O_NOFOLLOW: a name planted in the folder is never written through
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644),
                           "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
