"""Speculative decoding: the scheduler's speculation policy. Its proposers run beside the model
runner (execution/proposers.py: the n-gram lookup, the draft model), never in here: `plan` tells
the runner whom to draft for after a step's forward, and the runner's drafts come back to `offer`.

    schedule() N:  SpeculativeDecoding.propose(req, room) ──▶ the offered drafts d_1..d_k within the room
                   (the step carries the next token + the drafts, packed like a prompt chunk);
                   plan(sampling) ──▶ SchedulerOutput.draft_plan [(id, k)]   the back-off, max_batch
                                                   (and the cost model first, for a proposer that runs a model)
    runner N:      logits at those 1 + k rows ── execution/spec_sampling.verify_drafts ──▶ accepted + 1 token;
                   then the Drafter (execution/proposers.py) drafts for the plan from the sequences'
                   tokens, the ones just sampled included ──▶ ModelRunnerOutput.draft_token_ids
    update N:      SpeculativeDecoding.verify ──▶ rollback = k - accepted (num_computed_tokens moves back
                   before the prefix cache sees the step), counters, adaptive back-off;
                   offer(draft_token_ids) (the cost model's cut, for a cheap proposer) ──▶ step N + 1

NOTE: `plan` runs before step N's drafts are verified, so it asks for as many drafts as the back-off
could allow after the verdict (k + 1 where the step drafted); `propose` in step N + 1 takes the
first k the verdict left.

Adaptive back-off:
- per sequence: a step whose drafts were all accepted lets the sequence draft one more next time
  (up to k); one with none accepted halves it; at 0 the sequence sits out a cool-down of steps that
  doubles each time (1, 2, 4, .. 32) before it drafts 1 again;
- globally: with more than `max_batch` sequences running, nobody drafts (decode of a large batch
  is no longer memory-bound: verifying drafts would cost what it saves);
- by cost (`StepCost`): the policy times its steps and fits a step's wall time as a + b x rows on
  decode-only steps; once the fit stands, each step's drafts are chosen like a fractional knapsack —
  draft position j of sequence i is worth p_i^j expected tokens (p_i: the sequence's per-token
  acceptance, smoothed toward the engine's), costs b, and is taken, best first, only while it raises
  the step's expected tokens per second (value x C > b x T, T and C the tokens and cost taken so far,
  starting from the plain step's). Where a row is nearly free (a GPU's memory-bound decode, a
  single stream) every draft the back-off allows is taken; where rows cost (a CPU's batch of 8)
  only the sequences likely to accept draft, so speculation does not make a step slower than the
  tokens it brings. Drafts are proposed first (the n-gram lookup, the draft model's batch), so a
  sequence with nothing to propose costs nothing.

NOTE (MTP / EAGLE heads): they draft from the target's hidden states, which the paged graphs return
on builds made with --hidden-states (kvexport/io.py HIDDEN_STATES): a proposer of the runner's side
reads them from the step it drafts after.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from .outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from .policies import SpeculationPolicy
from .request import Request, Status
from .stats import SpecDecodingStats

MAX_SPECULATIVE_TOKENS = 16  # k at most (num_speculative_tokens)
_MAX_COOLDOWN = 32  # steps a sequence whose drafts keep failing sits out, at most
_EXPLORE_TRIALS = 3  # a sequence drafts at least one token until its acceptance rests on this many trials


@dataclass(slots=True)
class _SeqState:
    """One sequence's adaptive draft length and acceptance."""

    k: int  # drafts to propose next (0: sitting out)
    cooldown: int = 0  # steps left to sit out
    backoff: int = 1  # the next cool-down's length
    accepted: int = 0  # drafted tokens accepted (each a success of the per-token acceptance)
    trials: int = 0  # accepted + the rejections (a step's first rejected draft; the ones after it are unseen)


