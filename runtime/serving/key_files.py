"""Reading an operator's secret key file (serve's --api-keys, --cache-salt-key): refused by name
when it is a directory, too large, unreadable or not UTF-8; a warning when others may read it."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def load_key_file(path: str | os.PathLike, option: str, error: type[Exception], max_bytes: int,
                  parse: Callable[[str, str], T]) -> T:
    """`parse(text, source)` of the file at `path` (UTF-8, a leading BOM dropped). Raises `error`
    naming `option` and the file when it cannot be read as a key file; warns after a good parse
    when group or others may read it (it should be chmod 600)."""
    p = Path(path)
    try:
        st = p.stat()
        if stat.S_ISDIR(st.st_mode):
            raise error(f"{option} {p} is a directory; give the key file")
        if st.st_size > max_bytes:
            raise error(f"{option} {p} is {st.st_size} bytes, more than a key file ({max_bytes} bytes at most)")
        raw = p.read_bytes()
    except OSError as e:
        raise error(f"{option} {p}: cannot read it: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = raw[:e.start].count(b"\n") + 1
        raise error(f"{option} {p}, line {line_no}: not UTF-8 text") from None
    parsed = parse(text.removeprefix("\ufeff"), str(p))
    if st.st_mode & 0o077:
        log.warning("%s %s can be read by other users; restrict it: chmod 600 %s", option, p, p)
    return parsed
