"""Readable float64 torch reference of `kvexport::GatedDeltaRule` (semantics: spec.py) — the
executable definition every implementation is tested against — and `make_case`, a random ragged
step shaped like a hybrid's (fresh prompts, prefill chunks resuming from a slot, decodes).

It runs the recurrence token by token (transformers' torch_recurrent_gated_delta_rule); the
chunked (WY / UT) form of prefill equals it in exact arithmetic
(tests/plugins/test_gated_delta_reference.py checks both of transformers' functions against it).
"""

from __future__ import annotations

import torch

from .spec import L2NORM_EPS, GatedDeltaAttrs

__all__ = ["gated_delta", "l2norm", "make_case"]


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x²) + 1e-6) over the last axis (transformers' / FLA's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def gated_delta(query, key, value, g, beta, recurrent_state, state_slots, seq_lens, query_start_loc, *,
                attrs: GatedDeltaAttrs) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [T, Hv, Dv] in the query's dtype, new_recurrent_state [S, Hv, Dk, Dv] float32).
    The pool `recurrent_state` is only read. Shapes: spec.py."""
    hv, dk, dv, grp = attrs.num_v_heads, attrs.k_head_dim, attrs.v_head_dim, attrs.group
    out = torch.zeros(query.shape[0], hv, dv, dtype=torch.float64, device=query.device)
    num_seqs = state_slots.shape[0]
    new = torch.zeros(num_seqs, hv, dk, dv, dtype=torch.float64, device=query.device)
    for s in range(num_seqs):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        ctx = int(seq_lens[s]) - (end - start)
        state = (recurrent_state[int(state_slots[s])].double() if ctx > 0
                 else torch.zeros(hv, dk, dv, dtype=torch.float64, device=query.device))  # [Hv, Dk, Dv]
        q = query[start:end].double().repeat_interleave(grp, dim=1)  # [q_len, Hv, Dk]
        k = key[start:end].double().repeat_interleave(grp, dim=1)
        if attrs.use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        q = q * attrs.scale
        v, gg, bb = value[start:end].double(), g[start:end].double(), beta[start:end].double()
        for i in range(end - start):
            state = state * torch.exp(gg[i])[:, None, None]
            kv_mem = torch.einsum("hkv,hk->hv", state, k[i])  # [Hv, Dv]
            delta = (v[i] - kv_mem) * bb[i][:, None]
            state = state + k[i][:, :, None] * delta[:, None, :]
            out[start + i] = torch.einsum("hkv,hk->hv", state, q[i])
        new[s] = state
    return out.to(query.dtype), new.float()


def make_case(*, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int, q_lens: list[int],
              ctx_lens: list[int], num_slots: int | None = None, act_dtype: str = "float32", seed: int = 0,
              device: str = "cpu") -> tuple[dict, GatedDeltaAttrs]:
    """A random ragged step: sequence s has ctx_lens[s] tokens before this step (0: a fresh
    sequence, its slot's contents ignored) and q_lens[s] new ones; slots are distinct and shuffled
    in a pool of `num_slots` (default: 2 × sequences + 1) random states of magnitude ~1 (what
    hundreds of tokens leave). Inputs are shaped like a trained layer's: q, k, v ~ N(0, 1) (the op
    l2-normalises q and k), g = -exp(A_log) · softplus(a + dt_bias) in about [-3, 0], beta =
    sigmoid(b). Returns (inputs by spec.INPUTS name, attrs)."""
    from ..paged_attention.reference import torch_dtype

    gen = torch.Generator().manual_seed(seed)
    attrs = GatedDeltaAttrs(num_k_heads, num_v_heads, k_head_dim, v_head_dim,
                            float(torch.tensor(k_head_dim ** -0.5, dtype=torch.float32)), 1)
    num_seqs, t = len(q_lens), sum(q_lens)
    num_slots = num_slots or 2 * num_seqs + 1
    act = torch_dtype(act_dtype)
    a_neg = -torch.exp(torch.rand(num_v_heads, generator=gen) * 1.5 - 1.0)  # -exp(A_log)
    dt_bias = torch.randn(num_v_heads, generator=gen) * 0.5
    g = a_neg * torch.nn.functional.softplus(torch.randn(t, num_v_heads, generator=gen) + dt_bias)
    inputs = dict(
        query=torch.randn(t, num_k_heads, k_head_dim, generator=gen).to(act),
        key=torch.randn(t, num_k_heads, k_head_dim, generator=gen).to(act),
        value=torch.randn(t, num_v_heads, v_head_dim, generator=gen).to(act),
        g=g.float(), beta=torch.sigmoid(torch.randn(t, num_v_heads, generator=gen)).float(),
        recurrent_state=torch.randn(attrs.state_shape(num_slots), generator=gen) * 0.5,
        state_slots=torch.randperm(num_slots, generator=gen)[:num_seqs].long(),
        seq_lens=torch.tensor([c + q for c, q in zip(ctx_lens, q_lens)], dtype=torch.int64),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int64))
    if device != "cpu":
        inputs = {k: v.to(device) for k, v in inputs.items()}
    return inputs, attrs
