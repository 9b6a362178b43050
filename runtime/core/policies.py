"""The scheduler's policies: every feature the scheduler serves beyond continuous batching is an
object with a small interface, called by the core loop (scheduler.py: token budget → running →
waiting → preemption) at fixed points. A policy keeps its per-request state in the request's
one state slot, `Request.policy_state[policy.key]`, never in fields of `Request`.

    schedule()
      running  n = eviction.num_kv_tokens - computed ──▶ + speculation.propose (a decode's drafts)
               allocate slots; out of blocks: preempt the newest (eviction.on_preempt)
      waiting  shared.blocks_admission ─▶ prompt_logprobs.before_admit ─▶ prefix lookup of
               eviction.kv_token_ids (none while prompt_logprobs.scoring) ─▶ prefetch.must_wait
      chunks   eviction.kv_token_ids + drafts, eviction.view (the table the runner sees),
               prompt_logprobs.targets; SchedulerOutput.kv_ops = prefetch.take_ops;
               SchedulerOutput.draft_plan = speculation.plan (whom the runner's proposer drafts for)
    update_from_output()
      prefetch.apply ─▶ computed += step ─▶ speculation.verify (roll back rejected drafts) ─▶
      eviction.publish_tokens (prefix cache) ─▶ prompt_logprobs.record ─▶ sampled token, stop rules
      (eviction.outlives_context) ─▶ eviction.shift_context (recompute) or eviction.after_step;
      then speculation.offer (the runner's drafts, for the next step)

The roles, one object each on the scheduler:
- `EvictionPolicy` — which KV a running sequence keeps: `KeepAll`, `SlidingWindowEviction` (the
  model's window), `StreamingEviction` (sinks + recent window, core/streaming.py); importance-based
  eviction (blocks scored by the attention op, within a per-sequence budget) is one more subclass.
- `SpeculationPolicy` — extra tokens on a decoding sequence's step and their rollback; the base
  proposes none (speculative decoding is one subclass).
- `TierPrefetch` — waits for prefix blocks read from the disk tier (core/kv_tiers.py) and carries
  the tiers' transfers; the KV manager's tier calls, unchanged.
- `SharedPrompt` — parallel samples: a sample waits while its leader computes the shared prompt.
- `PromptLogprobsPolicy` (core/prompt_scores.py) — prompt log-probabilities and the leader copying.

Policies are given the KV manager in the calls that free or look up blocks; they never hold the
scheduler, and the core loop mediates between them (e.g. a preemption tells the eviction policy
whether prompt logprobs still need every prompt token).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from .kv_cache_interface import ComputedHits, KVCacheManagerProtocol
from .kv_tiers import TierOp
from .outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from .request import Request, Status
from .stats import SpecDecodingStats


class Policy:
    """A feature the scheduler serves. `key` names its entry in `Request.policy_state`."""

    key: ClassVar[str]

    def new_state(self) -> Any:
        """A request's state for this policy, made on first use by `state()`."""
        raise NotImplementedError(f"{type(self).__name__} keeps no per-request state")

    def state(self, req: Request) -> Any:
        """This policy's state of `req` (made by `new_state()` if it has none yet)."""
        st = req.policy_state.get(self.key)
        if st is None:
            st = req.policy_state[self.key] = self.new_state()
        return st


