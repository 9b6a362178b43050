"""Speculative decoding's proposers, run beside the model runner (issue 43 §3): between one step's
results and the next schedule, the engine asks the `Drafter` for the drafts of the sequences the
speculation policy wants drafted, and hands them to the policy; the scheduler only budgets them,
and verifies and rolls back after the step (core/speculation.py). No model runs inside the
scheduler.

    LLMEngine.step():
        Drafter.draft(running) ─ policy.plan(running) ──▶ [(request, k)]   the back-off, max_batch
                               │                                           (and the cost model first,
                               │                                            for a proposer that runs a model)
                               ├ Proposer.propose(req, k) / propose_many(wanted) ──▶ {id: drafts}
                               └ policy.offer(drafts)   (the cost model after, for a cheap proposer)
        Scheduler.schedule() ── policy.propose(req, room) ──▶ the step's drafts (budgeted)
        ModelRunner.execute() ──▶ sampled + accepted ──▶ Scheduler.update_from_output: verify, roll back

Proposers (one small interface, `Proposer`):
- `NgramProposer` (here) — prompt lookup: the last n tokens (n = max_n down to min_n) matched
  against the request's own prompt and output so far; the tokens that followed the latest match
  are the drafts. No model, nothing to roll back.
- `DraftModelProposer` (runtime/draft_model.py: it runs a second build's graphs) — greedy drafts
  from another build with the same vocabulary, its own KV pool; `propose_many` drafts for all of a
  step's sequences together.

NOTE: a proposer that needs the target's hidden states (MTP, EAGLE heads) gets them here, from the
last step's runner output, once the graphs return them (a kvexport/io.py entry of its own).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from ..core.request import Request, Status
from ..core.speculation import SpeculativeDecoding


class Proposer(Protocol):
    """What drafts tokens for a decoding sequence. A proposer that runs a model also has
    `propose_many(wanted: list[(Request, k)]) -> {request id: drafts}` (drafts for all at once)."""

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


class Drafter:
    """Runs `proposer` for `policy` before each schedule (module docstring) and releases what it keeps
    for finished requests."""

    def __init__(self, proposer: Proposer, policy: SpeculativeDecoding):
        self.proposer, self.policy = proposer, policy
        self._known: dict[str, Request] = {}  # requests that drafted, to release finished ones

    def draft(self, running: Sequence[Request]) -> None:
        """The drafts of this step's running sequences, handed to the policy (policy.offer)."""
        for rid, req in list(self._known.items()):
            if req.status is Status.FINISHED:
                del self._known[rid]
                self.proposer.release(rid)
        many = getattr(self.proposer, "propose_many", None)
        # NOTE: a proposer that runs a model drafts for the step's sequences at once, after the cost
        # model's allotment (drafting is the cost it saves); a cheap one (n-gram lookup) proposes first,
        # so a sequence with nothing to propose costs nothing
        wanted = self.policy.plan(running, allot_first=many is not None)
        self._known.update((req.request_id, req) for req, _ in wanted)
        if not wanted:
            drafts: dict[str, tuple[int, ...]] = {}
        elif many is not None:
            drafts = {rid: tuple(d) for rid, d in many(wanted).items()}
        else:
            drafts = {req.request_id: tuple(self.proposer.propose(req, k))[:k] for req, k in wanted}
        self.policy.offer(drafts, running, allotted=many is not None)


__all__ = ["Drafter", "NgramProposer", "Proposer", "ngram_lookup"]
