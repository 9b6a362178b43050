"""The sampler's filters and penalties on hand-made logits, parameter validation, and
per-request seeding."""

import numpy as np
import pytest

from kvexport.runtime.sampling_params import SamplerState, SamplingError, SamplingParams
from kvexport.runtime.execution.sampling import sample

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05]))


def draws(params, n=400, logits=LOGITS, generated=5):
    state = SamplerState.create(params)
    out = []
    for _ in range(n):
        tok, _, _ = sample(logits, state, set(), generated, (3,))
        out.append(tok)
        state.counts.clear()
    return np.bincount(out, minlength=len(logits))


def test_greedy_takes_the_argmax():
    assert draws(SamplingParams(), n=5).tolist() == [5, 0, 0, 0]


def test_top_k_top_p_min_p_drop_the_tail():
    assert draws(SamplingParams(temperature=1.0, top_k=2, seed=0))[2:].sum() == 0
    # top_p 0.7: {0.5, 0.3} reach it; 0.15 and 0.05 never drawn
    assert draws(SamplingParams(temperature=1.0, top_p=0.7, seed=0))[2:].sum() == 0
    # min_p 0.2: tokens below 0.2 * 0.5 = 0.1 are dropped -> token 3
    counts = draws(SamplingParams(temperature=1.0, min_p=0.2, seed=0))
    assert counts[3] == 0 and counts[2] > 0


def test_temperature_sampling_follows_the_distribution():
    counts = draws(SamplingParams(temperature=1.0, seed=1), n=4000)
    assert np.allclose(counts / 4000, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_penalties():
    logits = np.array([2.0, 1.9, -1.0, 0.0])
    state = SamplerState.create(SamplingParams(repetition_penalty=2.0))
    assert sample(logits, state, {0}, 1, ())[0] == 1  # 2.0 / 2 < 1.9
    state = SamplerState.create(SamplingParams(frequency_penalty=1.0))
    state.counts[0] = 1
    assert sample(logits, state, set(), 1, ())[0] == 1
    state = SamplerState.create(SamplingParams(presence_penalty=0.5))
    state.counts[0] = 3
    assert sample(logits, state, set(), 3, ())[0] == 1


def test_min_tokens_suppresses_eos_and_stop_tokens():
    logits = np.array([0.0, 0.0, 5.0, 4.0])
    state = SamplerState.create(SamplingParams(min_tokens=2, stop_token_ids=(3,)))
    assert sample(logits, state, set(), 0, (2,))[0] == 0
    assert sample(logits, state, set(), 2, (2,))[0] == 2


def test_logprobs():
    state = SamplerState.create(SamplingParams(logprobs=2))
    tok, lp, top = sample(LOGITS, state, set(), 0, ())
    assert tok == 0 and lp == pytest.approx(np.log(0.5))
    assert [t for t, _ in top] == [0, 1] and top[1][1] == pytest.approx(np.log(0.3))


def test_same_seed_same_tokens_regardless_of_other_draws():
    a = draws(SamplingParams(temperature=1.0, seed=42), n=50)
    b = draws(SamplingParams(temperature=1.0, seed=42), n=50)
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("kw,word", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(max_tokens=-1), "max_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(n=0), "n must"), (dict(logprobs=99), "logprobs"), (dict(prompt_logprobs=21), "prompt_logprobs"), (dict(seed=-1), "seed"), (dict(stop=("",)), "stop"),
])
def test_invalid_parameters_fail_before_any_work(kw, word):
    with pytest.raises(SamplingError, match=word):
        SamplingParams(**kw)


def test_bad_traces_and_duplicate_ids_raise_clear_errors(tmp_path):
    from kvexport.errors import ConfigError, KvExportError
    from kvexport.runtime.serving.bench import load_trace
    from kvexport.runtime.core.block_pool import BlockPool
    from kvexport.runtime.core.kv_cache_manager import KVCacheManager
    from kvexport.runtime.core.scheduler import Scheduler, SchedulerConfig

    with pytest.raises(ConfigError, match="shipped trace"):
        load_trace("no-such-trace")
    bad = tmp_path / "t.json"
    bad.write_text('{"seed": 1, "requests": [{"prompt_len": 3}]}')
    with pytest.raises(ConfigError, match="malformed"):
        load_trace(str(bad))
    assert len(load_trace("mixed-64")[1]) == 64
    sched = Scheduler(SchedulerConfig(), KVCacheManager(BlockPool(8, 4)))
    p = SamplingParams()
    sched.new_request("a", [1, 2], p, SamplerState.create(p))
    with pytest.raises(KvExportError, match="already in use"):
        sched.new_request("a", [1, 2], p, SamplerState.create(p))


