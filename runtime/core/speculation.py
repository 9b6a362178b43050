"""Speculative decoding: the scheduler's speculation policy and its proposers.

    schedule():  SpeculativeDecoding.propose(req, room) ── Proposer.propose(req, k) ──▶ drafts d_1..d_k
                 (the step carries the next token + the drafts, packed like a prompt chunk)
    runner:      logits at those 1 + k rows ── execution/spec_sampling.verify_drafts ──▶ accepted + 1 token
    update:      SpeculativeDecoding.verify ──▶ rollback = k - accepted (num_computed_tokens moves back
                 before the prefix cache sees the step), counters, adaptive back-off

Proposers (one small interface, `Proposer`):
- `NgramProposer` — prompt lookup: the last n tokens (n = max_n down to min_n) matched against the
  request's own prompt and output so far; the tokens that followed the latest match are the drafts.
  No model, nothing to roll back.
- `DraftModelProposer` (runtime/draft_model.py: it runs a second build's graphs) — another kvexport
  build with the same vocabulary, drafting greedily with its own KV pool. A proposer with
  `propose_many` (this one) drafts for all of a step's sequences together in `begin_step`.

Adaptive back-off:
- per sequence: a step whose drafts were all accepted lets the sequence draft one more next time
  (up to k); one with none accepted halves it; at 0 the sequence sits out a cool-down of steps that
  doubles each time (1, 2, 4, .. 32) before it drafts 1 again;
- globally: with more than `max_batch` sequences running, nobody drafts (decode of a large batch
  is no longer memory-bound: verifying drafts would cost what it saves).

NOTE (MTP heads, not done): DeepSeek-V3's `num_nextn_predict_layers` and Qwen3.5's MTP layer predict
token t+2 from the main model's last hidden state and the embedding of token t+1. Serving them
needs a third graph fed with the target's hidden states (an output the paged graphs do not have)
and its own KV pool per MTP layer, and the exporter's families do not load those weights (they are
dropped with the unused-tensor check) — a graph contract change of its own, left for a later issue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from .outputs import ModelRunnerOutput, ScheduledRequest
from .policies import SpeculationPolicy
from .request import Request, Status

MAX_SPECULATIVE_TOKENS = 16  # k at most (num_speculative_tokens)
_MAX_COOLDOWN = 32  # steps a sequence whose drafts keep failing sits out, at most


class Proposer(Protocol):
    """What drafts tokens for a decoding sequence."""

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        """Up to k tokens expected to follow req.token_ids (which ends with the step's next token)."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished: drop whatever the proposer keeps for it."""
        ...


class NgramProposer:
    """Prompt lookup (llama.cpp's and vLLM's n-gram speculation): find the latest earlier
    occurrence of the sequence's last n tokens (longest n first) in its own tokens and propose
    the k tokens that followed it."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        return ngram_lookup(req.token_ids, k, self.min_n, self.max_n)

    def release(self, request_id: str) -> None:
        pass


def ngram_lookup(tokens, k: int, min_n: int = 1, max_n: int = 4) -> tuple[int, ...]:
    """Up to k tokens that followed the latest earlier match of the last n tokens of `tokens`
    (n from max_n down to min_n); () when none matches."""
    a = np.asarray(tokens, dtype=np.int64)
    size = len(a)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # a match starts at i < size - n with a[i:i + n] == a[-n:]
        cand = np.ones(size - n, dtype=bool)
        for j in range(n):
            cand &= a[j:size - n + j] == a[size - n + j]
        hits = np.flatnonzero(cand)
        if hits.size:
            start = int(hits[-1]) + n  # the latest match; what followed it
            return tuple(int(t) for t in a[start:start + k])
    return ()


@dataclass(slots=True)
class _SeqState:
    """One sequence's adaptive draft length."""

    k: int  # drafts to propose next (0: sitting out)
    cooldown: int = 0  # steps left to sit out
    backoff: int = 1  # the next cool-down's length


@dataclass(frozen=True, slots=True)
class SpecStats:
    """Speculation's counts since the engine started (metrics, bench)."""

    num_drafts: int  # verification steps (decode steps that carried drafts)
    num_draft_tokens: int  # tokens drafted
    num_accepted_tokens: int  # drafted tokens the target accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens, 0..1 (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step emitted on average: its accepted drafts + the target's token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_json(self) -> dict:
        return {"num_drafts": self.num_drafts, "draft_tokens": self.num_draft_tokens,
                "accepted_tokens": self.num_accepted_tokens, "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_accepted_length": round(self.mean_accepted_length, 4)}


class SpeculativeDecoding(SpeculationPolicy):
    """The speculation policy: drafts from a proposer, at most `num_tokens` per step, with
    per-sequence and global back-off (module docstring). A request with
    SamplingParams.speculative False never drafts."""

    def __init__(self, proposer: Proposer, num_tokens: int, max_batch: int = 8, adaptive: bool = True):
        self.proposer, self.num_tokens, self.max_batch, self.adaptive = proposer, num_tokens, max_batch, adaptive
        self._on = True  # this step's global verdict (begin_step)
        self._batched: dict[str, tuple[int, ...]] = {}  # this step's drafts made together (begin_step)
        self._known: dict[str, Request] = {}  # requests that drafted, to release finished ones
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def new_state(self) -> _SeqState:
        return _SeqState(self.num_tokens)

    def stats(self) -> SpecStats:
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)

    def begin_step(self, num_running: int, running: Sequence[Request] = ()) -> None:
        self._on = num_running <= self.max_batch
        for rid, req in list(self._known.items()):
            if req.status is Status.FINISHED:
                del self._known[rid]
                self.proposer.release(rid)
        self._batched = {}
        many = getattr(self.proposer, "propose_many", None)
        if self._on and many is not None:
            # NOTE: a proposer that runs a model (the draft model) drafts for every sequence of the step
            # at once, here; `propose` then hands each its share. Sequences the scheduler does not ask
            # for after all (a prompt chunk, no room) only cost their drafting.
            wanted = [(req, k) for req in running if (k := self._wants(req)) > 0]
            if wanted:
                self._known.update((req.request_id, req) for req, _ in wanted)
                self._batched = many(wanted)

    def _wants(self, req: Request) -> int:
        """How many drafts `propose` will ask of the proposer for `req` this step if the room
        allows (0: none), without touching its state."""
        if (req.status is not Status.RUNNING or req.params.speculative is False or req.num_output_tokens == 0
                or req.num_computed_tokens < len(req.token_ids) - 1):
            return 0
        st = self.state(req)
        if st.cooldown > 0:
            return 0
        return max(0, min(st.k, req.params.max_tokens - req.num_output_tokens - 1))

    def propose(self, req: Request, max_tokens: int) -> tuple[int, ...]:
        if not self._on or req.params.speculative is False:
            return ()
        st = self.state(req)
        if st.cooldown > 0:
            st.cooldown -= 1
            if st.cooldown == 0:
                st.k = 1
            return ()
        k = min(st.k, max_tokens)
        if k < 1:
            return ()
        self._known[req.request_id] = req
        if req.request_id in self._batched:
            return tuple(self._batched.pop(req.request_id))[:k]
        return tuple(self.proposer.propose(req, k))[:k]

    def verify(self, req: Request, scheduled: ScheduledRequest, result: ModelRunnerOutput) -> int:
        k = scheduled.num_draft_tokens
        if k == 0:
            return 0
        if req.request_id not in result.sampled:  # nothing sampled (failed): keep the KV of nothing drafted
            return k
        accepted = len(result.accepted.get(req.request_id, ()))
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        if self.adaptive:
            st = self.state(req)
            if accepted == k:
                st.k, st.backoff = min(self.num_tokens, st.k + 1), 1
            elif accepted == 0:
                st.k //= 2
                if st.k == 0:
                    st.cooldown, st.backoff = st.backoff, min(2 * st.backoff, _MAX_COOLDOWN)
        return k - accepted


__all__ = ["MAX_SPECULATIVE_TOKENS", "NgramProposer", "Proposer", "SpecStats", "SpeculativeDecoding", "ngram_lookup"]
