"""A time limit on rendering a Jinja template (a build's chat template) in the current thread.

A thread cannot be stopped from outside, so the template's own code checks the clock: while
`time_limit(seconds)` is active, this thread's trace hook (`sys.settrace`) follows the frames
compiled from Jinja templates (file name "<template>", every template, macro and block) and, at
each line such a frame runs once the deadline has passed, raises `TimeLimitExceeded` inside the
template. The render ends with that exception and the thread is free again.

    render ──▶ "<template>" frame: line ──▶ past the deadline? ──▶ raise TimeLimitExceeded
               other frames (jinja2, transformers, the tokenizer): not traced line by line

What it cannot stop: one long call into C made by the template (a string multiplied by 10**9)
runs to its end before the next line is checked. Cost while active: one Python call per Python
function call in the thread, and one clock read per template line (a chat template of a long
conversation: well under a millisecond more).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator

TEMPLATE_FILENAME = "<template>"  # what jinja2 names the code it compiles from a template string


class TimeLimitExceeded(Exception):
    """The template ran past its time limit and was stopped."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Template code run by this thread inside the block raises TimeLimitExceeded once `seconds`
    have passed (None: no limit). The thread's earlier trace hook (a debugger, coverage) is
    restored afterwards; templates are not traced for it meanwhile."""
    if seconds is None:
        yield
        return
    deadline = time.monotonic() + seconds

    def in_template(frame, event, arg):
        if time.monotonic() > deadline:
            raise TimeLimitExceeded(f"stopped after {seconds:g} s")
        return in_template

    def on_call(frame, event, arg):
        if frame.f_code.co_filename != TEMPLATE_FILENAME:
            return None  # NOTE: no line events outside templates: the tokenizer's code runs at full speed
        return in_template(frame, event, arg)

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)
