"""Continuous batching over token counts (vLLM v1 style).

A request has `num_computed_tokens` (KV stored) and a KV token list (its `token_ids` unless the
eviction policy dropped some); each step gives every running request the tokens of that list not
yet computed (1 when decoding; a prompt chunk when prefilling) within the token budget, then
admits waiting requests FCFS while the budget, `max_num_seqs` and the KV pool allow. When blocks
run out the newest running request is preempted by recompute: its blocks are freed and it goes
back to the front of the queue with its generated tokens kept.

The scheduler never touches tensors; the model runner only sees `SchedulerOutput`. After
the step, `update_from_output()` records the stored KV and the sampled tokens and owns the
stop rules (EOS, stop token ids, max_tokens, the context) and finishing; stop *strings*
need the text, so the output processor reports those and the engine finishes them here
with `finish_requests()`.

Everything else the scheduler serves is a policy (runtime/core/policies.py has the interfaces and
where the loop calls them), each with its per-request state in `Request.policy_state`:
- eviction (`self.eviction`): keep all, the model's sliding window, or streaming's sinks + recent
  window with context shifts past max_model_len (runtime/core/streaming.py);
- speculation (`self.speculation`): drafts on a decoding step, rolled back when rejected (the base
  policy proposes none). The drafts are made on the runner's side after a step's forward
  (SchedulerOutput.draft_plan says for whom, ModelRunnerOutput.draft_token_ids brings them back);
  a sequence's tokens go to the runner once (ScheduledRequest.seq_token_ids), and the runner is told
  when it finishes (SchedulerOutput.finished);
- KV tier prefetch (`self.prefetch`, runtime/core/kv_tiers.py);
- parallel samples sharing a prompt (`self.shared`) and prompt log-probabilities
  (`self.prompt_logprobs`, runtime/core/prompt_scores.py).
A new eviction or speculation policy is passed to the constructor; the loop below does not change.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvexport.errors import KvExportError

from ..sampling_params import SamplerState, SamplingParams
from .kv_cache_interface import KVCacheManagerProtocol
from .outputs import EngineCoreOutput, ModelRunnerOutput, SampledToken, ScheduledRequest, SchedulerOutput
from .policies import EvictionPolicy, KeepAll, SharedPrompt, SlidingWindowEviction, SpeculationPolicy, TierPrefetch
from .prompt_scores import PromptLogprobsPolicy
from .request import Request, Status
from .stats import KVTierStats, SchedulerStats, StateCheckpointStats
from .streaming import StreamingEviction, StreamingWindow


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 512  # tokens per step (prompt chunks + decodes)
    max_model_len: int = 2048  # prompt + output tokens per sequence
    # the window of the layers whose blocks are freed once entirely outside it: every layer's
    # (one KV group), or the windowed layers' (a WindowedKVCacheManager's local group); None: keep all
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # a sampled one finishes the request ("stop") unless ignore_eos
    streaming: StreamingWindow | None = None  # --kv-eviction streaming (core/streaming.py); None: keep all

    def __post_init__(self) -> None:
        from kvexport.errors import ConfigError

        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ConfigError(f"invalid scheduler limits: {self}")


def eviction_policy(config: SchedulerConfig) -> EvictionPolicy:
    """The eviction policy `config` asks for: streaming, else the model's sliding window, else keep all."""
    if config.streaming is not None:
        return StreamingEviction(config.streaming)
    if config.sliding_window:
        return SlidingWindowEviction(config.sliding_window)
    return KeepAll()


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManagerProtocol[Any], *,
                 eviction: EvictionPolicy | None = None, speculation: SpeculationPolicy | None = None):
        """eviction: None: the one `config` asks for (`eviction_policy`); speculation: None: none."""
        self.config, self.kv = config, kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.num_context_shifts = 0  # recomputes the eviction policy asked for (streaming's context shifts)
        self.streaming = config.streaming
        # the policies (policies.py): the loop below calls them at fixed points
        self.eviction = eviction if eviction is not None else eviction_policy(config)
        self.speculation = speculation if speculation is not None else SpeculationPolicy()
        self.prefetch = TierPrefetch()
        self.shared = SharedPrompt(self.requests)
        self.prompt_logprobs = PromptLogprobsPolicy()
        self._sent: set[str] = set()  # requests whose tokens the runner holds (seq_token_ids sent)
        self._finished: list[str] = []  # of those, finished since the last schedule (SchedulerOutput.finished)
        # NOTE: a sequence may never need more slots than the whole pool, or a lone request
        # would preempt itself forever; the usable context is capped by the pool's size.
        self.pool_tokens = kv.pool.num_usable_blocks * kv.block_size
        self.max_model_len = min(config.max_model_len, self.pool_tokens)

    @property
    def tiers_loading(self) -> bool:
        """The last schedule() left the queue's head waiting for a disk-tier read."""
        return self.prefetch.loading

    def new_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    sampler: SamplerState, salt: str | None = None, share_prompt_with: str | None = None,
                    lora_slot: int = -1) -> Request:
        """share_prompt_with: a parallel sample's leader (admitted once the leader's prompt is cached);
        lora_slot: the LoRA adapter slot its tokens run with (-1: the base model; its identity is in `salt`)."""
        if request_id in self.requests:
            raise KvExportError(f"request id {request_id!r} is already in use; pick a unique id")
        req = Request(request_id, list(prompt), len(prompt), params, sampler, next(self._arrivals), salt=salt,
                      lora_slot=lora_slot)
        self.shared.add(req, share_prompt_with)
        self.prompt_logprobs.add(req)
        self.requests[request_id] = req
        need = len(prompt) + (1 if params.max_tokens else 0)  # NOTE: max_tokens 0 (echo) scores the prompt only
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

    def stats(self, tiers: KVTierStats = KVTierStats(),
              state: StateCheckpointStats = StateCheckpointStats()) -> SchedulerStats:
        """The engine's statistics now (core/stats.py): what the scheduler sees (queues, the full
        group's pool, preemptions, context shifts, speculation) with `tiers` and `state`, the
        figures only the KV connector and a hybrid's state pool hold (all 0: none)."""
        pool = self.kv.pool
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              running_computed_tokens=tuple((r.request_id, r.num_computed_tokens)
                                                            for r in self.running),
                              kv_blocks_used=pool.num_used_blocks, kv_blocks_total=pool.num_usable_blocks,
                              kv_cache_usage=pool.usage, prefix_cache=pool.stats,
                              num_preemptions=self.num_preemptions, num_context_shifts=self.num_context_shifts,
                              tiers=tiers, state=state, spec_decoding=self.speculation.stats())

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        self.prefetch.begin_step()
        self.speculation.begin_step(len(self.running), self.running)
        chunks: list[tuple[Request, int, tuple[int, ...]]] = []  # (request, KV tokens, drafts)
        preempted: list[str] = []
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(self.eviction.num_kv_tokens(req) - req.num_computed_tokens, budget)
            # hybrids: chunks end at state checkpoints
            n = self.kv.clip_chunk(req.num_computed_tokens, n, req.num_prompt_tokens, req.request_id)
            if n <= 0:
                continue
            drafts = self._drafts(req, n, budget)
            while True:
                extra = req.num_computed_tokens + n + len(drafts) - self.kv.num_slots(req.request_id)
                if extra <= 0 or self.kv.allocate_slots(req.request_id, extra) is not None:
                    break
                if drafts:  # NOTE: drafts never preempt anyone: without blocks for them, the step decodes plainly
                    drafts = ()
                    continue
                victim = self.running[-1]  # newest
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                chunks.append((req, n, drafts))
                budget -= n + len(drafts)
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                if self.shared.blocks_admission(req, self.eviction.num_kv_tokens):
                    break  # NOTE: wait one step or so; the sample then reuses the prompt's blocks
                self.prompt_logprobs.before_admit(req, self.shared.leader(req))
                # NOTE: no lookup (an empty token list hits nothing) while the prompt's logprobs are
                # still to be scored: cached blocks have no logits (core/prompt_scores.py)
                lookup = () if self.prompt_logprobs.scoring(req) else self.eviction.prefix_lookup(req)
                computed = self.kv.get_computed_blocks(lookup, req.salt)
                if self.prefetch.must_wait(self.kv, computed):
                    # NOTE: part of its prefix is being read from the disk tier (kv_tiers.py, off the
                    # step): the running requests go on; it is looked up again next step
                    break
                n = min(self.eviction.num_kv_tokens(req) - computed.num_computed_tokens, budget)
                n = self.kv.clip_chunk(computed.num_computed_tokens, n, req.num_prompt_tokens, req.request_id)
                if self.kv.allocate_slots(req.request_id, n, computed) is None:
                    break  # FCFS: nobody overtakes the head of the queue
                self.waiting.popleft()
                # NOTE: first admission: a request re-queued (preempted, or shifted after an output) has
                # recomputed tokens, not prefix-cache hits, to count
                if req.num_preemptions == 0 and req.num_output_tokens == 0:
                    req.num_cached_prompt_tokens = computed.num_computed_tokens
                req.num_computed_tokens = computed.num_computed_tokens
                req.status = Status.RUNNING
                self.running.append(req)
                chunks.append((req, n, ()))
                budget -= n
        out = [self._scheduled(req, n, drafts) for req, n, drafts in chunks]
        plan = self.speculation.plan([req for (req, _, _), s in zip(chunks, out) if s.samples], len(self.running))
        if plan:
            out = self._send_tokens(out, {rid for rid, _ in plan})
        finished, self._finished = tuple(self._finished), []
        return SchedulerOutput(tuple(out), self.config.max_num_batched_tokens - budget, tuple(preempted),
                               self.prefetch.take_ops(self.kv), draft_plan=plan, finished=finished)

    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Record that the step's KV is stored, append sampled tokens, apply the stop rules
        and finish requests (freeing their blocks). Requests whose part of the step failed
        finish with "error". Returns one EngineCoreOutput per request the step changed."""
        outs = []
        self.speculation.end_step(output)  # (the step's time, for speculation's cost model)
        self.prefetch.apply(self.kv, result)  # reads and failures of the KV tiers (kv_tiers.py)
        for s in output.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted while the step ran
            if s.request_id in result.failed:
                self._finish(req, "error", result.failed[s.request_id])
                outs.append(EngineCoreOutput(req.request_id, (), "error", req.error))
                continue
            req.num_computed_tokens += len(s.token_ids)
            # rejected drafts: their KV is dropped before anything is published (policies.py)
            req.num_computed_tokens -= self.speculation.verify(req, s, result)
            accepted = result.accepted.get(s.request_id, ()) if s.num_draft_tokens else ()
            req.token_ids.extend(t.token_id for t in accepted)  # NOTE: their KV is stored (the sampled token's is not)
            published = self.eviction.publish_tokens(req)
            if published is not None:
                self.kv.cache_blocks(req.request_id, published, req.num_computed_tokens)
            self.prompt_logprobs.record(req, result.prompt_logprobs.get(s.request_id))
            tok = result.sampled.get(s.request_id)
            if tok is None:
                if req.params.max_tokens == 0 and req.num_computed_tokens >= req.num_prompt_tokens:
                    self._finish(req, "length")  # the prompt only
                    outs.append(EngineCoreOutput(req.request_id, (), "length", None,
                                                 num_cached_prompt_tokens=req.num_cached_prompt_tokens,
                                                 prompt_logprobs=self.prompt_logprobs.result(req)))
                else:
                    self.eviction.after_step(req, self.kv, result)
                continue
            req.token_ids.append(tok.token_id)
            emitted, reason = self._stop_emitted(req, (*accepted, tok))
            if reason:
                self._finish(req, reason)
            elif self.eviction.shift_context(req, self.max_model_len):
                self._requeue(req)  # the next token's position would reach max_model_len: recompute the kept tokens
                self.num_context_shifts += 1
            else:
                self.eviction.after_step(req, self.kv, result)
            tok = emitted[-1]
            outs.append(EngineCoreOutput(req.request_id, tuple(t.token_id for t in emitted), reason, None, tok.logprob,
                                         tok.top_logprobs, req.num_cached_prompt_tokens,
                                         self.prompt_logprobs.result(req) if req.num_output_tokens == 1 else None,
                                         tokens=emitted if len(emitted) > 1 else ()))
        self.speculation.offer(result.draft_token_ids, self.running)  # the runner's drafts, for the next step
        return outs

    def finish_requests(self, request_ids, reason: str) -> None:
        """Finish running or waiting requests (e.g. a stop string the output processor found)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and req.status is not Status.FINISHED:
                if req in self.waiting:
                    self.waiting.remove(req)
                self._finish(req, reason)

    def _stop_reason(self, req: Request, token: int, n: int | None = None) -> str | None:
        """The stop rule for `token`, the sequence's n-th output token (default: its last)."""
        p = req.params
        n = req.num_output_tokens if n is None else n
        if n >= p.min_tokens and ((token in self.config.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids):
            return "stop"
        if n >= p.max_tokens or (not self.eviction.outlives_context and req.num_prompt_tokens + n >= self.max_model_len):
            return "length"
        return None

    def _stop_emitted(self, req: Request, emitted: tuple[SampledToken, ...]) -> tuple[tuple[SampledToken, ...], str | None]:
        """The stop rules on a step's emitted tokens (the last len(emitted) of req.token_ids: accepted
        drafts, then the sampled token): those up to the first that stops (the rest are dropped from
        token_ids), and its reason."""
        n0 = req.num_output_tokens - len(emitted)
        for i, t in enumerate(emitted):
            reason = self._stop_reason(req, t.token_id, n0 + i + 1)
            if reason:
                if i + 1 < len(emitted):
                    del req.token_ids[i + 1 - len(emitted):]
                return emitted[:i + 1], reason
        return emitted, None

    # ---- internals -------------------------------------------------------------------
    def _drafts(self, req: Request, n: int, budget: int) -> tuple[int, ...]:
        """Speculation's drafts for a request whose step is its next token (it decodes), within the budget."""
        # NOTE: never past max_tokens or the context: the last draft's successor is the step's last token
        room = min(budget - 1, req.params.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - self.eviction.num_kv_tokens(req) - 1)
        if n != 1 or room < 1 or req.num_output_tokens == 0:
            return ()
        return tuple(self.speculation.propose(req, room))[:room]

    def _send_tokens(self, out: list[ScheduledRequest], planned: set[str]) -> list[ScheduledRequest]:
        """The step's chunks, those of planned requests the runner has no tokens of yet carrying them
        (seq_token_ids: the runner keeps them from now on, appending what it samples)."""
        new = planned - self._sent
        if not new:
            return out
        self._sent |= new
        return [dataclasses.replace(s, seq_token_ids=tuple(self.requests[s.request_id].token_ids))
                if s.request_id in new else s for s in out]

    def _scheduled(self, req: Request, n: int, drafts: tuple[int, ...]) -> ScheduledRequest:
        """The runner's view of a request's chunk: n tokens of its KV token list from
        num_computed_tokens, then the drafts."""
        start, total = req.num_computed_tokens, n + len(drafts)
        samples = start + n == self.eviction.num_kv_tokens(req) and req.params.max_tokens > 0
        # rows at positions start..start+n-1 predict the tokens after them; those still to be scored
        targets, first, top_k = self.prompt_logprobs.targets(req, start, n)
        table, gap = self.eviction.view(req, tuple(self.kv.block_table(req.request_id)))
        return ScheduledRequest(
            req.request_id, tuple(self.eviction.kv_token_ids(req, start, start + n)) + drafts, start, table,
            tuple(self.kv.slot_mapping(req.request_id, start, total)),
            samples, req.sampler if samples else None, req.num_output_tokens,
            self.kv.extra_groups(req.request_id, start, total),
            targets, first, top_k, kv_gap=gap, num_draft_tokens=len(drafts),
            observation_len=self.eviction.observation_len(req, start, n),
            state=self.kv.state_step(req.request_id, start, n, req.token_ids, req.num_prompt_tokens),
            lora_slot=req.lora_slot)

    def _requeue(self, req: Request) -> None:
        """Back to the front of the queue to be computed again (a preemption by recompute, or a
        context shift): its blocks are freed, its tokens kept."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)

    def _preempt(self, req: Request) -> None:
        self._requeue(req)
        # NOTE: a request still scoring its prompt's logprobs needs every prompt token computed again
        self.eviction.on_preempt(req, keep_tokens=self.prompt_logprobs.scoring(req))
        req.num_preemptions += 1
        self.num_preemptions += 1

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.request_id in self.kv:
            self.kv.free(req.request_id)
        if req.request_id in self._sent:
            self._sent.discard(req.request_id)
            self._finished.append(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error


__all__ = ["Request", "Scheduler", "SchedulerConfig", "SchedulerStats", "Status", "eviction_policy"]
