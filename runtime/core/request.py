"""A request as the scheduler holds it: its tokens, how many of them have KV stored, its
status and finish, and one slot of per-feature state that the scheduler's policies own
(runtime/core/policies.py). Nothing here knows about a feature: streaming eviction's dropped
tokens, prompt log-probabilities and parallel samples keep their state in `policy_state`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import SamplerState, SamplingParams


class Status(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens appended in place
    num_prompt_tokens: int
    params: SamplingParams
    sampler: SamplerState
    arrival: int  # FCFS order
    num_computed_tokens: int = 0  # tokens of the sequence's KV token list whose KV is stored
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit on first admission
    salt: str | None = None  # prefix-cache salt (core/block_hash.request_salt)
    lora_slot: int = -1  # the LoRA adapter slot its tokens run with (runtime/lora.py); -1: the base model
    # per-feature state, by policy key (policies.Policy.key); a policy's entry is its own business
    policy_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


__all__ = ["Request", "Status"]
