"""The sampler: one sequence's logits row -> the next token (and its log-probabilities),
under the request's `SamplingParams` (runtime/sampling_params.py).

NOTE: every request owns its random generator, seeded from `seed`, and draws exactly one
number per generated token, so a seeded request gives the same tokens whatever else shares
its batch.
"""

from __future__ import annotations

import numpy as np

from ..sampling_params import SamplerState


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def sample(logits: np.ndarray, state: SamplerState, prompt_tokens: set[int], num_generated: int,
           eos_ids: tuple[int, ...]) -> tuple[int, float | None, list[tuple[int, float]] | None]:
    """One token from one logits row [vocab]. Returns (token, its logprob, top logprobs)."""
    p = state.params
    x = logits.astype(np.float64, copy=True)
    if num_generated < p.min_tokens:
        for t in (*eos_ids, *p.stop_token_ids):
            if 0 <= t < x.size:
                x[t] = -np.inf
    if p.repetition_penalty != 1.0:
        seen = np.fromiter(prompt_tokens | state.counts.keys(), dtype=np.int64)
        if seen.size:
            v = x[seen]
            x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if state.counts and (p.presence_penalty or p.frequency_penalty):
        ids = np.fromiter(state.counts.keys(), dtype=np.int64)
        cnt = np.fromiter(state.counts.values(), dtype=np.float64)
        x[ids] -= p.presence_penalty + p.frequency_penalty * cnt
    logprobs_src = _log_softmax(x) if p.logprobs is not None else None

    if p.greedy:
        token = int(np.argmax(x))
        state.rng.random()  # NOTE: keep one draw per token even when greedy
    else:
        x = x / p.temperature
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
    state.counts[token] = state.counts.get(token, 0) + 1
    if logprobs_src is None:
        return token, None, None
    top = []
    if p.logprobs:
        idx = np.argpartition(-logprobs_src, p.logprobs)[:p.logprobs]
        idx = idx[np.argsort(-logprobs_src[idx])]
        top = [(int(i), float(logprobs_src[i])) for i in idx]
    return token, float(logprobs_src[token]), top
