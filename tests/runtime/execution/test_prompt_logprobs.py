"""Prompt log-probabilities (SamplingParams.prompt_logprobs) in the runtime.

The scheduler, with no model: chunks list the prompt tokens their rows predict; across
chunked prefill and preemption by recompute every position is asked for exactly once; a
scoring request skips the prefix-cache lookup (cached blocks have no logits), a parallel
sample copies its leader's scores and then uses the cache; max_tokens 0 computes the prompt
and finishes without sampling.

The runner and engine, on real tiny `--all-logits` builds (both attentions): the scores
equal transformers' log_softmax, in steps mixing decodes and chunks of other requests, and
sampling is unchanged by the every-token logits the scoring steps return. A build made before
logits_indices without all logits refuses the request, naming what to do."""

import numpy as np
import pytest
import torch

from kvexport import io
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.core.block_pool import BlockPool
from kvexport.runtime.core.kv_cache_manager import KVCacheManager
from kvexport.runtime.core.outputs import ModelRunnerOutput, PromptLogprobs, SampledToken
from kvexport.runtime.core.scheduler import Scheduler, SchedulerConfig, Status
from kvexport.runtime.execution.prompt_logprobs import score
from kvexport.runtime.sampling_params import SamplerState, SamplingParams

BS = 4


# ---- the scheduler, no model ----------------------------------------------------------------
class Steps:
    """Drives a scheduler: each step "computes" what was scheduled, scores prompt targets with
    logprob -position and samples token 7; records every position it was asked to score."""

    def __init__(self, sched: Scheduler):
        self.sched, self.asked, self.sampled_chunks, self.outs = sched, [], [], {}

    def step(self):
        out = self.sched.schedule()
        scored = {}
        for s in out.scheduled:
            if s.prompt_targets:
                pos = range(s.prompt_target_start, s.prompt_target_start + len(s.prompt_targets))
                assert s.prompt_target_start > s.start_pos and pos[-1] <= s.start_pos + len(s.token_ids)
                self.asked += [(s.request_id, p) for p in pos]
                scored[s.request_id] = PromptLogprobs(pos[0], s.prompt_targets, tuple(-float(p) for p in pos),
                                                      (1,) * len(pos), None)
        sampled = {s.request_id: SampledToken(7, None, None) for s in out.scheduled if s.samples}
        self.sampled_chunks += [s.request_id for s in out.scheduled if s.samples]
        for o in self.sched.update_from_output(out, ModelRunnerOutput(sampled, {}, scored)):
            if o.prompt_logprobs is not None:
                assert o.request_id not in self.outs, "the scores come once"
                self.outs[o.request_id] = o
        return out

    def run(self, limit=200):
        for _ in range(limit):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")


def add(sched, rid, prompt, **kw):
    params = SamplingParams(**kw)
    return sched.new_request(rid, list(prompt), params, SamplerState.create(params))


def test_chunked_prefill_and_preemption_score_every_position_once():
    # 6 usable blocks of 4 tokens; "a" decodes and grows until the newest, "b", is preempted mid-prompt
    sched = Scheduler(SchedulerConfig(4, 4, 64), KVCacheManager(BlockPool(7, BS, enable_prefix_caching=True)))
    add(sched, "a", range(10, 18), max_tokens=12, ignore_eos=True)
    steps = Steps(sched)
    steps.step()
    steps.step()
    b = add(sched, "b", range(20, 34), max_tokens=2, prompt_logprobs=0)
    preempted_while_scoring = False
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = steps.step()
        scored_to = sched.prompt_logprobs.next_position(b)
        preempted_while_scoring |= "b" in out.preempted and 1 < scored_to < b.num_prompt_tokens
    assert preempted_while_scoring and b.num_preemptions >= 1
    asked = [p for r, p in steps.asked if r == "b"]
    assert asked == list(range(1, 14)), asked  # once each, in order, though the prompt was computed twice
    got = steps.outs["b"].prompt_logprobs
    assert (got.start, got.token_ids, got.logprobs) == (1, tuple(range(21, 34)), tuple(-float(p) for p in range(1, 14)))
    assert "a" not in steps.outs and b.finish_reason == "length" and len(b.output_token_ids) == 2


def test_a_scoring_request_skips_the_prefix_cache_and_others_still_use_it():
    sched = Scheduler(SchedulerConfig(4, 64, 64), KVCacheManager(BlockPool(32, BS, enable_prefix_caching=True)))
    prompt = list(range(30, 43))  # 13 tokens: 3 full blocks
    steps = Steps(sched)
    add(sched, "warm", prompt, max_tokens=1)
    steps.run()
    scoring = add(sched, "scoring", prompt, max_tokens=1, prompt_logprobs=2)
    out = steps.step()
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [("scoring", 0, 13)]
    assert scoring.num_cached_prompt_tokens == 0
    assert steps.outs["scoring"].prompt_logprobs.token_ids == tuple(prompt[1:])
    plain = add(sched, "plain", prompt, max_tokens=1)
    steps.run()
    assert plain.num_cached_prompt_tokens == 12


