"""The scheduler's policy interface (runtime/core/policies.py), with no model: `Request` carries
no feature fields, only the per-policy state slot; the eviction policy the config asks for;
a speculation policy's drafts join a decoding step (slots, budget) and the rejected ones roll
back before anything is published; an eviction policy's `after_step` runs after every step that
leaves a sequence running (every prompt chunk included) and may free its blocks, and its `view`
is the table the runner gets; the tier prefetch's waiting flag. The policies under test plug in
through the constructor, with no change to the loop."""

from dataclasses import fields

from kvexport import io
from kvexport.runtime.core.block_pool import BlockPool
from kvexport.runtime.core.kv_cache_manager import KVCacheManager
from kvexport.runtime.core.outputs import ModelRunnerOutput, PromptLogprobs, SampledToken
from kvexport.runtime.core.policies import (EvictionPolicy, KeepAll, SlidingWindowEviction, SpeculationPolicy,
                                            TierPrefetch)
from kvexport.runtime.core.request import Request
from kvexport.runtime.core.scheduler import Scheduler, SchedulerConfig, Status, eviction_policy
from kvexport.runtime.core.streaming import StreamingEviction, compact, streaming_window
from kvexport.runtime.sampling_params import SamplerState, SamplingParams

BS = 4
PAD = io.PAD_BLOCK_ID


def _add(sched, rid, prompt, leader=None, **kw):
    p = SamplingParams(ignore_eos=True, **kw)
    return sched.new_request(rid, list(prompt), p, SamplerState.create(p), share_prompt_with=leader)


def _step(sched):
    """Samples token 100 + the chunk's start position; scores prompt targets with logprob -1."""
    out = sched.schedule()
    sampled = {s.request_id: SampledToken(100 + s.start_pos, None, None) for s in out.scheduled if s.samples}
    scores = {s.request_id: PromptLogprobs(s.prompt_target_start, s.prompt_targets, (-1.0,) * len(s.prompt_targets),
                                           (1,) * len(s.prompt_targets), None)
              for s in out.scheduled if s.prompt_targets}
    # a chunk with drafts: the runner accepted its first draft (ModelRunnerOutput.accepted)
    accepted = {s.request_id: (SampledToken(s.token_ids[-s.num_draft_tokens], None, None),)
                for s in out.scheduled if s.samples and s.num_draft_tokens}
    sched.update_from_output(out, ModelRunnerOutput(sampled, {}, scores, accepted=accepted))
    return out


def test_request_has_core_fields_and_one_state_slot():
    assert [f.name for f in fields(Request)] == [
        "request_id", "token_ids", "num_prompt_tokens", "params", "sampler", "arrival", "num_computed_tokens",
        "status", "finish_reason", "error", "num_preemptions", "num_cached_prompt_tokens", "salt", "lora_slot",
        "policy_state"]  # lora_slot: which adapter's weights the request's tokens run with (vLLM: lora_request)
    pool = BlockPool(32, BS, enable_prefix_caching=True)
    w = streaming_window(sink_tokens=4, recent_tokens=8, block_size=BS, max_model_len=32, pool_tokens=31 * BS,
                         max_num_batched_tokens=64)
    sched = Scheduler(SchedulerConfig(4, 64, 32, streaming=w), KVCacheManager(pool))
    lead = _add(sched, "a", range(1, 11), max_tokens=30, prompt_logprobs=0)
    follow = _add(sched, "b", range(1, 11), leader="a", max_tokens=30, prompt_logprobs=0)
    plain = _add(sched, "c", range(1, 11), max_tokens=2)
    assert set(follow.policy_state) == {"prompt_logprobs", "shared_prompt"} and plain.policy_state == {}
    while sched.eviction.state(lead).num_shifts == 0:
        _step(sched)
    assert set(lead.policy_state) == {"prompt_logprobs", "eviction"}
    assert sched.prompt_logprobs.next_position(lead) == 10 and not sched.prompt_logprobs.scoring(lead)


def test_the_config_picks_the_eviction_policy():
    assert type(eviction_policy(SchedulerConfig())) is KeepAll
    window = eviction_policy(SchedulerConfig(sliding_window=6))
    assert isinstance(window, SlidingWindowEviction) and window.window == 6
    w = streaming_window(sink_tokens=4, recent_tokens=8, block_size=BS, max_model_len=32, pool_tokens=64,
                         max_num_batched_tokens=16)
    streaming = eviction_policy(SchedulerConfig(sliding_window=6, streaming=w))  # streaming wins
    assert isinstance(streaming, StreamingEviction) and streaming.outlives_context and streaming.window is w


class Drafts(SpeculationPolicy):
    """Proposes 90, 91, 92 after every decode; `_step`'s runner accepts the first draft only."""

    def __init__(self):
        self.asked = []

    def propose(self, req, max_tokens):
        self.asked.append((req.request_id, req.num_computed_tokens, max_tokens))
        return (90, 91, 92)

    def verify(self, req, scheduled, result):
        if not scheduled.num_draft_tokens:
            return 0
        assert len(result.accepted[req.request_id]) == 1
        return scheduled.num_draft_tokens - 1


