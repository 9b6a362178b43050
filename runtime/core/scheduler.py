"""Continuous batching over token counts (vLLM v1 style).

A request has `num_computed_tokens` (KV stored) and `num_tokens` (prompt + output); each
step gives every running request `num_tokens - num_computed_tokens` tokens (1 when
decoding; a prompt chunk when prefilling) within the token budget, then admits waiting
requests FCFS while the budget, `max_num_seqs` and the KV pool allow. When blocks run out
the newest running request is preempted by recompute: its blocks are freed and it goes
back to the front of the queue with its generated tokens kept.

The scheduler never touches tensors; the model runner only sees `SchedulerOutput`. After
the step, `update_from_output()` records the stored KV and the sampled tokens and owns the
stop rules (EOS, stop token ids, max_tokens, the context) and finishing; stop *strings*
need the text, so the output processor reports those and the engine finishes them here
with `finish_requests()`.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvexport.errors import KvExportError

from ..sampling_params import SamplerState, SamplingParams
from .kv_cache_interface import KVCacheManagerProtocol
from .outputs import EngineCoreOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 512  # tokens per step (prompt chunks + decodes)
    max_model_len: int = 2048  # prompt + output tokens per sequence
    # the window of the layers whose blocks are freed once entirely outside it: every layer's
    # (one KV group), or the windowed layers' (a HybridKVCacheManager's local group); None: keep all
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # a sampled one finishes the request ("stop") unless ignore_eos

    def __post_init__(self) -> None:
        from kvexport.errors import ConfigError

        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ConfigError(f"invalid scheduler limits: {self}")


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The queues as counts, for metrics and benches: nothing outside the scheduler reads
    its queues."""

    num_running: int  # requests holding KV blocks
    num_waiting: int  # requests queued for admission (new or preempted)
    num_preemptions: int  # preemptions since start
    running_computed_tokens: tuple[tuple[str, int], ...]  # (request id, tokens whose KV is stored)


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
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit on first admission
    salt: str | None = None
    share_prompt_with: str | None = None  # parallel sample: admitted once that request's prompt is cached

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


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManagerProtocol[Any]):
        self.config, self.kv = config, kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        # NOTE: a sequence may never need more slots than the whole pool, or a lone request
        # would preempt itself forever; the usable context is capped by the pool's size.
        self.pool_tokens = kv.pool.num_usable_blocks * kv.block_size
        self.max_model_len = min(config.max_model_len, self.pool_tokens)

    def new_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    sampler: SamplerState, salt: str | None = None, share_prompt_with: str | None = None) -> Request:
        if request_id in self.requests:
            raise KvExportError(f"request id {request_id!r} is already in use; pick a unique id")
        req = Request(request_id, list(prompt), len(prompt), params, sampler, next(self._arrivals), salt=salt,
                      share_prompt_with=share_prompt_with)
        self.requests[request_id] = req
        need = len(prompt) + 1
        if not prompt:
            self._finish(req, "error", "empty prompt: give at least one token")
        elif need > self.config.max_model_len:
            self._finish(req, "error", f"prompt of {len(prompt)} tokens does not fit the context of "
                                       f"{self.config.max_model_len} tokens (prompt + at least 1 output)")
        elif need > self.pool_tokens:
            self._finish(req, "error", f"prompt of {len(prompt)} tokens needs more KV blocks than the whole "
                                       f"pool holds ({self.pool_tokens} tokens); raise --kv-cache-memory")
        else:
            self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> None:
        self.finish_requests([request_id], "abort")

    def remove(self, request_id: str) -> None:
        """Forget a finished request (its blocks are already free)."""
        req = self.requests.get(request_id)
        if req is not None and req.status is Status.FINISHED:
            del self.requests[request_id]

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions,
                              tuple((r.request_id, r.num_computed_tokens) for r in self.running))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[tuple[Request, int]] = []
        preempted: list[str] = []
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            while True:
                extra = req.num_computed_tokens + n - self.kv.num_slots(req.request_id)
                if extra <= 0 or self.kv.allocate_slots(req.request_id, extra) is not None:
                    break
                victim = self.running[-1]  # newest
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                chunks.append((req, n))
                budget -= n
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                if self._prompt_pending(req):
                    break  # NOTE: wait one step or so; the sample then reuses the prompt's blocks
                computed = self.kv.get_computed_blocks(req.token_ids, req.salt)
                n = min(req.num_tokens - computed.num_computed_tokens, budget)
                if self.kv.allocate_slots(req.request_id, n, computed) is None:
                    break  # FCFS: nobody overtakes the head of the queue
                self.waiting.popleft()
                if req.num_preemptions == 0:
                    req.num_cached_prompt_tokens = computed.num_computed_tokens
                req.num_computed_tokens = computed.num_computed_tokens
                req.status = Status.RUNNING
                self.running.append(req)
                chunks.append((req, n))
                budget -= n
        out = []
        for req, n in chunks:
            start = req.num_computed_tokens
            samples = start + n == req.num_tokens
            out.append(ScheduledRequest(
                req.request_id, tuple(req.token_ids[start:start + n]), start,
                tuple(self.kv.block_table(req.request_id)),
                tuple(self.kv.slot_mapping(req.request_id, start, n)),
                samples, req.sampler if samples else None, req.num_output_tokens,
                self.kv.extra_groups(req.request_id, start, n)))
        return SchedulerOutput(tuple(out), self.config.max_num_batched_tokens - budget, tuple(preempted))

    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Record that the step's KV is stored, append sampled tokens, apply the stop rules
        and finish requests (freeing their blocks). Requests whose part of the step failed
        finish with "error". Returns one EngineCoreOutput per request the step changed."""
        outs = []
        for s in output.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted while the step ran
            if s.request_id in result.failed:
                self._finish(req, "error", result.failed[s.request_id])
                outs.append(EngineCoreOutput(req.request_id, (), "error", req.error))
                continue
            req.num_computed_tokens += len(s.token_ids)
            self.kv.cache_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
            tok = result.sampled.get(s.request_id)
            if tok is None:
                if self.config.sliding_window:
                    self.kv.free_outside_window(req.request_id, req.num_computed_tokens, self.config.sliding_window)
                continue
            req.token_ids.append(tok.token_id)
            reason = self._stop_reason(req, tok.token_id)
            if reason:
                self._finish(req, reason)
            elif self.config.sliding_window:
                self.kv.free_outside_window(req.request_id, req.num_computed_tokens, self.config.sliding_window)
            outs.append(EngineCoreOutput(req.request_id, (tok.token_id,), reason, None, tok.logprob, tok.top_logprobs,
                                         req.num_cached_prompt_tokens))
        return outs

    def finish_requests(self, request_ids, reason: str) -> None:
        """Finish running or waiting requests (e.g. a stop string the output processor found)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and req.status is not Status.FINISHED:
                if req in self.waiting:
                    self.waiting.remove(req)
                self._finish(req, reason)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p, n = req.params, req.num_output_tokens
        if n >= p.min_tokens and ((token in self.config.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids):
            return "stop"
        if n >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ---- internals -------------------------------------------------------------------
    def _prompt_pending(self, req: Request) -> bool:
        """A parallel sample waits while its leader is still computing the shared prompt."""
        lead = self.requests.get(req.share_prompt_with) if req.share_prompt_with else None
        return (lead is not None and lead.status is Status.RUNNING
                and lead.num_computed_tokens < lead.num_prompt_tokens)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.request_id in self.kv:
            self.kv.free(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
