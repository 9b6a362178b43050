"""Request parsing shared by every front end (`LLM`, `kvexport serve`, the Triton model):
prompts (text, token ids, chat messages) -> checked token ids, and request fields ->
`SamplingParams`. Front ends turn `RequestError` into their own error form (an exception,
HTTP 400, a Triton error response); nothing here knows about HTTP or Triton.
"""

from __future__ import annotations

from kvexport.errors import KvExportError


class RequestError(KvExportError):
    """A request a client got wrong; `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check_token_ids(ids, vocab_size: int, param: str = "prompt") -> list[int]:
    """`ids` as a list of ints, each in [0, vocab_size). Raises RequestError otherwise
    (NOTE: a negative id would silently wrap to a real token in a gather)."""
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            try:
                import numpy as np

                if isinstance(t, np.integer):
                    t = int(t)
                else:
                    raise TypeError
            except TypeError:
                raise RequestError(f"{param}: token ids must be integers, got {t!r}", param) from None
        if not 0 <= t < vocab_size:
            raise RequestError(f"{param}: token id {t} is outside this model's vocabulary [0, {vocab_size})", param)
        out.append(t)
    return out