@pytest.mark.parametrize("temperature", [5e-324, 1e-308, 1e-30, 1e-6])
def test_a_near_zero_temperature_samples_greedily(temperature):
    """Issue 31 §4: temperatures between 0 and vLLM's 1e-5 behave as greedy. Before, logits
    divided by them overflowed to +inf, were clamped to one value, and every positive logit drew
    alike (uniformly random tokens with status 200)."""
    logits = np.array([3.0, 9.5, 7.0, 9.0, -2.0, 8.0])
    assert SamplingParams(temperature=temperature, seed=3).greedy
    assert draws(SamplingParams(temperature=temperature, seed=3), n=200, logits=logits).tolist() == [0, 200, 0, 0, 0, 0]


def test_a_small_temperature_above_the_greedy_rule_still_samples_without_overflow():
    """Just above 1e-5 the sampler still samples; logits are shifted to a maximum of 0 before the
    division, so huge logits do not overflow: the near-tie at the top splits, the rest never draws."""
    t = 2e-5
    assert not SamplingParams(temperature=t).greedy
    logits = np.array([1e305, 1e305 - 1e300, -5.0, 1e304])  # x / t overflows; the gap / t (5e304) does not
    counts = draws(SamplingParams(temperature=t, seed=0), n=100, logits=logits)
    assert counts.tolist() == [100, 0, 0, 0]
    tie = np.array([4.0, 4.0, 4.0 - 1e-3, 0.0])  # 1e-3 / 2e-5 = 50 nats: token 2 never
    counts = draws(SamplingParams(temperature=t, seed=0), n=400, logits=tie)
    assert counts[2] == counts[3] == 0 and 120 < counts[0] < 280


def test_greedy_rows_at_once_give_what_sample_gives_row_by_row():
    """sample_greedy (one argmax over a step's plain-greedy rows, issue 47) == sample() per row: ties to the first,
    +inf, rows given out of order; a NaN row and a row with nothing finite are left to sample() (None), which
    takes NaN as -inf or fails the request; each state draws one number and counts its token, as sample() does."""
    from kvexport.runtime.execution.sampling import NonFiniteLogitsError, plain_greedy, sample_greedy

    rng = np.random.default_rng(3)
    logits = rng.standard_normal((7, 300)).astype(np.float32)
    logits[1, [5, 9]] = 10.0  # a tie: the first
    logits[2, [7, 8]] = np.inf
    logits[3, 4] = np.nan
    logits[3, 11] = 50.0
    logits[4] = -np.inf
    rows = [6, 0, 1, 2, 3, 4]
    make = lambda: [SamplerState.create(SamplingParams(max_tokens=8, seed=1)) for _ in rows]  # noqa: E731
    batched, single = make(), make()
    got = sample_greedy(logits, rows, batched)
    assert got[:4] == [sample(logits[r], st, set(), 0, (2,))[0] for r, st in zip(rows[:4], single[:4])]
    assert got[2] == 5 and got[3] == 7 and got[4] is None and got[5] is None
    assert sample(logits[3], single[4], set(), 0, (2,))[0] == 11  # NaN counts as -inf there
    with pytest.raises(NonFiniteLogitsError):
        sample(logits[4], single[5], set(), 0, (2,))
    for a, b in zip(batched[:4], single[:4]):
        assert a.counts == b.counts and a.rng.random() == b.rng.random()
    assert sample_greedy(logits, [0, 1, 2], make()[:3]) == [int(np.argmax(logits[r])) for r in (0, 1)] + [7]  # a view
    assert plain_greedy(make()[0], 0)
    assert not plain_greedy(SamplerState.create(SamplingParams(max_tokens=8, logprobs=0)), 0)
    assert not plain_greedy(SamplerState.create(SamplingParams(max_tokens=8, min_tokens=3)), 2)
    assert not plain_greedy(SamplerState.create(SamplingParams(max_tokens=8, frequency_penalty=0.5)), 0)
    assert not plain_greedy(SamplerState.create(SamplingParams(max_tokens=8, temperature=0.7)), 0)
