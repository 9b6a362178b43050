"""The step types: what passes between the scheduler, the model runner and the output
processor in one engine step. The scheduler produces `SchedulerOutput` (the only thing the
runner sees), the runner answers with `ModelRunnerOutput`, and the scheduler's
`update_from_output()` turns that into one `EngineCoreOutput` per request.

    Scheduler.schedule() ──SchedulerOutput──▶ ModelRunner.execute() ──ModelRunnerOutput──▶
    Scheduler.update_from_output() ──EngineCoreOutput──▶ OutputProcessor

NOTE: all frozen: a step's types are never mutated after they are made, so the runner can
read them while the scheduler moves on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import SamplerState
from .kv_cache_manager import GroupBlocks
from .kv_tiers import TierEvents, TierOp
from .state_pool import StateStep


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Log-probabilities of consecutive prompt tokens, each given the tokens before it: entry
    i is the token at position `start + i` (>= 1: the first prompt token has none).
    NOTE: len() counts the tokens, so an empty one (a one-token prompt's) is falsy: test `is None`."""

    start: int  # position of token_ids[0] in the prompt
    token_ids: tuple[int, ...]  # the prompt tokens scored
    logprobs: tuple[float, ...]  # of each, under the model's raw distribution (no penalties, no temperature)
    ranks: tuple[int, ...]  # of each in its distribution: 1 = the most likely token
    top: tuple[tuple[tuple[int, float], ...], ...] | None  # per position: (token, logprob) of the top-k, best first

    def __len__(self) -> int:
        return len(self.token_ids)

    def since(self, position: int) -> "PromptLogprobs":
        """The entries at `position` and after."""
        k = max(0, position - self.start)
        return PromptLogprobs(self.start + k, self.token_ids[k:], self.logprobs[k:], self.ranks[k:],
                              self.top[k:] if self.top is not None else None)

    @classmethod
    def concat(cls, parts: "list[PromptLogprobs]") -> "PromptLogprobs":
        """Consecutive parts (each starting where the one before ends) as one."""
        assert parts and all(a.start + len(a) == b.start for a, b in zip(parts, parts[1:])), "parts must be consecutive"
        tops = None if parts[0].top is None else tuple(t for p in parts for t in (p.top or ()))
        return cls(parts[0].start, tuple(t for p in parts for t in p.token_ids),
                   tuple(x for p in parts for x in p.logprobs), tuple(r for p in parts for r in p.ranks), tops)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: tuple[int, ...]  # this step's tokens
    start_pos: int  # position of token_ids[0] in the sequence
    block_table: tuple[int, ...]
    slot_mapping: tuple[int, ...]
    samples: bool  # the chunk reaches the end of the sequence: sample a token
    sampler: SamplerState | None = None  # the request's sampling state (when samples)
    num_output_tokens: int = 0  # tokens generated before this step (min_tokens, penalties)
    group_blocks: tuple[GroupBlocks, ...] = ()  # tables and slots in other KV cache groups (hybrid builds)
    # prompt log-probabilities (SamplingParams.prompt_logprobs): the prompt tokens at positions
    # prompt_target_start.. that this chunk's rows predict (row p - start_pos predicts the token at p + 1),
    # and the top-k to return with each
    prompt_targets: tuple[int, ...] = ()
    prompt_target_start: int = 0
    prompt_top_k: int = 0
    # streaming eviction (core/streaming.py): tokens of released blocks that `block_table` leaves out,
    # between the sinks and the recent window; a position p past them is attention index p - kv_gap
    kv_gap: int = 0
    # speculation (core/policies.py SpeculationPolicy): the last num_draft_tokens of token_ids are drafts
    # proposed after the sequence's next token; 0 for every step until a speculation policy proposes some
    num_draft_tokens: int = 0
    # importance eviction (core/importance.py): the chunk's last observation_len tokens are observation
    # queries whose attention the runner returns (ModelRunnerOutput.attention_scores); 0: none
    observation_len: int = 0
    # hybrid builds (kvexport/io.py "Recurrent state"): the state-pool slot the sequence's linear layers
    # read and write, and the checkpoint copies around the chunk (core/state_pool.py); None: no recurrent
    # state (or a caller without a scheduler: the model runner then gives row r of each step slot r)
    state: StateStep | None = None
    # speculation's proposers (execution/proposers.py): the sequence's tokens before this step's sampling
    # (prompt and outputs, req.token_ids), sent the first time a proposer is to draft for it; the runner
    # then keeps them itself, appending what each step samples (vLLM's new vs cached request data)
    seq_token_ids: tuple[int, ...] | None = None
    # LoRA (runtime/lora.py): the adapter slot the chunk's tokens run with (io.LORA_INDEX); -1: the base model
    lora_slot: int = -1


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What one step did to one request: the scheduler's side (tokens, finishing)."""

    request_id: str
    new_token_ids: tuple[int, ...]  # sampled this step (empty for a prompt chunk that does not sample)
    finish_reason: str | None  # "stop" | "length" | "error" when the request finished this step
    error: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    num_cached_prompt_tokens: int = 0
    # every prompt token's log-probability (from position 1), once: with the request's first output
    prompt_logprobs: PromptLogprobs | None = None
    # speculation: every token of new_token_ids with its log-probabilities, when the step emitted more
    # than one (accepted drafts, then the sampled token; `logprob` / `top_logprobs` are the last's)
    tokens: tuple["SampledToken", ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted: tuple[str, ...]
    # KV tier transfers (kv_tiers.py), in order, for the runner to carry out before the step's compute:
    # evicted blocks saved, blocks moved host -> disk or dropped, disk reads started, hits loaded into blocks
    kv_ops: tuple[TierOp, ...] = ()
    # speculation: (request id, k) for the runner's proposer to draft up to k tokens for once this step
    # sampled the request's next token (ModelRunnerOutput.draft_token_ids); () when nobody drafts
    draft_plan: tuple[tuple[str, int], ...] = ()
    # requests finished since the last step whose tokens the runner was sent (seq_token_ids): forget them
    finished: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # of the sampled token, when the request asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] | None  # (token, logprob), most likely first


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    sampled: dict[str, SampledToken]  # request id -> this step's token (requests whose chunk reached the end)
    failed: dict[str, str]  # request id -> why its part of the step failed (the rest of the step ran)
    # request id -> the log-probabilities of its chunk's prompt_targets (chunks that have some)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    tier_events: TierEvents | None = None  # the KV tiers' reads finished or failed (kv_tiers.py); None: no tiers
    # speculation: request id -> its drafts the target accepted this step, in order, before its `sampled`
    # token (the target's own next token); absent: no draft accepted
    accepted: dict[str, tuple[SampledToken, ...]] = field(default_factory=dict)
    # importance eviction: request id -> the attention its chunk's observation queries gave each KV
    # position the chunk's table covers, summed over layers: [kv_heads, seq_len] float32 (numpy),
    # indexed like the table the runner got (ScheduledRequest.block_table, released blocks left out)
    attention_scores: dict[str, Any] = field(default_factory=dict)
    # speculation: request id -> the drafts its proposer made after this step (SchedulerOutput.draft_plan),
    # to follow the tokens sampled this step; the scheduler budgets them into the next step
    draft_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
