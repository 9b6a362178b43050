"""Verifying a draft: the target model's logits rows of a speculative step -> the tokens it emits.

A decoding sequence's speculative step carries its next token and k drafts d_1..d_k
(ScheduledRequest.num_draft_tokens); the step returns the target's logits at each of those
1 + k positions, row i predicting what follows d_i (row 0: what follows the next token).

    row 0 ─ sample ─ t_1 == d_1 ? ─ row 1 ─ sample ─ t_2 == d_2 ? ─ ... ─ row k ─ sample ─ t_{k+1}
                        │ no                            │ no
                        └─ emit t_1, stop               └─ emit t_1, t_2, stop

Every proposer here drafts deterministically (n-gram lookup; a draft model's argmax), so the
proposal q is a point mass on d_i, and Leviathan et al. 2023 / Chen et al. 2023's rejection
sampling reduces to this: accept d_i with probability min(1, p(d_i) / q(d_i)) = p(d_i); on
rejection draw from the residual max(0, p - q) normalized = p with d_i removed, renormalized.
Drawing t ~ p and accepting iff t == d_i does exactly that (P(t = d_i) = p(d_i), and given
t != d_i, t is distributed as p restricted to the other tokens). Greedy is the same rule with
the argmax: the longest matching prefix plus the target's next token.

NOTE: each t_i is drawn by the one sampler (sampling.py `sample`) with the request's own state,
after the tokens before it: penalties count the accepted drafts, min_tokens counts them, a
seeded request draws one number per emitted token as without speculation (so with the same
logits it emits the same tokens), logprobs are the target's at each emitted token.
`rejection_sample` is the general rule for a proposer whose q is a distribution (not used by
the proposers here; kept with its test as the reference for one that samples its drafts).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core.outputs import SampledToken
from ..sampling_params import SamplerState
from .sampling import mask_grammars, sample


def verify_drafts(rows: np.ndarray, drafts: Sequence[int], state: SamplerState, num_generated: int,
                  eos_ids: tuple[int, ...]) -> list[SampledToken]:
    """The tokens a speculative step emits, in order: the accepted drafts, then the target's own
    token (1..len(drafts) + 1 of them). rows [1 + k, vocab]: the target's logits at the step's
    next token and each draft; num_generated: the sequence's output tokens before the step."""
    assert len(rows) == len(drafts) + 1, "one logits row per draft, plus the next token's"
    out: list[SampledToken] = []
    for i in range(len(rows)):
        if getattr(state, "grammar", None) is not None:  # structured output: the mask after the tokens before it
            if mask_grammars(rows, [i], [state]):  # NOTE: a dead end fails this request alone (model_runner)
                raise ValueError("structured output: the grammar allows no token at this point of the output (no "
                                 "token of this model continues it); fix the grammar")
        tok, lp, top = sample(rows[i], state, state.prompt_tokens, num_generated + i, eos_ids)
        out.append(SampledToken(tok, lp, tuple(top) if top is not None else None))
        if i == len(drafts) or tok != drafts[i]:
            break
    return out


def rejection_sample(p: np.ndarray, q: np.ndarray, draft: int, rng: np.random.Generator) -> tuple[int, bool]:
    """One position of Leviathan/Chen rejection sampling: p, q [vocab] the target's and the
    proposer's distributions, `draft` drawn from q. Returns (token, accepted): the draft with
    probability min(1, p/q), else a token from max(0, p - q) normalized. The token is then
    distributed exactly as p."""
    if rng.random() * q[draft] <= p[draft]:
        return draft, True
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if not total > 0.0:  # p == q up to rounding: any draw from p is exact
        residual, total = p, p.sum()
    cdf = np.cumsum(residual / total)
    return int(min(np.searchsorted(cdf, rng.random(), side="right"), len(p) - 1)), False


__all__ = ["rejection_sample", "verify_drafts"]
