"""Prompt log-probabilities: a chunk's logits rows -> the log-probability, rank and top-k of
each prompt token they predict (SamplingParams.prompt_logprobs; the OpenAI `echo` +
`logprobs` and vLLM `prompt_logprobs` of `kvexport serve`).

    logits [T, vocab] of an --all-logits prefill ──rows of a chunk──▶ log_softmax ──▶ PromptLogprobs

Where the rows come from, and why a build needs `--all-logits` for this, is the scheduler's
and the runner's business (the scheduler's policy: runtime/core/prompt_scores.py); this module
is the arithmetic only. It imports no torch.
"""

from __future__ import annotations

import numpy as np

from ..core.outputs import PromptLogprobs
from .sampling import NonFiniteLogitsError, floor


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis of [m, vocab] float32 rows, in float32 (a new array).
    NOTE: float32 keeps the transient at the size of the rows (a 512-token chunk of a
    49k vocabulary is 100 MB in float32); the error against float64 is ~1e-6 here.
    Non-finite logits as the sampler takes them (runtime/execution/sampling.py): NaN counts as
    -inf, +inf as the largest float; a row with no finite logit raises NonFiniteLogitsError."""
    x = rows.astype(np.float32, copy=True)
    x[np.isnan(x)] = -np.inf
    np.minimum(x, np.finfo(np.float32).max, out=x)
    top = x.max(axis=-1, keepdims=True)
    if not (top > -np.inf).all():
        raise NonFiniteLogitsError("the model returned no finite logit at a prompt position (its weights or "
                                   "activations hold NaN; check the build with `kvexport inspect`)")
    x -= top
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def score(rows: np.ndarray, targets: tuple[int, ...], start: int, top_k: int) -> PromptLogprobs:
    """`rows` [len(targets), vocab]: row i is the distribution the token `targets[i]` (at prompt
    position start + i) was drawn from. Returns each target's logprob and rank (1 + the
    tokens strictly more likely), and the top_k (token, logprob) of each row, best first."""
    assert rows.shape[0] == len(targets), "one row per target"
    lp = log_softmax(rows)  # [m, vocab]
    idx = np.asarray(targets, np.int64)
    chosen = lp[np.arange(len(idx)), idx]  # [m]
    ranks = (lp > chosen[:, None]).sum(axis=-1) + 1  # [m]
    top = None
    if top_k:
        k = min(top_k, lp.shape[-1])
        part = np.argpartition(-lp, k - 1, axis=-1)[:, :k]  # [m, k], unordered
        vals = np.take_along_axis(lp, part, axis=-1)
        order = np.argsort(-vals, axis=-1, kind="stable")
        part, vals = np.take_along_axis(part, order, axis=-1), np.take_along_axis(vals, order, axis=-1)
        top = tuple(tuple(zip(map(int, p), map(float, v))) for p, v in zip(part, vals))
    if top is not None:
        top = tuple(tuple((t, floor(v)) for t, v in row) for row in top)
    return PromptLogprobs(start, tuple(targets), tuple(floor(float(v)) for v in chosen), tuple(map(int, ranks)), top)
