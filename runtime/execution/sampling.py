"""The sampler: one sequence's logits row -> the next token (and its log-probabilities),
under the request's `SamplingParams` (runtime/sampling_params.py).

NOTE: every request owns its random generator, seeded from `seed`, and draws exactly one
number per generated token, so a seeded request gives the same tokens whatever else shares
its batch.

Non-finite numbers never leave the sampler: a NaN logit (or one a penalty turned into NaN,
0 x inf) counts as -inf (never chosen), +inf (a penalty's or a temperature's overflow) is
clamped to the largest float (logits are shifted to a maximum of 0 before the temperature divides them), and a log-probability of -inf (a token the step ruled out) is
reported as LOGPROB_FLOOR, as vLLM's OpenAI server reports it. A row with no finite logit at
all (NaN weights) fails the request, naming the cause, rather than returning an arbitrary token.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..sampling_params import SamplerState
from .structured import CLOSING_WINDOW, mask_logits


def mask_grammars(logits: np.ndarray, rows: Sequence[int], states: Sequence[SamplerState | None]) -> list[int]:
    """Structured output's hook: every logit row whose sequence has a grammar (SamplerState.grammar)
    gets the tokens its grammar disallows set to -inf, in place, for the whole step at once
    (runtime/execution/structured.py). rows[i]: the row of states[i]; None states are skipped.
    Returns the i whose grammar allows no token here (their requests must fail: mask_logits)."""
    keep = [(i, r, s.grammar) for i, (r, s) in enumerate(zip(rows, states)) if s is not None and s.grammar is not None]
    if not keep:
        return []
    dead = mask_logits(logits, [r for _, r, _ in keep], [g for _, _, g in keep])
    return [keep[j][0] for j in dead]


LOGPROB_FLOOR = -9999.0  # the log-probability reported for -inf (vLLM's OpenAI server: max(logprob, -9999.0))
_FMAX = np.finfo(np.float64).max


class NonFiniteLogitsError(ValueError):
    """The model gave no finite logit for a sequence's step (NaN weights or activations)."""


def _finite(x: np.ndarray) -> np.ndarray:
    """`x` (float64) with NaN as -inf and +inf as the largest float, in place; raises
    NonFiniteLogitsError when no entry is left above -inf."""
    x[np.isnan(x)] = -np.inf
    np.minimum(x, _FMAX, out=x)
    if not x.max() > -np.inf:
        raise NonFiniteLogitsError("the model returned no finite logit for this step (NaN or -inf everywhere: its "
                                   "weights or activations hold NaN; check the build with `kvexport inspect`)")
    return x


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()  # NOTE: x.max() is finite (_finite): entries are finite or -inf, none NaN
    return x - np.log(np.exp(x).sum())


