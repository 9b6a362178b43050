"""Sampling parameters, validated before any work, and each sequence's sampling state.
Shared by every layer: the scheduler keeps them on a request, the sampler
(runtime/execution/sampling.py) reads them, the front ends build them.

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


# NOTE: vLLM's rule (_SAMPLING_EPS): a temperature below this samples greedily; a smaller one
# would only push every logit but the largest to -inf and the largest to overflow.
GREEDY_BELOW = 1e-5

@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16  # tokens to generate at most; 0: compute the prompt only (its prompt_logprobs, an echo)
    min_tokens: int = 0  # EOS and stop tokens are suppressed until this many are generated
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    min_p: float = 0.0  # drop tokens below min_p * p(max), [0, 1]
    repetition_penalty: float = 1.0  # > 0; HF-style: divides positive logits of seen tokens
    presence_penalty: float = 0.0  # [-2, 2], subtracted once per generated token seen
    frequency_penalty: float = 0.0  # [-2, 2], subtracted per occurrence in the output
    seed: int | None = None  # per-request RNG seed
    ignore_eos: bool = False  # keep going past EOS (benchmarks need forced lengths)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (may span tokens); not included in the text; a str is one
    n: int = 1  # parallel samples sharing the prompt's KV blocks
    logprobs: int | None = None  # return the top-k logprobs of each generated token (0 = chosen only)
    # return the log-probability of each prompt token (and its rank, and the top-k at its position; 0 = the
    # prompt token's only). Needs a build whose prefill returns every token's logits (`--all-logits`)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise SamplingError(f"invalid sampling parameters: {msg}")

        # NOTE: types first, by name, so a wrong type never reaches a comparison (a bare TypeError)
        # or the engine (a traceback at the first step)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                bad(f"{name} must be a number, got {type(v).__name__} {v!r}")
            object.__setattr__(self, name, float(v))
        for name in ("max_tokens", "min_tokens", "top_k", "n"):
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                bad(f"{name} must be an integer, got {type(v).__name__} {v!r}")
            object.__setattr__(self, name, int(v))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            bad(f"ignore_eos must be true or false, got {type(self.ignore_eos).__name__} {self.ignore_eos!r}")
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        if isinstance(self.stop, str):  # one stop string, as vLLM takes it (never its characters)
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (bytes, dict)) or not isinstance(self.stop, (list, tuple)):
            bad(f"stop must be a string or a list of strings, got {type(self.stop).__name__} {self.stop!r}")
        stop_ids = self.stop_token_ids
        if isinstance(stop_ids, (str, bytes, dict)) or not isinstance(stop_ids, (list, tuple, np.ndarray)):
            bad(f"stop_token_ids must be a list of token ids, got {type(stop_ids).__name__} {stop_ids!r}"
                + (f" (one id: [{stop_ids}])" if isinstance(stop_ids, int) and not isinstance(stop_ids, bool) else ""))
        for t in stop_ids:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or t < 0:
                bad(f"stop_token_ids must hold token ids (integers >= 0), got {t!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            bad(f"max_tokens must be an integer >= 0 (0: the prompt only), got {self.max_tokens!r}")
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
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 20):
                bad(f"{name} must be an integer in [0, 20], got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            bad(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """Whether the request samples greedily: temperature 0, or below GREEDY_BELOW (dividing
        logits by a temperature that small only rescales the argmax's lead to overflow)."""
        return self.temperature < GREEDY_BELOW


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
