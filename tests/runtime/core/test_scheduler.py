"""Properties of the scheduler over the real KV manager under random add / step / abort
traffic (hypothesis). No model is needed: a step "computes" what was scheduled and samples
a deterministic token (or fails one request's part of the step), which is all the
scheduler sees of a model; `update_from_output` applies the stop rules.

After every step: no block is held twice by one request; a block held by several requests
has a ref count equal to its holders and is a shared cached prefix block; the step's
token count respects the budget and max_num_seqs; every running request holds enough slots
for what it computed. At the end: every request finished exactly once and every block
is free or evictable."""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvexport.runtime.core.block_pool import BlockPool
from kvexport.runtime.core.kv_cache_manager import KVCacheManager
from kvexport.runtime.core.outputs import ModelRunnerOutput, SampledToken
from kvexport.runtime.sampling_params import SamplerState, SamplingParams
from kvexport.runtime.core.scheduler import Scheduler, SchedulerConfig, Status

BS = 4

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from([(), (1, 2, 3, 4, 5, 6, 7, 8)]),
              st.lists(st.integers(0, 9), min_size=0, max_size=14), st.integers(1, 6)),
    st.tuples(st.just("step")),
    st.tuples(st.just("fail"), st.integers(0, 30)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(4, 14), budget=st.integers(1, 24), max_seqs=st.integers(1, 5),
       caching=st.booleans(), window=st.sampled_from([None, 6]))
def test_scheduler_invariants(ops, num_blocks, budget, max_seqs, caching, window):
    pool = BlockPool(num_blocks, BS, enable_prefix_caching=caching)
    kv = KVCacheManager(pool)
    sched = Scheduler(SchedulerConfig(max_seqs, budget, 40, window), kv)
    finished = Counter()
    ids = []

    def finish_done():
        for req in sched.running:
            assert len(req.output_token_ids) < req.params.max_tokens and req.num_tokens < sched.max_model_len
        for rid in ids:
            r = sched.requests[rid]
            if r.status is Status.FINISHED and rid not in seen_finished:
                seen_finished.add(rid)
                finished[rid] += 1

    def step(fail: int | None = None):
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        assert len(out.scheduled) <= max_seqs
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            assert len(s.slot_mapping) == len(s.token_ids)
        failed = {out.scheduled[fail % len(out.scheduled)].request_id: "injected"} if fail is not None and out.scheduled else {}
        sampled = {s.request_id: SampledToken((s.start_pos * 7 + 3) % 10, None, None)
                   for s in out.scheduled if s.samples and s.request_id not in failed}
        changed = sched.update_from_output(out, ModelRunnerOutput(sampled, failed))
        for c in changed:
            if c.request_id in failed:
                assert c.finish_reason == "error" and sched.requests[c.request_id].status is Status.FINISHED
        finish_done()
        check()
        return out

    def check():
        holders = Counter()
        for req in sched.running:
            table = [b for b in kv.block_table(req.request_id) if b != 0]
            assert len(table) == len(set(table)), "a request holds a block twice"
            holders.update(table)
            assert kv.num_slots(req.request_id) >= req.num_computed_tokens
        for block, n in holders.items():
            assert pool.ref_count(block) == n
            if n > 1:
                assert pool.block_hash(block) is not None, "shared block is not a cached prefix block"
        for req in sched.waiting:
            assert req.request_id not in kv

    seen_finished = set()
    for op in ops:
        if op[0] == "add":
            _, prefix, rest, max_tokens = op
            rid = f"r{len(ids)}"
            ids.append(rid)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            sched.new_request(rid, list(prefix) + rest, params, SamplerState.create(params))
            finish_done()
        elif op[0] == "step":
            step()
        elif op[0] == "fail":
            step(fail=op[1])
        elif ids:
            sched.abort(ids[op[1] % len(ids)])
            finish_done()
            check()
    for _ in range(400):
        if not sched.has_unfinished():
            break
        step()
    assert not sched.has_unfinished(), "requests starved"
    assert set(finished) == set(ids) and all(v == 1 for v in finished.values())
    assert pool.num_used_blocks == 0
    assert pool.num_free_blocks == num_blocks - 1


def test_a_lone_request_longer_than_the_pool_stops_at_the_pool_size():
    """3 usable blocks = 12 tokens: a 10-token prompt asking for 6 more must end with 12
    tokens ("length"), not preempt itself forever."""
    pool = BlockPool(4, BS)
    kv = KVCacheManager(pool)
    sched = Scheduler(SchedulerConfig(4, 16, 40), kv)
    assert sched.max_model_len == 12
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    req = sched.new_request("a", list(range(10)), params, SamplerState.create(params))
    for _ in range(20):
        out = sched.schedule()
        sampled = {s.request_id: SampledToken(1, None, None) for s in out.scheduled if s.samples}
        sched.update_from_output(out, ModelRunnerOutput(sampled, {}))
        if req.status is Status.FINISHED:
            break
    assert req.finish_reason == "length" and req.num_tokens == 12 and sched.num_preemptions == 0
    assert pool.num_used_blocks == 0
