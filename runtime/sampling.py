"""Sampling parameters (validated before any work) and the sampler that turns one
sequence's logits row into the next token.

NOTE: every request owns its random generator, seeded from `seed`, and draws exactly one
number per generated token, so a seeded request gives the same tokens whatever else shares
its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvexport.errors import KvExportError


class SamplingError(KvExportError):
    """Out-of-range or inconsistent sampling parameters."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16  # tokens to generate at most
    min_tokens: int = 0  # EOS and stop tokens are suppressed until this many are generated
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    min_p: float = 0.0  # drop tokens below min_p * p(max), [0, 1]
    repetition_penalty: float = 1.0  # > 0; HF-style: divides positive logits of seen tokens
    presence_penalty: float = 0.0  # [-2, 2], subtracted once per generated token seen
    frequency_penalty: float = 0.0  # [-2, 2], subtracted per occurrence in the output
    seed: int | None = None  # per-request RNG seed
    ignore_eos: bool = False  # keep going past EOS (benchmarks need forced lengths)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (may span tokens); not included in the text
    n: int = 1  # parallel samples sharing the prompt's KV blocks
    logprobs: int | None = None  # return the top-k logprobs of each generated token (0 = chosen only)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise SamplingError(f"invalid sampling parameters: {msg}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (0 <= self.min_tokens <= self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0.0):
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not isinstance(self.n, int) or not (1 <= self.n <= 64):
            bad(f"n must be an integer in [1, 64], got {self.n!r}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class SamplerState:
    """Per-sequence sampling state: the RNG and the output token counts for penalties."""

    params: SamplingParams
    rng: np.random.Generator
    counts: dict[int, int] = field(default_factory=dict)
    prompt_tokens: frozenset[int] = frozenset()  # kept only when a repetition penalty needs it

    @classmethod
    def create(cls, params: SamplingParams, sample_index: int = 0, prompt: Sequence[int] = ()) -> "SamplerState":
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        prompt_tokens = frozenset(prompt) if params.repetition_penalty != 1.0 else frozenset()
        return cls(params, np.random.default_rng([int(seed), sample_index]), prompt_tokens=prompt_tokens)


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
