"""Verifying drafts (runtime/execution/spec_sampling.py): the tokens a speculative step emits are
distributed exactly as the target's, whatever the drafts. Chi-square tests on fixed logits with
seeded generators (deterministic: the same draws every run), at the 1e-3 level."""

import numpy as np
from scipy.stats import chisquare

from kvexport.runtime.execution.spec_sampling import rejection_sample, verify_drafts
from kvexport.runtime.sampling_params import SamplerState, SamplingParams

V = 12
RNG = np.random.default_rng(3)
ROWS = RNG.normal(0, 1.5, (3, V))  # the target's logits at the next token and after two drafts


def _target(row, temperature=1.0, top_k=0):
    x = row / temperature
    if top_k:
        x = np.where(x >= np.sort(x)[-top_k], x, -np.inf)
    p = np.exp(x - x.max())
    return p / p.sum()


def _draws(params, drafts, n=6000):
    state = SamplerState.create(params)
    return [[t.token_id for t in verify_drafts(ROWS[:len(drafts) + 1], drafts, state, 0, ())] for _ in range(n)]


def _check(counts, p):
    keep = p > 0
    assert counts[~keep].sum() == 0, "a token the target rules out was emitted"
    assert chisquare(counts[keep], p[keep] * counts.sum()).pvalue > 1e-3


def test_emitted_tokens_follow_the_target_distribution_at_every_position():
    p0, p1 = _target(ROWS[0]), _target(ROWS[1])
    drafts = (int(np.argsort(p0)[-3]), int(np.argmax(p1)))  # a likely-but-not-top draft, then the top token
    out = _draws(SamplingParams(temperature=1.0, seed=11), drafts)
    first = np.bincount([o[0] for o in out], minlength=V)
    _check(first, p0)  # the first token is the target's, draft accepted or not
    second = np.bincount([o[1] for o in out if o[0] == drafts[0]], minlength=V)
    _check(second, p1)  # after an accepted draft, the next is the target's at that row
    # accepted with probability p(draft); a rejection ends the step with the target's own token
    assert all(len(o) == 1 for o in out if o[0] != drafts[0])
    assert abs(first[drafts[0]] / len(out) - p0[drafts[0]]) < 0.02


def test_top_k_and_temperature_are_the_targets():
    p0 = _target(ROWS[0], 0.7, top_k=4)
    out = _draws(SamplingParams(temperature=0.7, top_k=4, seed=5), (int(np.argsort(ROWS[0])[-2]),))
    _check(np.bincount([o[0] for o in out], minlength=V), p0)


def test_greedy_takes_the_longest_matching_prefix_and_the_targets_next_token():
    top = [int(np.argmax(r)) for r in ROWS]
    state = SamplerState.create(SamplingParams())
    assert [t.token_id for t in verify_drafts(ROWS, top[:2], state, 0, ())] == top
    wrong = (top[1] + 1) % V
    assert [t.token_id for t in verify_drafts(ROWS, (top[0], wrong), state, 0, ())] == top[:2]
    assert [t.token_id for t in verify_drafts(ROWS, (wrong, top[1]), state, 0, ())] == [top[0]]


def test_min_tokens_counts_the_accepted_drafts():
    rows = np.zeros((3, V))
    rows[0, 4] = rows[1, 2] = rows[2, 2] = 5.0  # token 4, then EOS (2) twice
    state = SamplerState.create(SamplingParams(min_tokens=2))
    # the row after the first draft is output token 2 (num_generated 1 < min_tokens): EOS masked there;
    # the one after the second draft is output token 3: EOS allowed
    toks = [t.token_id for t in verify_drafts(rows[:2], (4,), state, 0, (2,))]
    assert toks[0] == 4 and toks[1] != 2
    toks = [t.token_id for t in verify_drafts(rows, (4, toks[1]), SamplerState.create(SamplingParams(min_tokens=2)),
                                              0, (2,))]
    assert toks[2] == 2


def test_rejection_sampling_with_a_proposal_distribution_gives_the_target():
    rng = np.random.default_rng(9)
    p, q = _target(ROWS[0]), _target(ROWS[2])
    counts = np.zeros(V)
    accepted = 0
    for _ in range(10000):
        d = int(rng.choice(V, p=q))
        tok, ok = rejection_sample(p, q, d, rng)
        counts[tok] += 1
        accepted += ok
    _check(counts, p)
    assert abs(accepted / 10000 - np.minimum(p, q).sum()) < 0.02  # P(accept) = sum(min(p, q))
