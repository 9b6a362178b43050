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

from dataclasses import dataclass

from ..sampling_params import SamplerState
from .kv_cache_manager import GroupBlocks


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


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # of the sampled token, when the request asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] | None  # (token, logprob), most likely first


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    sampled: dict[str, SampledToken]  # request id -> this step's token (requests whose chunk reached the end)
    failed: dict[str, str]  # request id -> why its part of the step failed (the rest of the step ran)
