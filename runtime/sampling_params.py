"""Sampling parameters, validated before any work, and each sequence's sampling state.
Shared by every layer: the scheduler keeps them on a request, the sampler
(runtime/execution/sampling.py) reads them, the front ends build them.

NOTE: every request owns its random generator, seeded from `seed`, and draws exactly one
number per generated token, so a seeded request gives the same tokens whatever else shares
its batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kvexport.errors import KvExportError


class SamplingError(KvExportError):
    """Out-of-range or inconsistent sampling parameters."""


# NOTE: vLLM's rule (_SAMPLING_EPS): a temperature below this samples greedily; a smaller one
# would only push every logit but the largest to -inf and the largest to overflow.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """What a request's output must match (exactly one field set), enforced token by token by
    runtime/execution/structured.py: vLLM's `structured_outputs` (json, regex, choice, grammar)
    and OpenAI's response_format (json_schema -> json, json_object)."""

    json: str | None = None  # a JSON schema (its JSON text; a dict or a pydantic model class is converted)
    json_object: bool = False  # any JSON object (response_format {"type": "json_object"})
    regex: str | None = None  # the whole output matches this regular expression
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (GBNF style, `root ::= ...`)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise SamplingError(f"invalid structured output: {msg}")

        j = self.json
        if isinstance(j, type) and hasattr(j, "model_json_schema"):  # a pydantic model class
            j = j.model_json_schema()
        if isinstance(j, (dict, bool)):
            j = json.dumps(j)
        if j is not None and not isinstance(j, str):
            bad(f"json must be a JSON schema (its text, a dict or a pydantic model), got {type(j).__name__}")
        if j is not None:
            try:
                json.loads(j)
            except ValueError as e:
                bad(f"json is not valid JSON: {e}")
        object.__setattr__(self, "json", j)
        if isinstance(self.choice, str) or (self.choice is not None and not isinstance(self.choice, (list, tuple))):
            bad(f"choice must be a list of strings, got {type(self.choice).__name__}")
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                bad("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                bad(f"{name} must be a non-empty string")
        if not isinstance(self.json_object, (bool, np.bool_)):
            bad(f"json_object must be true or false, got {self.json_object!r}")
        object.__setattr__(self, "json_object", bool(self.json_object))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            bad(f"set exactly one of json, json_object, regex, choice, grammar; got {', '.join(given) or 'none'}")

    @property
    def field(self) -> str:
        """The one field set."""
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None) \
            if not self.json_object else "json_object"

    @property
    def kind(self) -> str:
        """What it is, in words (error messages)."""
        return {"json": "JSON schema", "json_object": "JSON object", "regex": "regular expression",
                "choice": "choice", "grammar": "grammar"}[self.field]

    @property
    def key(self) -> tuple:
        """The compiled grammar cache's key."""
        return (self.field, getattr(self, self.field))


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
    # speculative decoding (the server's --speculative): None: as the server is set; False: off for this
    # request; True: this request needs it (refused by a server without it)
    speculative: bool | None = None
    # importance eviction (the server's --kv-eviction snapkv / h2o): this request's KV budget in tokens, when
    # smaller than the server's (runtime/core/importance.py); None: the server's
    kv_budget_tokens: int | None = None
    # constrain the output to a JSON schema, regex, choice or grammar (runtime/execution/structured.py)
    structured: StructuredOutputs | None = None
    # the LoRA adapter this request runs with, by the name the server loaded it under (--lora-modules
    # NAME=PATH; over HTTP the request's `model`); None: the base model (runtime/lora.py)
    lora: str | None = None

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
        if self.speculative is not None and not isinstance(self.speculative, (bool, np.bool_)):
            bad(f"speculative must be true, false or unset (the server's setting), got {self.speculative!r}")
        if self.speculative is not None:
            object.__setattr__(self, "speculative", bool(self.speculative))
        v = self.kv_budget_tokens  # NOTE: its range depends on the server's settings: checked by the engine
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            bad(f"kv_budget_tokens must be an integer >= 1 (or unset: the server's budget), got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            bad(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            bad(f"lora must be an adapter's name (a non-empty string) or unset (the base model), got {self.lora!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            bad(f"structured must be a StructuredOutputs, got {type(self.structured).__name__}")

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
    # the sequence's grammar matcher (runtime/execution/structured.py Matcher) when params.structured is set
    grammar: Any = None

    @classmethod
    def create(cls, params: SamplingParams, sample_index: int = 0, prompt: Sequence[int] = (),
               grammar: Any = None) -> "SamplerState":
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        prompt_tokens = frozenset(prompt) if params.repetition_penalty != 1.0 else frozenset()
        return cls(params, np.random.default_rng([int(seed), sample_index]), prompt_tokens=prompt_tokens,
                   grammar=grammar)
