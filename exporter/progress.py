"""How a long-running exporter command reports its steps: a `Progress` callback wraps each named
step (`with progress("loading weights"): ...`). `quiet_step` logs each step's duration; the CLI
passes a spinner (kvexport/cli/options.py rich_progress). A leaf: build, calibrate and validate
take one without importing each other."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Iterator

log = logging.getLogger(__name__)

Progress = Callable[[str], contextlib.AbstractContextManager]


@contextlib.contextmanager
def quiet_step(name: str) -> Iterator[None]:
    """The default Progress: the step's duration at INFO level."""
    t = time.perf_counter()
    yield
    log.info("%s: %.1fs", name, time.perf_counter() - t)
