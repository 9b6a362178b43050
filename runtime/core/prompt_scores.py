"""Prompt log-probabilities (SamplingParams.prompt_logprobs) on the scheduler's side: which prompt
tokens a chunk's rows are to score, the scores kept by position until the request's first output
carries all of them, and the copying of a parallel sample's scores from its leader. The
arithmetic on the logits rows is runtime/execution/prompt_logprobs.py.

    chunk of positions start..start+n-1 ──targets──▶ runner scores them (--all-logits build) ──▶
    record (consecutive from position 1) ──▶ result(): every position, with the first output

NOTE (choices):
- prefix cache: tokens served from cached blocks have no logits, so a request whose prompt
  logprobs are not all in skips the prefix-cache lookup (`scoring`) and computes its whole
  prompt (as vLLM does); its blocks are still cached for others. Parallel samples (the
  scheduler's `SharedPrompt`) copy their leader's scores instead, once it has them all
  (`before_admit`), and then reuse its blocks.
- chunked prefill: each chunk scores its own rows; preemption by recompute computes the
  prompt again but scores only the positions not yet scored, so nothing is duplicated.
- max_tokens 0: the request computes its prompt and finishes ("length") without sampling
  (the scheduler's stop rules).
"""

from __future__ import annotations

from .outputs import PromptLogprobs
from .policies import Policy
from .request import Request


class PromptLogprobsPolicy(Policy):
    """State of a request that asked for prompt logprobs: the scored parts, consecutive from
    position 1 (`list[PromptLogprobs]`); requests that did not ask have none."""

    key = "prompt_logprobs"

    def add(self, req: Request) -> None:
        if req.params.prompt_logprobs is not None:
            req.policy_state[self.key] = []

    def next_position(self, req: Request) -> int:
        """The first prompt position whose logprob is still to come (from 1; num_prompt_tokens: all in)."""
        parts = req.policy_state.get(self.key)
        return parts[-1].start + len(parts[-1]) if parts else 1

    def scoring(self, req: Request) -> bool:
        """Prompt logprobs asked for and not all scored yet."""
        return self.key in req.policy_state and self.next_position(req) < req.num_prompt_tokens

    def before_admit(self, req: Request, leader: Request | None) -> None:
        """A parallel sample takes its leader's prompt scores once the leader has them all (then
        it looks its prompt up in the cache like any other request)."""
        if leader is not None and self.scoring(req) and self.key in leader.policy_state and not self.scoring(leader) \
                and leader.params.prompt_logprobs == req.params.prompt_logprobs:
            req.policy_state[self.key] = list(leader.policy_state[self.key])

    def targets(self, req: Request, start: int, n: int) -> tuple[tuple[int, ...], int, int]:
        """For a chunk of positions start..start+n-1: the prompt tokens its rows predict that are
        still to be scored, the position of the first, and the top-k to return with each."""
        first = max(start + 1, self.next_position(req))
        targets = tuple(req.token_ids[first:min(start + n + 1, req.num_prompt_tokens)]) if self.scoring(req) else ()
        return targets, first, req.params.prompt_logprobs or 0

    def record(self, req: Request, scores: PromptLogprobs | None) -> None:
        """The runner's scores of the step's targets."""
        parts = req.policy_state.get(self.key)
        if scores is not None and parts is not None:
            scores = scores.since(self.next_position(req))  # NOTE: defensive; only new ones are asked for
            if len(scores):
                parts.append(scores)

    def result(self, req: Request) -> PromptLogprobs | None:
        """Every prompt token's logprob from position 1 (empty for a one-token prompt), or None
        when none were asked for."""
        parts = req.policy_state.get(self.key)
        if parts is None:
            return None
        assert not self.scoring(req), "the prompt is computed, so every position is scored"
        if not parts:
            return PromptLogprobs(1, (), (), (), () if req.params.prompt_logprobs else None)
        return PromptLogprobs.concat(parts)


__all__ = ["PromptLogprobsPolicy"]