class StepCost:
    """A step's wall time modelled as a + b x rows (rows: the tokens the step computes), fitted by
    least squares with exponential forgetting (`decay` per step) on the steps `add` is given.
    `fit()` is None until `min_steps` steps were seen and their row counts differ (a and b cannot
    be told apart before), else (a, b) with a, b >= 0."""

    def __init__(self, decay: float = 0.98, min_steps: int = 8):
        self.decay, self.min_steps = decay, min_steps
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.steps = 0

    def add(self, rows: int, seconds: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + rows, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + rows * rows, d * self.sxy + rows * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        if self.steps < self.min_steps:
            return None
        var = self.n * self.sxx - self.sx * self.sx
        if var <= 1e-9 * max(1.0, self.n * self.sxx):  # the steps all had one row count (or nearly, decayed)
            return None
        b = max(0.0, (self.n * self.sxy - self.sx * self.sy) / var)
        a = max(0.0, (self.sy - b * self.sx) / self.n)
        if a == 0.0 and b == 0.0:
            return None
        return a, b


def allot_drafts(offers: Sequence[tuple[str, int, float]], plain_tokens: float, plain_rows: int,
                 cost: tuple[float, float]) -> dict[str, int]:
    """How many of its drafts each sequence should carry this step (StepCost's knapsack, module
    docstring). offers: (request id, drafts proposed, per-token acceptance p); the plain step yields
    plain_tokens tokens over plain_rows rows; cost: (a, b) seconds. Draft j of a sequence (j = 1..)
    is worth p^j tokens and costs b: taken, best first, while value x C > b x T."""
    a, b = cost
    tokens, seconds = float(plain_tokens), a + b * plain_rows
    taken = {rid: 0 for rid, _, _ in offers}
    if b <= 0.0:
        return {rid: n for rid, n, _ in offers}
    # every sequence's next draft is its best one left: take the best of those, one at a time (a max-heap)
    heads = [(-p, rid, n, p) for rid, n, p in offers if n > 0 and p > 0.0]
    heapq.heapify(heads)
    while heads:
        neg, rid, n, p = heapq.heappop(heads)
        if -neg * seconds <= b * tokens:
            break  # the best draft left would lower tokens per second; so would every other
        tokens, seconds = tokens - neg, seconds + b
        taken[rid] += 1
        if taken[rid] < n:
            heapq.heappush(heads, (neg * p, rid, n, p))
    return taken


class SpeculativeDecoding(SpeculationPolicy):
    """The speculation policy: at most `num_tokens` drafts per step (made by the runner's Drafter,
    execution/proposers.py, for the sequences `plan` names), with per-sequence and global back-off
    (module docstring). A request with SamplingParams.speculative False never drafts.
    `costly_proposer`: drafting runs a model (the draft model), so the cost model's allotment is
    applied before drafting (it is the cost saved); a cheap proposer (the n-gram lookup) drafts
    first and is cut after, so a sequence with nothing to propose costs nothing."""

    def __init__(self, num_tokens: int, max_batch: int = 16, adaptive: bool = True, cost_model: bool = True,
                 costly_proposer: bool = False):
        self.num_tokens, self.max_batch, self.adaptive = num_tokens, max_batch, adaptive
        self.costly_proposer = costly_proposer
        # the step-cost model (module docstring); None: drafts bounded by the back-off and max_batch only
        self.cost: StepCost | None = StepCost() if adaptive and cost_model else None
        self._on = True  # this step's global verdict (begin_step)
        self._drafted: dict[str, tuple[int, ...]] = {}  # the drafts offered for this step (offer)
        self._proposing: set[str] = set()  # requests that carry drafts in the step being scheduled
        self._t0: float | None = None  # when this step began (begin_step), for the cost model
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self._accepted_per_pos = [0] * num_tokens  # drafts accepted at each draft position (tokens)
        self._accepted = self._trials = 0  # the engine's per-token acceptance (p's prior)

    def new_state(self) -> _SeqState:
        return _SeqState(self.num_tokens)

    def stats(self) -> SpecDecodingStats:
        fit = self.cost.fit() if self.cost is not None else None  # (a, b) seconds; None: not fitted
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 tuple(self._accepted_per_pos), step_seconds=fit[0] if fit else 0.0,
                                 row_seconds=fit[1] if fit else 0.0)

    def begin_step(self, num_running: int, running: Sequence[Request] = ()) -> None:
        self._t0, self._on, self._proposing = time.perf_counter(), num_running <= self.max_batch, set()

    def plan(self, sampling: Sequence[Request], num_running: int) -> tuple[tuple[str, int], ...]:
        """The step is scheduled (its drafts handed out): whom the runner drafts for after the step,
        and at most how many drafts each (module docstring); none with more than max_batch running.
        For a costly proposer the cost model's allotment is applied here."""
        self._drafted = {}  # the offered drafts not taken this step are stale after it
        if num_running > self.max_batch:
            return ()
        wanted = [(req, k) for req in sampling if (k := self._wants_next(req)) > 0]
        fit = self.cost.fit() if self.cost is not None else None
        if wanted and self.costly_proposer and fit is not None:
            keep = self._allot(wanted, num_running, fit)
            wanted = [(req, keep[req.request_id]) for req, _ in wanted if keep[req.request_id] > 0]
        return tuple((req.request_id, k) for req, k in wanted)

    def offer(self, drafts: Mapping[str, Sequence[int]], running: Sequence[Request]) -> None:
        """The runner's drafts after the step ({request id: drafts}), for the running sequences;
        for a cheap proposer the cost model's allotment cuts them now."""
        by_id = {req.request_id: req for req in running}
        drafted = {rid: tuple(d) for rid, d in drafts.items() if d and rid in by_id}
        fit = self.cost.fit() if self.cost is not None and not self.costly_proposer else None
        if fit is not None and drafted:
            keep = self._allot([(by_id[rid], len(d)) for rid, d in drafted.items()], len(running), fit)
            drafted = {rid: d[:keep[rid]] for rid, d in drafted.items()}
        self._drafted = drafted

    def _allot(self, offers: list[tuple[Request, int]], num_decoding: int,
               fit: tuple[float, float]) -> dict[str, int]:
        """allot_drafts for a step: the plain step's tokens and rows are one per running sequence."""
        keep = allot_drafts([(req.request_id, n, self._acceptance(self.state(req))) for req, n in offers],
                            num_decoding, num_decoding, fit)
        for req, n in offers:  # a sequence judged on too few drafts of its own still tries one (exploring)
            if n > 0 and self.state(req).trials < _EXPLORE_TRIALS:
                keep[req.request_id] = max(keep[req.request_id], 1)
        return keep

    def end_step(self, output: SchedulerOutput) -> None:
        """The step's results are back: its time since begin_step goes to the cost model when every
        scheduled request was a decode (its next token + drafts; prompt chunks cost otherwise)."""
        t0, self._t0 = self._t0, None
        if self.cost is None or t0 is None or not output.scheduled or output.kv_ops:
            return
        if all(s.num_output_tokens > 0 and len(s.token_ids) == 1 + s.num_draft_tokens for s in output.scheduled):
            self.cost.add(sum(len(s.token_ids) for s in output.scheduled), time.perf_counter() - t0)

    def _acceptance(self, st: _SeqState) -> float:
        """A sequence's per-token acceptance: its own successes and trials, smoothed toward the
        engine's (itself smoothed toward 1/2), as if the engine's were 2 trials of its own."""
        prior = (self._accepted + 1) / (self._trials + 2)
        return (st.accepted + 2 * prior) / (st.trials + 2)

    def _wants_next(self, req: Request) -> int:
        """How many drafts to ask the proposer for `req`, whose chunk samples its next token this step,
        for its next step (0: none), without touching its state: its draft length, one more where this
        step carries drafts (all accepted, the back-off grows it), within max_tokens."""
        if req.params.speculative is False:
            return 0
        st = self.state(req)
        if st.cooldown > 0:
            return 0
        grow = 1 if req.request_id in self._proposing else 0
        # NOTE: after this step's token, the next step's own token comes before its drafts
        return max(0, min(st.k + grow, self.num_tokens, req.params.max_tokens - req.num_output_tokens - 2))

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
        drafts = self._drafted.pop(req.request_id, ())[:k]
        if drafts:
            self._proposing.add(req.request_id)
        return drafts

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
        per_pos = self._accepted_per_pos
        per_pos.extend([0] * (k - len(per_pos)))  # NOTE: k <= num_tokens unless a caller changed it since
        for pos in range(accepted):  # the accepted drafts are a prefix of the step's drafts
            per_pos[pos] += 1
        trials = accepted + (accepted < k)  # the first rejection is seen, the drafts after it are not
        self._accepted += accepted
        self._trials += trials
        st = self.state(req)
        st.accepted += accepted
        st.trials += trials
        if self.adaptive:
            if accepted == k:
                st.k, st.backoff = min(self.num_tokens, st.k + 1), 1
            elif accepted == 0:
                st.k //= 2
                if st.k == 0:
                    st.cooldown, st.backoff = st.backoff, min(2 * st.backoff, _MAX_COOLDOWN)
        return k - accepted


__all__ = ["MAX_SPECULATIVE_TOKENS", "SpecDecodingStats", "SpeculativeDecoding", "StepCost", "allot_drafts"]
