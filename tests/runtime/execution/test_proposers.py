"""Speculation's proposers on the runner's side (runtime/execution/proposers.py, issue 43 §3): the
scheduler plans whom to draft for (SchedulerOutput.draft_plan), sends a sequence's tokens once
(ScheduledRequest.seq_token_ids), and says when it finished (SchedulerOutput.finished); the runner's
Drafter keeps each planned sequence's tokens equal to the scheduler's as steps accept and sample, and
its drafts (ModelRunnerOutput.draft_token_ids) are what the next step carries. No model: the runner
below is a stand-in that samples a fixed token per position and accepts a step's first draft only
(its docstring), so every number here is exact."""

from __future__ import annotations

from kvexport.runtime.core.block_pool import BlockPool
from kvexport.runtime.core.kv_cache_manager import KVCacheManager
from kvexport.runtime.core.outputs import ModelRunnerOutput, SampledToken
from kvexport.runtime.core.scheduler import Scheduler, SchedulerConfig, Status
from kvexport.runtime.core.speculation import SpeculativeDecoding
from kvexport.runtime.execution.proposers import Drafter, NgramProposer
from kvexport.runtime.sampling_params import SamplerState, SamplingParams

BS = 4


class Recording:
    """A proposer that drafts 7, 8, 9, .. and records what it was asked and released."""

    runs_model = False

    def __init__(self):
        self.asked: list[tuple[str, tuple[int, ...], int]] = []
        self.released: list[str] = []

    def propose_many(self, wanted):
        self.asked.extend((rid, tuple(tokens), k) for rid, tokens, k in wanted)
        return {rid: tuple(range(7, 7 + k)) for rid, _, k in wanted}

    def release(self, request_id):
        self.released.append(request_id)


def _add(sched, rid, prompt, **kw):
    p = SamplingParams(ignore_eos=True, temperature=0, **kw)
    return sched.new_request(rid, list(prompt), p, SamplerState.create(p))


def _run_step(sched, drafter):
    """One step through a stand-in runner: samples 100 + the chunk's start position, accepts the first
    draft of a chunk with drafts; then the drafter drafts after it, as ModelRunner.execute does."""
    out = sched.schedule()
    sampled = {s.request_id: SampledToken(100 + s.start_pos, None, None) for s in out.scheduled if s.samples}
    accepted = {s.request_id: (SampledToken(s.token_ids[-s.num_draft_tokens], None, None),)
                for s in out.scheduled if s.samples and s.num_draft_tokens}
    result = ModelRunnerOutput(sampled, {}, accepted=accepted)
    result = ModelRunnerOutput(sampled, {}, accepted=accepted, draft_token_ids=drafter.after_step(out, result))
    sched.update_from_output(out, result)
    return out, result


def test_the_runner_drafts_after_the_step_and_keeps_the_schedulers_tokens():
    spec = SpeculativeDecoding(3, cost_model=False)
    sched = Scheduler(SchedulerConfig(4, 16, 64), KVCacheManager(BlockPool(32, BS)), speculation=spec)
    proposer = Recording()
    drafter = Drafter(proposer)
    req = _add(sched, "a", [1, 2, 3, 4, 5, 6], max_tokens=8)

    out, result = _run_step(sched, drafter)  # the prompt: it samples 100, then the runner drafts 3 for the next step
    s = out.scheduled[0]
    assert out.draft_plan == (("a", 3),) and s.seq_token_ids == (1, 2, 3, 4, 5, 6) and s.num_draft_tokens == 0
    assert proposer.asked == [("a", (1, 2, 3, 4, 5, 6, 100), 3)] and result.draft_token_ids == {"a": (7, 8, 9)}

    out, result = _run_step(sched, drafter)  # the decode carries them; 7 accepted, 8 and 9 rolled back
    s = out.scheduled[0]
    assert (s.token_ids, s.num_draft_tokens, s.seq_token_ids) == ((100, 7, 8, 9), 3, None)  # tokens sent once
    assert req.token_ids[6:] == [100, 7, 106]
    # k stays 3 (not all accepted): the plan asked up to k + 1 = 4 before the verdict, capped by num_tokens 3
    assert out.draft_plan == (("a", 3),) and proposer.asked[-1] == ("a", tuple(req.token_ids), 3)
    assert drafter._tokens["a"] == req.token_ids  # the runner's copy follows the accepted and sampled tokens

    while sched.has_unfinished():
        out, _ = _run_step(sched, drafter)
        assert drafter._tokens.get("a", req.token_ids) == req.token_ids
    assert req.status is Status.FINISHED and req.num_output_tokens == 8
    _run_step(sched, drafter)  # the next step tells the runner the request finished
    assert proposer.released == ["a"] and "a" not in drafter._tokens


def test_plans_stop_at_max_tokens_max_batch_and_for_requests_that_turn_speculation_off():
    spec = SpeculativeDecoding(4, max_batch=2, cost_model=False)
    sched = Scheduler(SchedulerConfig(4, 64, 64), KVCacheManager(BlockPool(64, BS)), speculation=spec)
    _add(sched, "short", [1, 2, 3], max_tokens=2)  # after this step's token, one more: no room for drafts
    _add(sched, "off", [1, 2, 3], max_tokens=8, speculative=False)
    out = sched.schedule()
    assert out.draft_plan == () and all(s.seq_token_ids is None for s in out.scheduled)
    _add(sched, "c", [4, 5], max_tokens=8)
    _add(sched, "d", [6, 7], max_tokens=8)
    sched.update_from_output(out, ModelRunnerOutput({s.request_id: SampledToken(50, None, None)
                                                     for s in out.scheduled}, {}))
    assert sched.schedule().draft_plan == ()  # four running, more than max_batch 2: nobody drafts


def test_ngram_drafts_reach_the_next_step_through_the_runner_output():
    spec = SpeculativeDecoding(2, cost_model=False)
    sched = Scheduler(SchedulerConfig(4, 16, 64), KVCacheManager(BlockPool(32, BS)), speculation=spec)
    drafter = Drafter(NgramProposer())
    _add(sched, "a", [100, 105, 9, 100], max_tokens=4)
    out, result = _run_step(sched, drafter)  # samples 100: tokens 100 105 9 100 100; `100 100` never seen, `100` was
    assert result.draft_token_ids == {"a": (100,)}  # the latest earlier 100 (position 3) was followed by 100
    out, result = _run_step(sched, drafter)  # the decode of 100 at position 4 carries draft 100, accepted; samples 104
    assert (out.scheduled[0].token_ids, out.scheduled[0].num_draft_tokens) == ((100, 100), 1)
    assert sched.requests["a"].token_ids == [100, 105, 9, 100, 100, 100, 104]
    assert drafter._tokens["a"] == sched.requests["a"].token_ids and result.draft_token_ids == {}  # no earlier 104