# ---- eviction -------------------------------------------------------------------------------
class EvictionPolicy(Policy):
    """Which KV a running sequence keeps. The base keeps everything and is the interface:

    - the sequence's **KV token list** (`num_kv_tokens`, `kv_token_ids`): the tokens whose KV the
      scheduler computes, at positions 0..; `token_ids` unless the policy drops some (a context shift);
    - `view`: the block table (and the tokens of released blocks it leaves out) the runner gets;
    - `after_step`: called after every step that stored KV of the sequence and left it running — every
      prompt chunk (so also the step that completes the prompt) and every decode; may free blocks of
      the sequence (`kv.free_outside_window`, or any release that leaves `PAD_BLOCK_ID` entries);
    - `publish_tokens`: the KV token list whose full blocks may go to the prefix cache (None: none,
      e.g. once a release hid part of later blocks' prefix);
    - `shift_context` / `outlives_context`: whether a sequence goes on past max_model_len;
    - `on_preempt`: the sequence was preempted (its blocks are free; it is recomputed).
    """

    key = "eviction"
    outlives_context: ClassVar[bool] = False  # True: no "length" at max_model_len (shift_context instead)

    def num_kv_tokens(self, req: Request) -> int:
        return len(req.token_ids)

    def kv_token_ids(self, req: Request, start: int = 0, end: int | None = None) -> list[int]:
        """Entries start..end of the KV token list."""
        return req.token_ids[start:end]

    def publish_tokens(self, req: Request) -> Sequence[int] | None:
        """The KV token list for `kv.cache_blocks` (its first num_computed_tokens have KV), or None."""
        return req.token_ids

    def prefix_lookup(self, req: Request) -> list[int]:
        """The tokens a prefix-cache lookup at admission may cover (`kv.get_computed_blocks`): the KV
        token list, or less of it when the policy needs some of its last tokens computed (importance
        eviction's observation window)."""
        return self.kv_token_ids(req)

    def view(self, req: Request, table: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """The block table the runner gets, and the tokens of the released blocks it leaves out
        (`ScheduledRequest.kv_gap`)."""
        return table, 0

    def observation_len(self, req: Request, start: int, n: int) -> int:
        """Tokens at the end of the chunk start..start+n-1 whose attention the step is to return
        (`ScheduledRequest.observation_len`; importance eviction, core/importance.py); 0: none."""
        return 0

    def after_step(self, req: Request, kv: KVCacheManagerProtocol[Any], result: ModelRunnerOutput) -> None:
        """The step stored KV of `req`, which runs on: free what no future token reads. `result`
        is the step's runner output (what an attention-scored policy reads its scores from)."""

    def shift_context(self, req: Request, max_model_len: int) -> bool:
        """After a sampled token: True when the sequence must be recomputed from position 0 (the
        policy has changed its KV token list; the scheduler re-queues it, as a preemption)."""
        return False

    def on_preempt(self, req: Request, keep_tokens: bool) -> None:
        """`req` was preempted by recompute. keep_tokens: its KV token list must stay whole (its
        prompt logprobs are still being scored)."""


class KeepAll(EvictionPolicy):
    """Every block a sequence computed stays until it finishes."""


class SlidingWindowEviction(EvictionPolicy):
    """The model's sliding window: blocks entirely outside it are released after every step (every
    layer's, or a WindowedKVCacheManager's local group)."""

    def __init__(self, window: int):
        self.window = window  # tokens the next token attends to, itself included

    def after_step(self, req: Request, kv: KVCacheManagerProtocol[Any], result: ModelRunnerOutput) -> None:
        kv.free_outside_window(req.request_id, req.num_computed_tokens, self.window)


# ---- speculation ----------------------------------------------------------------------------
class SpeculationPolicy(Policy):
    """Extra tokens on a decoding sequence's step, rolled back after when rejected. The base
    proposes none, which is plain decoding.

    `propose` is asked for a running request whose step is its one next token (it has output
    tokens); the drafts are appended to that step's tokens (`ScheduledRequest.token_ids`, the last
    `num_draft_tokens` of them), get slots like any token and count against the token budget.
    After the step stored their KV, `verify` says how many of the step's tokens to roll back:
    `num_computed_tokens` moves back by that many before anything is published, so a rejected
    draft never becomes a prefix-cache or tier block and its slots are written again by a later
    step. The scheduler then appends the drafts the runner accepted (`result.accepted`, whose KV
    is stored) and the token it sampled (`result.sampled`), applying the stop rules to each in
    turn. Speculative decoding itself (adaptive back-off, the cost model) is core/speculation.py; its
    proposers run beside the runner (execution/proposers.py), never from here: `plan` tells the runner
    (SchedulerOutput.draft_plan) whom to draft for after the step's forward, and the runner's drafts
    (ModelRunnerOutput.draft_token_ids) come back through `offer`, for the next step's `propose`.
    """

    key = "speculation"

    def begin_step(self, num_running: int, running: Sequence[Request] = ()) -> None:
        """A step is being scheduled with `num_running` sequences running (`running`: them, in order)."""

    def propose(self, req: Request, max_tokens: int) -> tuple[int, ...]:
        """Draft tokens to follow `req`'s next token in this step (at most max_tokens >= 1)."""
        return ()

    def plan(self, sampling: Sequence[Request], num_running: int) -> tuple[tuple[str, int], ...]:
        """The step is scheduled: which of `sampling` (requests whose chunk samples their next token
        this step) the runner's proposer drafts for after the step's forward, and at most how many
        drafts each ((request id, k), for SchedulerOutput.draft_plan); `num_running` sequences run."""
        return ()

    def offer(self, drafts: Mapping[str, Sequence[int]], running: Sequence[Request]) -> None:
        """The runner's drafts after the step (ModelRunnerOutput.draft_token_ids), once the step's
        results are recorded: what `propose` may hand out in the next step."""

    def verify(self, req: Request, scheduled: ScheduledRequest, result: ModelRunnerOutput) -> int:
        """The step's KV is stored: the number of its trailing draft tokens whose KV is rolled back
        (0..scheduled.num_draft_tokens)."""
        return 0

    def end_step(self, output: SchedulerOutput) -> None:
        """The step scheduled by the last `begin_step` ran; its results are being recorded."""

    def stats(self) -> SpecDecodingStats | None:
        """What was drafted and accepted since the start (core/stats.py); None: no speculation."""
        return None


# ---- KV tiers -------------------------------------------------------------------------------
class TierPrefetch(Policy):
    """Prefix blocks in the KV tiers below the pool (core/kv_tiers.py): a request whose prefix is
    partly on disk waits at the head of the queue while it is read (off the step), and is looked
    up again next step; the tiers' transfers ride on the step (`SchedulerOutput.kv_ops`)."""

    key = "prefetch"

    def __init__(self) -> None:
        self.loading = False  # the last schedule() left the queue's head waiting for a disk-tier read

    def begin_step(self) -> None:
        self.loading = False

    def must_wait(self, kv: KVCacheManagerProtocol[Any], computed: ComputedHits) -> bool:
        """Ask for `computed`'s disk hits to be read; True: the request waits for them."""
        wait = kv.prefetch_tier_hits(computed)
        self.loading |= wait
        return wait

    def take_ops(self, kv: KVCacheManagerProtocol[Any]) -> tuple[TierOp, ...]:
        return kv.take_tier_ops()

    def apply(self, kv: KVCacheManagerProtocol[Any], result: ModelRunnerOutput) -> None:
        """The tiers' reads finished or failed in the step (result.tier_events)."""
        if result.tier_events is not None:
            kv.apply_tier_events(result.tier_events)


# ---- parallel samples -----------------------------------------------------------------------
class SharedPrompt(Policy):
    """Parallel samples of one prompt (n > 1): a sample names its leader and waits while the
    leader computes the shared prompt, then finds the prompt's blocks in the prefix cache.
    State: the leader's request id (requests without a leader have none)."""

    key = "shared_prompt"

    def __init__(self, requests: Mapping[str, Request]):
        self.requests = requests  # the scheduler's requests by id

    def add(self, req: Request, leader_id: str | None) -> None:
        if leader_id is not None:
            req.policy_state[self.key] = leader_id

    def leader(self, req: Request) -> Request | None:
        rid = req.policy_state.get(self.key)
        return self.requests.get(rid) if rid else None

    def blocks_admission(self, req: Request, num_kv_tokens: Callable[[Request], int]) -> bool:
        """True while `req`'s leader is running and has not computed the shared prompt yet."""
        lead = self.leader(req)
        return (lead is not None and lead.status is Status.RUNNING
                and lead.num_computed_tokens < min(lead.num_prompt_tokens, num_kv_tokens(lead)))


__all__ = ["EvictionPolicy", "KeepAll", "Policy", "SharedPrompt", "SlidingWindowEviction", "SpeculationPolicy",
           "TierPrefetch"]
