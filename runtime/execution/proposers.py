"""Speculative decoding's proposers, run on the model runner's side (issue 43 §3, as vLLM v1's
spec_decode): after a step's forward and sampling, the runner's `Drafter` drafts for the sequences
the scheduler's speculation policy planned (SchedulerOutput.draft_plan) and hands the drafts back in
ModelRunnerOutput.draft_token_ids; the scheduler only budgets them into the next step, verifies and
rolls back (core/speculation.py). No model runs inside the scheduler.

    Scheduler.schedule() ── policy.propose(req, room): the step's drafts (offered last step)
                         └─ policy.plan(sampling) ──▶ SchedulerOutput.draft_plan [(id, k)]
    ModelRunner.execute() ── forward, sample, verify ──▶ sampled + accepted
                          └─ Drafter.after_step: each sequence's tokens + what the step sampled
                             ── Proposer.propose_many([(id, tokens, k)]) ──▶ draft_token_ids
    Scheduler.update_from_output() ── verify, roll back ── policy.offer(draft_token_ids)

The Drafter keeps every planned sequence's tokens (prompt and outputs): sent once by the scheduler
(ScheduledRequest.seq_token_ids), then extended by the tokens each step accepts and samples, and
dropped when the scheduler says the request finished (SchedulerOutput.finished). Preemption leaves
a sequence's tokens as they are (only its KV is computed again), so they stay valid.

Proposers (one small interface, `Proposer`):
- `NgramProposer` (here) — prompt lookup: the last n tokens (n = max_n down to min_n) matched
  against the request's own prompt and output so far; the tokens that followed the latest match
  are the drafts. No model, nothing to roll back.
- `DraftModelProposer` (runtime/draft_model.py: it runs a second build's graphs) — greedy drafts
  from another build with the same vocabulary, its own KV pool, all of a step's sequences together.

NOTE: a proposer that needs the target's hidden states (MTP, EAGLE heads) gets them here, from the
step it drafts after (builds made with --hidden-states: kvexport/io.py HIDDEN_STATES).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from ..core.outputs import ModelRunnerOutput, SchedulerOutput


class Proposer(Protocol):
    """What drafts tokens for decoding sequences."""

    runs_model: bool  # drafting runs a model: the policy allots drafts before asking (costly_proposer)

    def propose_many(self, wanted: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, tuple[int, ...]]:
        """(request id, its tokens, k) -> up to k tokens expected to follow the tokens (the last: the
        token the step just sampled), per request; () or absent where it has none."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished: drop whatever the proposer keeps for it."""
        ...


class NgramProposer:
    """Prompt lookup (llama.cpp's and vLLM's n-gram speculation): find the latest earlier
    occurrence of the sequence's last n tokens (longest n first) in its own tokens and propose
    the k tokens that followed it."""

    runs_model = False

    def __init__(self, min_n: int = 1, max_n: int = 4):
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n

    def propose_many(self, wanted: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, tuple[int, ...]]:
        return {rid: ngram_lookup(tokens, k, self.min_n, self.max_n) for rid, tokens, k in wanted}

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


class Drafter:
    """The runner's side of speculation: keeps the planned sequences' tokens and, after a step ran,
    asks `proposer` for the drafts the plan wants (module docstring)."""

    def __init__(self, proposer: Proposer):
        self.proposer = proposer
        self._tokens: dict[str, list[int]] = {}  # request id -> its tokens (prompt and outputs so far)

    def after_step(self, out: SchedulerOutput, result: ModelRunnerOutput) -> dict[str, tuple[int, ...]]:
        """The step `out` ran with `result` (sampled, accepted): the tokens kept up to date, and the
        drafts of out.draft_plan's requests that sampled (request id -> drafts)."""
        for rid in out.finished:
            if self._tokens.pop(rid, None) is not None:
                self.proposer.release(rid)
        for s in out.scheduled:
            rid = s.request_id
            if s.seq_token_ids is not None:
                self._tokens[rid] = list(s.seq_token_ids)
            tokens = self._tokens.get(rid)
            tok = result.sampled.get(rid)
            if tokens is not None and tok is not None:
                tokens.extend(t.token_id for t in result.accepted.get(rid, ()))
                tokens.append(tok.token_id)
        wanted = [(rid, self._tokens[rid], k) for rid, k in out.draft_plan
                  if rid in result.sampled and rid in self._tokens]
        if not wanted:
            return {}
        ks = {rid: k for rid, _, k in wanted}
        drafts = self.proposer.propose_many(wanted)
        return {rid: tuple(d)[:ks[rid]] for rid, d in drafts.items() if d and rid in ks}


__all__ = ["Drafter", "NgramProposer", "Proposer", "ngram_lookup"]