def test_speculation_drafts_join_a_decode_step_and_rejected_ones_roll_back():
    pool = BlockPool(16, BS, enable_prefix_caching=True)
    kv = KVCacheManager(pool)
    spec = Drafts()
    sched = Scheduler(SchedulerConfig(4, 8, 64), kv, speculation=spec)
    req = _add(sched, "a", range(1, 7), max_tokens=5)
    out = _step(sched)  # the prompt: no drafts
    assert out.scheduled[0].num_draft_tokens == 0 and spec.asked == [] and req.token_ids[6:] == [100]
    out = _step(sched)
    s = out.scheduled[0]
    # the decode carries its 3 drafts: 4 tokens, 4 slots, 4 of the budget
    assert (s.start_pos, s.token_ids, s.num_draft_tokens, out.num_batched_tokens) == (6, (100, 90, 91, 92), 3, 4)
    # at most max_tokens 5 - 1 output - 1 (the step's own token) = 3 drafts
    assert len(s.slot_mapping) == 4 and spec.asked == [("a", 6, 3)]
    # 90 accepted, 91 and 92 rolled back: KV of positions 6 (100) and 7 (90) stays; then the sampled token
    assert req.num_computed_tokens == 8 and req.token_ids[6:] == [100, 90, 106]
    # only KV of accepted tokens is published: the two full blocks, with the accepted draft
    assert kv.get_computed_blocks(req.token_ids[:8] + [0]).num_computed_tokens == 8
    out = _step(sched)  # the next decode starts where the rollback left it, over the drafts' slots
    assert (out.scheduled[0].start_pos, out.scheduled[0].token_ids[0]) == (8, 106)
    while sched.has_unfinished():
        _step(sched)
    assert req.status is Status.FINISHED and req.num_output_tokens == 5 and pool.num_used_blocks == 0


def test_drafts_fit_the_budget():
    spec = Drafts()
    sched = Scheduler(SchedulerConfig(4, 2, 64), KVCacheManager(BlockPool(16, BS)), speculation=spec)
    _add(sched, "a", [1, 2], max_tokens=3)
    _step(sched)
    out = _step(sched)
    assert out.scheduled[0].token_ids == (100, 90) and spec.asked == [("a", 2, 1)] and out.num_batched_tokens == 2


class SinkAndTail(EvictionPolicy):
    """Once a sequence's prompt is computed, keeps its first block and the blocks its next 2 tokens
    read; records every call of after_step."""

    def __init__(self):
        self.calls = []

    def after_step(self, req, kv, result):
        self.calls.append((req.request_id, req.num_computed_tokens))
        if req.num_computed_tokens >= req.num_prompt_tokens:
            kv.free_outside_window(req.request_id, req.num_computed_tokens, 2, keep_first=1)

    def view(self, req, table):
        return compact(table, BS)


def test_an_eviction_policy_frees_blocks_after_each_step():
    pool = BlockPool(16, BS)
    kv = KVCacheManager(pool)
    policy = SinkAndTail()
    sched = Scheduler(SchedulerConfig(4, 4, 64), kv, eviction=policy)
    req = _add(sched, "a", range(1, 11), max_tokens=3)
    for _ in range(3):  # the prompt in chunks of 4, 4, 2 (the last one samples)
        _step(sched)
    assert policy.calls == [("a", 4), ("a", 8), ("a", 10)]  # every chunk, the one completing the prompt too
    # after position 9 the next token (10) reads positions >= 9: block 1 (positions 4..7) is released
    assert kv.block_table("a")[1] == PAD and pool.num_used_blocks == 2
    out = _step(sched)
    assert out.scheduled[0].block_table == (kv.block_table("a")[0], kv.block_table("a")[2])
    assert out.scheduled[0].kv_gap == BS
    _step(sched)  # the last token finishes the request: no after_step
    assert policy.calls[3:] == [("a", 11)] and req.finish_reason == "length" and pool.num_used_blocks == 0


class _Tiers:
    """A KV manager's tier calls: the head of the queue has blocks on disk until `ready`."""

    def __init__(self):
        self.ready, self.events = False, []

    def prefetch_tier_hits(self, computed):
        return not self.ready

    def take_tier_ops(self):
        return ("op",)

    def apply_tier_events(self, events):
        self.events.append(events)


def test_tier_prefetch_waits_for_disk_reads():
    kv, prefetch = _Tiers(), TierPrefetch()
    prefetch.begin_step()
    assert prefetch.must_wait(kv, None) and prefetch.loading
    prefetch.begin_step()
    kv.ready = True
    assert not prefetch.must_wait(kv, None) and not prefetch.loading and prefetch.take_ops(kv) == ("op",)
    prefetch.apply(kv, ModelRunnerOutput({}, {}))  # no tiers in the step: nothing to apply
    prefetch.apply(kv, ModelRunnerOutput({}, {}, tier_events="events"))
    assert kv.events == ["events"]
