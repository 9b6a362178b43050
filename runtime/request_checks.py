"""The checks `LLMEngine.add_request` applies to a request before anything is queued, and the
error a client's mistake raises: `RequestError`, token ids against the vocabulary
(`check_token_ids`), and why a build cannot score prompts (`prompt_logprobs_refusal`). They sit
at the runtime's level so the engine needs nothing from runtime/serving/; the front ends'
request parsing (runtime/serving/requests.py) uses the same three.
"""

from __future__ import annotations

import operator

from kvexport.errors import KvExportError


class RequestError(KvExportError):
    """A request a client got wrong; `param` names the offending field when there is one,
    `code` is a machine-readable reason where one is useful (e.g. context_length_exceeded)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def check_token_ids(ids, vocab_size: int, param: str = "prompt") -> list[int]:
    """`ids` as a list of ints, each in [0, vocab_size). Raises RequestError otherwise
    (NOTE: a negative id would silently wrap to a real token in a gather)."""
    if hasattr(ids, "tolist"):  # a numpy array
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise RequestError(f"{param}: expected a list of token ids, got {type(ids).__name__}", param)
    out = []
    for t in ids:
        try:  # int and numpy integers; not bool, float or str
            if isinstance(t, bool):
                raise TypeError
            t = operator.index(t)
        except TypeError:
            raise RequestError(f"{param}: token ids must be integers, got {t!r}", param) from None
        if not 0 <= t < vocab_size:
            raise RequestError(f"{param}: token id {t} is outside this model's vocabulary [0, {vocab_size})", param)
        out.append(t)
    return out


def prompt_logprobs_refusal(build_dir, what: str = "prompt_logprobs") -> str:
    """Why a build cannot score prompts (SamplingParams.prompt_logprobs), and what to do. `build_dir`:
    how to name the build: its folder for the engine's own callers, "this build" where a client of a
    server reads it (a server's paths are never shown to its clients)."""
    return (f"{what}: prompt log-probabilities need a build whose prefill returns the prompt rows' logits; "
            f"{build_dir} (made before logits_indices) returns the last token's only: rebuild it with this "
            f"kvexport (`kvexport build MODEL --force`)")


__all__ = ["RequestError", "check_token_ids", "prompt_logprobs_refusal"]
