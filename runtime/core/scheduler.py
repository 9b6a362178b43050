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

Prompt log-probabilities (SamplingParams.prompt_logprobs): a chunk of such a request lists
the prompt tokens its rows predict (`ScheduledRequest.prompt_targets`), the runner scores
them from the step's every-token logits (an `--all-logits` build: the engine refuses the
request on others), and the scores are kept here, by position, until the request's first
output carries all of them. NOTE (choices):
- prefix cache: tokens served from cached blocks have no logits, so a request whose prompt
  logprobs are not all in skips the prefix-cache lookup and computes its whole prompt (as
  vLLM does); its blocks are still cached for others. Parallel samples (`share_prompt_with`)
  copy their leader's scores instead, once it has them all, and then reuse its blocks.
- chunked prefill: each chunk scores its own rows; preemption by recompute computes the
  prompt again but scores only the positions not yet scored, so nothing is duplicated.
- max_tokens 0: the request computes its prompt and finishes ("length") without sampling.

Streaming eviction (SchedulerConfig.streaming, runtime/core/streaming.py): after each step a
running sequence's blocks between its sinks and its recent window are released; its chunks get
the table without them (`ScheduledRequest.kv_gap`); no "length" at max_model_len: a sequence whose
next token would reach it takes a context shift (its middle tokens leave its KV token list,
`Request.num_dropped`, and the kept ones are recomputed, as a preemption would), and so does a
preempted one. NOTE: blocks computed once a release hid part of their prefix are not published to
the prefix cache (their KV is not the prefix's): only the blocks before the first release are.
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
from .streaming import StreamingWindow, compact
from .outputs import EngineCoreOutput, ModelRunnerOutput, PromptLogprobs, ScheduledRequest, SchedulerOutput


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 512  # tokens per step (prompt chunks + decodes)
    max_model_len: int = 2048  # prompt + output tokens per sequence
    # the window of the layers whose blocks are freed once entirely outside it: every layer's
    # (one KV group), or the windowed layers' (a HybridKVCacheManager's local group); None: keep all
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # a sampled one finishes the request ("stop") unless ignore_eos
    streaming: StreamingWindow | None = None  # --kv-eviction streaming (core/streaming.py); None: keep all

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
    num_context_shifts: int = 0  # streaming: context shifts since start (core/streaming.py)


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
    prompt_scores: list[PromptLogprobs] | None = None  # prompt logprobs scored so far, consecutive from position 1
    # streaming (core/streaming.py): tokens after the sinks dropped from the KV token list by context shifts
    num_dropped: int = 0
    num_shifts: int = 0  # context shifts so far
    publish_limit: int | None = None  # KV tokens whose blocks may be published (None: all; set at the first release)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_kv_tokens(self) -> int:
        """Tokens of the KV token list (token_ids without the ones context shifts dropped)."""
        return len(self.token_ids) - self.num_dropped

    def kv_token_ids(self, start: int = 0, end: int | None = None, sink_tokens: int = 0) -> list[int]:
        """Entries start..end of the KV token list: token_ids[:sink_tokens] + token_ids[sink_tokens + num_dropped:]."""
        end = self.num_kv_tokens if end is None else end
        ids, k, d = self.token_ids, sink_tokens, self.num_dropped
        if not d:
            return ids[start:end]
        return (ids[start:min(end, k)] if start < k else []) + (ids[max(start, k) + d:end + d] if end > k else [])

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def next_scored_position(self) -> int:
        """The first prompt position whose logprob is still to come (from 1; num_prompt_tokens: all in)."""
        parts = self.prompt_scores or ()
        return parts[-1].start + len(parts[-1]) if parts else 1

    @property
    def scoring(self) -> bool:
        """Prompt logprobs asked for and not all scored yet."""
        return self.prompt_scores is not None and self.next_scored_position < self.num_prompt_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManagerProtocol[Any]):
        self.config, self.kv = config, kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.tiers_loading = False  # the last schedule() left the queue's head waiting for a disk-tier read
        self.num_context_shifts = 0
        self.streaming = config.streaming
        # NOTE: a sequence may never need more slots than the whole pool, or a lone request
        # would preempt itself forever; the usable context is capped by the pool's size.
        self.pool_tokens = kv.pool.num_usable_blocks * kv.block_size
        self.max_model_len = min(config.max_model_len, self.pool_tokens)

    def new_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    sampler: SamplerState, salt: str | None = None, share_prompt_with: str | None = None) -> Request:
        if request_id in self.requests:
            raise KvExportError(f"request id {request_id!r} is already in use; pick a unique id")
        req = Request(request_id, list(prompt), len(prompt), params, sampler, next(self._arrivals), salt=salt,
                      share_prompt_with=share_prompt_with,
                      prompt_scores=[] if params.prompt_logprobs is not None else None)
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
                              tuple((r.request_id, r.num_computed_tokens) for r in self.running),
                              self.num_context_shifts)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        self.tiers_loading = False  # the queue's head waits for a disk-tier read (set below)
        chunks: list[tuple[Request, int]] = []
        preempted: list[str] = []
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_kv_tokens - req.num_computed_tokens, budget)
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
                self._copy_leader_scores(req)
                # NOTE: no lookup (an empty token list hits nothing) while the prompt's logprobs are
                # still to be scored: cached blocks have no logits (module docstring)
                computed = self.kv.get_computed_blocks(() if req.scoring else self._kv_ids(req), req.salt)
                if self.kv.prefetch_tier_hits(computed):
                    # NOTE: part of its prefix is being read from the disk tier (kv_tiers.py, off the
                    # step): the running requests go on; it is looked up again next step
                    self.tiers_loading = True
                    break
                n = min(req.num_kv_tokens - computed.num_computed_tokens, budget)
                if self.kv.allocate_slots(req.request_id, n, computed) is None:
                    break  # FCFS: nobody overtakes the head of the queue
                self.waiting.popleft()
                if req.num_preemptions == 0 and req.num_shifts == 0:
                    req.num_cached_prompt_tokens = computed.num_computed_tokens
                req.num_computed_tokens = computed.num_computed_tokens
                req.status = Status.RUNNING
                self.running.append(req)
                chunks.append((req, n))
                budget -= n
        out = []
        for req, n in chunks:
            start = req.num_computed_tokens
            samples = start + n == req.num_kv_tokens and req.params.max_tokens > 0
            # rows at positions start..start+n-1 predict the tokens after them; those still to be scored
            first = max(start + 1, req.next_scored_position)
            targets = tuple(req.token_ids[first:min(start + n + 1, req.num_prompt_tokens)]) if req.scoring else ()
            table, gap = tuple(self.kv.block_table(req.request_id)), 0
            if self.streaming is not None:
                table, gap = compact(table, self.kv.block_size)
            out.append(ScheduledRequest(
                req.request_id, tuple(self._kv_ids(req, start, start + n)), start, table,
                tuple(self.kv.slot_mapping(req.request_id, start, n)),
                samples, req.sampler if samples else None, req.num_output_tokens,
                self.kv.extra_groups(req.request_id, start, n),
                targets, first, req.params.prompt_logprobs or 0, kv_gap=gap))
        return SchedulerOutput(tuple(out), self.config.max_num_batched_tokens - budget, tuple(preempted),
                               self.kv.take_tier_ops())

    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Record that the step's KV is stored, append sampled tokens, apply the stop rules
        and finish requests (freeing their blocks). Requests whose part of the step failed
        finish with "error". Returns one EngineCoreOutput per request the step changed."""
        outs = []
        if result.tier_events is not None:  # reads and failures of the KV tiers (kv_tiers.py)
            self.kv.apply_tier_events(result.tier_events)
        for s in output.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted while the step ran
            if s.request_id in result.failed:
                self._finish(req, "error", result.failed[s.request_id])
                outs.append(EngineCoreOutput(req.request_id, (), "error", req.error))
                continue
            req.num_computed_tokens += len(s.token_ids)
            if req.publish_limit is None:
                self.kv.cache_blocks(req.request_id, self._kv_ids(req) if req.num_dropped else req.token_ids,
                                     req.num_computed_tokens)
            scores = result.prompt_logprobs.get(s.request_id)
            if scores is not None and req.prompt_scores is not None:
                scores = scores.since(req.next_scored_position)  # NOTE: defensive; the scheduler asks for new ones only
                if len(scores):
                    req.prompt_scores.append(scores)
            tok = result.sampled.get(s.request_id)
            if tok is None:
                if req.params.max_tokens == 0 and req.num_computed_tokens >= req.num_prompt_tokens:
                    self._finish(req, "length")  # the prompt only
                    outs.append(EngineCoreOutput(req.request_id, (), "length", None,
                                                 num_cached_prompt_tokens=req.num_cached_prompt_tokens,
                                                 prompt_logprobs=self._all_scores(req)))
                else:
                    self._release(req)
                continue
            req.token_ids.append(tok.token_id)
            reason = self._stop_reason(req, tok.token_id)
            if reason:
                self._finish(req, reason)
            elif self.streaming is not None and req.num_kv_tokens > self.max_model_len:
                self._context_shift(req)  # the next token's position would reach max_model_len
            else:
                self._release(req)
            outs.append(EngineCoreOutput(req.request_id, (tok.token_id,), reason, None, tok.logprob, tok.top_logprobs,
                                         req.num_cached_prompt_tokens,
                                         self._all_scores(req) if req.num_output_tokens == 1 else None))
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
        if n >= p.max_tokens or (self.streaming is None and req.num_tokens >= self.max_model_len):
            return "length"
        return None

    # ---- internals -------------------------------------------------------------------
    def _kv_ids(self, req: Request, start: int = 0, end: int | None = None) -> list[int]:
        """Entries start..end of the request's KV token list (its token_ids unless streaming dropped some)."""
        return req.kv_token_ids(start, end, self.streaming.sink_tokens if self.streaming else 0)

    def _release(self, req: Request) -> None:
        """After a step: free the blocks no future token of the request reads (the model's sliding
        window, or streaming's middle blocks)."""
        w = self.streaming
        if w is not None:
            released = self.kv.free_outside_window(req.request_id, req.num_computed_tokens, w.release_window,
                                                    keep_first=w.sink_blocks)
            if released and req.publish_limit is None:
                req.publish_limit = req.num_computed_tokens  # later tokens no longer see their whole prefix
        elif self.config.sliding_window:
            self.kv.free_outside_window(req.request_id, req.num_computed_tokens, self.config.sliding_window)

    def _drop_middle(self, req: Request) -> None:
        """Streaming: keep the sinks and the last recent_tokens (+ the next token) of the KV token list."""
        w = self.streaming
        assert w is not None
        drop = req.num_kv_tokens - w.kept_after_shift
        if drop > 0 and req.num_kv_tokens > w.sink_tokens:
            req.num_dropped += drop

    def _context_shift(self, req: Request) -> None:
        """Streaming: drop the middle of the request's KV token list and recompute the kept tokens
        at positions 0.. (it goes back to the front of the queue, as a preempted request does)."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        self._drop_middle(req)
        req.num_shifts += 1
        self.num_context_shifts += 1
        req.status, req.num_computed_tokens, req.publish_limit = Status.WAITING, 0, None
        self.waiting.appendleft(req)

    @staticmethod
    def _all_scores(req: Request) -> PromptLogprobs | None:
        """Every prompt token's logprob from position 1 (empty for a one-token prompt), or None
        when none were asked for."""
        if req.prompt_scores is None:
            return None
        assert not req.scoring, "the prompt is computed, so every position is scored"
        if not req.prompt_scores:
            return PromptLogprobs(1, (), (), (), () if req.params.prompt_logprobs else None)
        return PromptLogprobs.concat(req.prompt_scores)

    def _copy_leader_scores(self, req: Request) -> None:
        """A parallel sample takes its leader's prompt scores once the leader has them all (then
        it looks its prompt up in the cache like any other request)."""
        lead = self.requests.get(req.share_prompt_with) if req.share_prompt_with else None
        if req.scoring and lead is not None and lead.prompt_scores is not None and not lead.scoring \
                and lead.params.prompt_logprobs == req.params.prompt_logprobs:
            req.prompt_scores = list(lead.prompt_scores)

    def _prompt_pending(self, req: Request) -> bool:
        """A parallel sample waits while its leader is still computing the shared prompt."""
        lead = self.requests.get(req.share_prompt_with) if req.share_prompt_with else None
        return (lead is not None and lead.status is Status.RUNNING
                and lead.num_computed_tokens < min(lead.num_prompt_tokens, lead.num_kv_tokens))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        if self.streaming is not None and not req.scoring:
            self._drop_middle(req)  # NOTE: recomputed anyway: only the kept tokens (as a context shift)
            req.publish_limit = None
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
