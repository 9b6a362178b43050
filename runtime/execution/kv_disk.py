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
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import struct
from pathlib import Path

from kvexport.errors import ConfigError

log = logging.getLogger(__name__)

MARKER = "kvexport-kv-offload.json"
BLOCKS = "blocks"
FORMAT, VERSION = "kvexport-kv-offload", 1
MAGIC = b"KVXBLK01"
_GROUP_BYTES = 16
_HEADER = struct.Struct(f"<8s32s{_GROUP_BYTES}s32sQ32s")  # magic, identity, group, key, payload bytes, sha256
_NAME = re.compile(r"([a-z]{1,16})-([0-9a-f]{64})\.kvb")
_TMP_PREFIX = ".tmp-"
_OPTION = "kv_offload_dir (--kv-offload-dir)"


class CorruptBlock(Exception):
    """A block file that must not be served (the message says why)."""


class DiskFull(Exception):
    """The disk tier cannot write (a full disk, a quota, an I/O error): turn it off."""


class DiskTier:
    """The block files of one build in `root` (see the module doc). `identity`: 32 bytes
    naming the build and its KV layout (kv_offload.build_identity). Opening checks the folder
    and raises ConfigError naming --kv-offload-dir when it cannot be used."""

    def __init__(self, root: str | Path, identity: bytes, describe: dict):
        self.root, self.identity = Path(root).expanduser(), identity
        self.blocks = self.root / BLOCKS
        self._check_folder(describe)
        self._tmp_seq = 0

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
        entries = sorted(p.name for p in root.iterdir())
        if marker.exists():
            try:
                data = json.loads(marker.read_text())
                ok = data.get("format") == FORMAT and data.get("version") == VERSION
            except (OSError, ValueError, AttributeError):
                ok = False
            if not ok:
                raise ConfigError(f"{_OPTION} {root}: {MARKER} is not a kvexport KV offload marker of version "
                                  f"{VERSION}; give another folder (nothing in it was touched)")
            if data.get("identity") != self.identity.hex():
                raise ConfigError(f"{_OPTION} {root} holds the KV blocks of another build ({data.get('build', '?')}); "
                                  f"give this build its own folder, or empty that one yourself")
            other = [n for n in entries if n not in (MARKER, BLOCKS)]
            if other or (self.blocks.exists() and not self.blocks.is_dir()):
                raise ConfigError(f"{_OPTION} {root} holds files kvexport did not write ({', '.join(other[:3]) or BLOCKS}); "
                                  f"give a folder that holds only kvexport's KV blocks")
        else:
            if entries:
                raise ConfigError(f"{_OPTION} {root} is not empty and not a kvexport KV offload folder (it holds "
                                  f"{', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}); give an empty "
                                  f"or new folder: kvexport never deletes files it did not write")
            self._write_atomic(marker, json.dumps({"format": FORMAT, "version": VERSION,
                                                   "identity": self.identity.hex(), **describe}, indent=1).encode())
        self.blocks.mkdir(exist_ok=True)
        stray = [p.name for p in self.blocks.iterdir() if not (_NAME.fullmatch(p.name) or
                                                               p.name.startswith(_TMP_PREFIX))]
        if stray:
            raise ConfigError(f"{_OPTION} {root}: {BLOCKS}/ holds files kvexport did not write ({', '.join(stray[:3])}); "
                              f"give a folder that holds only kvexport's KV blocks")

    def scan(self) -> list[tuple[str, bytes, int]]:
        """(group, key, bytes) of every block file, least recently written first (the index after
        a restart). Temporary files a killed run left are removed."""
        found = []
        for p in self.blocks.iterdir():
            if p.name.startswith(_TMP_PREFIX):
                p.unlink(missing_ok=True)
                continue
            m = _NAME.fullmatch(p.name)
            if m:
                st = p.stat()
                found.append((st.st_mtime_ns, m.group(1), bytes.fromhex(m.group(2)), st.st_size))
        found.sort()
        return [(g, k, n) for _, g, k, n in found]

    def path(self, group: str, key: bytes) -> Path:
        return self.blocks / f"{group}-{key.hex()}.kvb"

    # ---- blocks ----------------------------------------------------------------------------
    def write(self, group: str, key: bytes, payload: bytes | memoryview) -> int:
        """Write one block atomically; returns the bytes written. Raises DiskFull on any OSError
        (the temporary file is removed)."""
        head = _HEADER.pack(MAGIC, self.identity, group.encode().ljust(_GROUP_BYTES, b"\0"), key, len(payload),
                            hashlib.sha256(payload).digest())
        try:
            self._write_atomic(self.path(group, key), head, payload)
        except OSError as e:
            raise DiskFull(f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})") from None
        return len(head) + len(payload)

    def read(self, group: str, key: bytes) -> memoryview:
        """The payload of a block (writable memory), verified; raises CorruptBlock (and removes the
        file) for any mismatch. A missing or unreadable file is CorruptBlock too."""
        p = self.path(group, key)
        try:
            with open(p, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                data = data[:f.readinto(data)]
        except OSError as e:
            raise CorruptBlock(f"{p.name}: unreadable ({e.strerror})") from None
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
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