def floor(logprob: float) -> float:
    """A log-probability as reported: finite (-inf -> LOGPROB_FLOOR)."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _best(x: np.ndarray, k: int) -> list[int]:
    """The (at most) k tokens of the largest finite entries of x, best first."""
    k = min(k, x.size)
    idx = np.argpartition(-x, k - 1)[:k]
    idx = idx[np.argsort(-x[idx], kind="stable")]
    return [int(i) for i in idx if x[i] > -np.inf]


def plain_greedy(state: SamplerState, num_generated: int) -> bool:
    """Whether this sequence's next token is the argmax of its logits row, nothing else applied: greedy, no
    penalty, no logprobs, no grammar, min_tokens reached (sample_greedy's rows)."""
    p = state.params
    return (p.greedy and state.grammar is None and p.logprobs is None and num_generated >= p.min_tokens
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty)


def sample_greedy(logits: np.ndarray, rows: Sequence[int], states: Sequence[SamplerState]) -> list[int | None]:
    """The next token of each plain-greedy sequence (plain_greedy) at once: logits [R, vocab], rows[i] the row of
    states[i]. The same tokens as sample() row by row (NaN rows and rows with no finite logit give None: sample()
    then handles them alone), its state updated as sample() does (one random draw, the count). NOTE: issue 47:
    row by row was ~6 ms of a 64-sequence decode step (a float64 copy and three passes per row); this is one
    pass over the step's rows."""
    if not rows:
        return []
    idx = np.asarray(rows, np.intp)
    # [B, vocab]; a decode step's rows are contiguous: a view
    sub = logits[idx[0]:idx[-1] + 1] if bool(np.all(np.diff(idx) == 1)) else logits[idx]
    tokens = sub.argmax(axis=1)  # NOTE: a row's first NaN where it holds one (numpy's argmax takes NaN as the max)
    best = sub[np.arange(len(tokens)), tokens]
    out: list[int | None] = []
    for i, state in enumerate(states):
        if not best[i] > -np.inf:  # NaN in the row, or nothing finite: sample() decides (NaN -> -inf, or the error)
            out.append(None)
            continue
        token = int(tokens[i])
        state.rng.random()  # NOTE: one draw per token, as sample() keeps
        state.counts[token] = state.counts.get(token, 0) + 1
        out.append(token)
    return out


def sample(logits: np.ndarray, state: SamplerState, prompt_tokens: set[int], num_generated: int,
           eos_ids: tuple[int, ...]) -> tuple[int, float | None, list[tuple[int, float]] | None]:
    """One token from one logits row [vocab]. Returns (token, its logprob, top logprobs)."""
    p = state.params
    x = logits.astype(np.float64, copy=True)
    if num_generated < p.min_tokens:
        before = x.copy() if state.grammar is not None else None
        for t in (*eos_ids, *p.stop_token_ids):
            if 0 <= t < x.size:
                x[t] = -np.inf
        if before is not None and not x.max() > -np.inf:  # NOTE: the grammar allows only the end: it wins
            x = before
    if p.repetition_penalty != 1.0:
        seen = np.fromiter(prompt_tokens | state.counts.keys(), dtype=np.int64)
        if seen.size:
            v = x[seen]
            with np.errstate(over="ignore", invalid="ignore"):  # NOTE: inf and NaN are _finite()'s to handle
                x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if state.counts and (p.presence_penalty or p.frequency_penalty):
        ids = np.fromiter(state.counts.keys(), dtype=np.int64)
        cnt = np.fromiter(state.counts.values(), dtype=np.float64)
        x[ids] -= p.presence_penalty + p.frequency_penalty * cnt
    _finite(x)
    logprobs_src = _log_softmax(x) if p.logprobs is not None else None
    ranked_src = x  # the logits the token is chosen from (penalties and masks applied): structured output's closing

    if p.greedy:
        token = int(np.argmax(x))
        state.rng.random()  # NOTE: keep one draw per token even when greedy
    else:
        with np.errstate(over="ignore"):  # NOTE: the max is subtracted first, so nothing overflows to +inf
            x = (x - x.max()) / p.temperature  # [vocab], max 0; far-below-max logits underflow to -inf
        if p.top_k and p.top_k < x.size:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x[x < kth] = -np.inf
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        if p.min_p > 0.0:
            probs[probs < p.min_p * probs.max()] = 0.0
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            cut = order[np.searchsorted(cum, p.top_p) + 1:]  # keep the smallest set reaching top_p
            probs[cut] = 0.0
        probs /= probs.sum()
        u = state.rng.random()
        token = int(min(np.searchsorted(np.cumsum(probs), u, side="right"), probs.size - 1))
        while probs[token] == 0.0:  # guard against float edges landing on a dropped token
            token -= 1
    if state.grammar is not None and not p.ignore_eos and p.max_tokens - num_generated <= CLOSING_WINDOW:
        # NOTE: near the end of max_tokens, a token that leaves no way to end the document within it is replaced
        # by the likeliest one that does (structured.py "Closing within the budget")
        token = state.grammar.keep_closable(token, p.max_tokens - num_generated, lambda: _best(ranked_src, 8))
    state.counts[token] = state.counts.get(token, 0) + 1
    if state.grammar is not None and not state.grammar.accept(token):
        raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")  # an internal error
    if logprobs_src is None:
        return token, None, None
    top = []
    if p.logprobs:
        idx = np.argpartition(-logprobs_src, p.logprobs)[:p.logprobs]
        idx = idx[np.argsort(-logprobs_src[idx])]
        top = [(int(i), floor(float(logprobs_src[i]))) for i in idx]
    return token, floor(float(logprobs_src[token])), top