def test_a_parallel_sample_copies_its_leaders_scores_then_uses_the_cache():
    sched = Scheduler(SchedulerConfig(4, 64, 64), KVCacheManager(BlockPool(32, BS, enable_prefix_caching=True)))
    prompt = list(range(50, 60))
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, n=2)
    lead = sched.new_request("s0", prompt, params, SamplerState.create(params))
    follow = sched.new_request("s1", prompt, params, SamplerState.create(params, 1), share_prompt_with="s0")
    steps = Steps(sched)
    steps.run()
    assert [r for r, _ in steps.asked] == ["s0"] * 9  # scored once, by the leader
    assert follow.num_cached_prompt_tokens == 8 and lead.num_cached_prompt_tokens == 0
    assert steps.outs["s1"].prompt_logprobs == steps.outs["s0"].prompt_logprobs


def test_max_tokens_0_computes_the_prompt_and_finishes_without_sampling():
    sched = Scheduler(SchedulerConfig(4, 5, 64), KVCacheManager(BlockPool(32, BS, enable_prefix_caching=True)))
    req = add(sched, "p", range(60, 72), max_tokens=0, prompt_logprobs=0)
    one = add(sched, "one", [5], max_tokens=0, prompt_logprobs=3)
    steps = Steps(sched)
    steps.run()
    assert steps.sampled_chunks == [] and req.status is Status.FINISHED and req.finish_reason == "length"
    assert req.output_token_ids == [] and steps.outs["p"].new_token_ids == ()
    assert steps.outs["p"].prompt_logprobs.token_ids == tuple(range(61, 72))
    assert len(steps.outs["one"].prompt_logprobs) == 0 and one.finish_reason == "length"


def test_score_ranks_and_top_k():
    rows = np.log(np.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]], np.float32))
    p = score(rows, (2, 1), 1, 2)
    np.testing.assert_allclose(p.logprobs, np.log([0.3, 0.2]), rtol=1e-6)
    assert p.ranks == (2, 3) and [[t for t, _ in top] for top in p.top] == [[1, 2], [0, 2]]
    assert score(rows, (1, 0), 3, 0).top is None and score(rows, (1, 0), 3, 0).ranks == (1, 1)


# ---- the runner and engine on real builds ----------------------------------------------------
@pytest.fixture(scope="module", params=[io.Attention.ONNX, io.Attention.PLUGIN], ids=["onnx", "plugin"])
def scoring_build(request, hf_folder, tmp_path_factory):
    if request.param is io.Attention.PLUGIN:
        request.getfixturevalue("cpu_op")
    folder = hf_folder("llama")
    out, _ = build(str(folder), tmp_path_factory.mktemp(f"plp-{request.param.value}") / "b",
                   BuildOptions(block_size=BS, max_seq_len=96, validate=False, all_logits=True,
                                attention=request.param))
    return folder, out


def _reference(folder, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


def test_scores_equal_transformers_in_mixed_chunked_steps(scoring_build):
    from kvexport import LLM

    folder, out = scoring_build
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 128, n)] for n in (37, 5, 22, 11)]
    llm = LLM(out, kv_cache_memory="4MiB", max_num_batched_tokens=12, threads=1)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    plain = llm.generate(prompts, greedy)
    scored = llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2))
    mixed = llm.generate(prompts, greedy)  # warm cache; next: scoring requests beside decoding ones
    engine = llm.engine
    rids = [engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1 if i % 2 else None))
            for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    both = [engine.pop_output(r) for r in rids]
    for i, o in enumerate(scored + [both[1], both[3]]):
        ids = prompts[[0, 1, 1, 3][i]]
        assert o.prompt_logprobs.token_ids == tuple(ids[1:])
        diff = np.abs(np.array(o.prompt_logprobs.logprobs) - _reference(folder, ids)).max()
        assert diff <= 1e-4, diff
    # the every-token logits of scoring steps leave sampling as it was
    assert [o.token_ids for o in plain] == [o.token_ids for o in mixed] == [o.token_ids for o in both]
    assert [o.token_ids for o in scored] == [o.token_ids for o in plain[:2]]
    assert both[0].prompt_logprobs is None and both[1].num_cached_prompt_tokens == 0
    assert all(len(top) == 2 and top[0][1] >= top[1][1] for top in scored[0].prompt_logprobs.top)


def test_a_build_made_before_logits_indices_refuses_prompt_logprobs(hf_folder, tmp_path):
    """A build without --all-logits made before io.LOGITS_INDICES (its prefill returns last rows only);
    builds made now score prompts without --all-logits (tests/runtime/test_speculative.py)."""
    from kvexport import LLM
    from kvexport.runtime.serving.requests import RequestError
    from testkit.legacy_builds import build_without_logits_indices

    old, _ = build_without_logits_indices(str(hf_folder("llama")), tmp_path / "old",
                                          BuildOptions(block_size=BS, max_seq_len=96, validate=False,
                                                       attention=io.Attention.ONNX))
    llm = LLM(old, kv_cache_memory="4MiB")
    with pytest.raises(RequestError, match="kvexport build MODEL --force") as e:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert e.value.param == "prompt_logprobs"
    (o,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=0))  # the prompt only: any build
    assert o.finish_reason == "length" and o.token_ids == []
