"""Triton kernel of `kvexport::GatedDeltaRule` (semantics: spec.py, reference.py).

Owns the device code only; configurations live in configs.py, the Python launcher in launch.py,
the TensorRT ahead-of-time registration in trt.py.

    gated_delta_kernel  grid (S, Hv, cdiv(Dv, BLOCK_V)). One program = one sequence × one value head
                        × a tile of BLOCK_V value channels: it holds that slice of the head's state,
                        S [BLOCK_K, BLOCK_V] (BLOCK_K = Dk padded to a power of two), in registers,
                        loaded from the pool at the sequence's slot (zero when the sequence is fresh),
                        and runs the recurrence over the sequence's new tokens in order:

        q, k = l2norm(q) * scale, l2norm(k)        (per token; every program of the head recomputes them)
        S = exp(g) S;  delta = beta (v - Sᵀk);  S = S + k ⊗ delta;  o = Sᵀq      (float32)

                        then writes the new state slice. The value channels are independent in the
                        rule (each column of S only sees its own v, delta and o), so splitting them
                        over programs needs no communication.

One launch for prefill and decode (the AOT kernel). NOTE: prefill runs the recurrence token by
token — its time grows with the longest new-token run of the step; the chunked (WY / UT) form as a
kernel (FLA's chunk_gated_delta_rule) is open (README "Open").
"""

import triton
import triton.language as tl


@triton.jit
def gated_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, seq_lens_ptr, qsl_ptr,
                       out_ptr, new_state_ptr,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, SCALE: tl.constexpr, L2NORM: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    c = h // (HV // HK)  # the q/k head of value head h (repeat_interleave)
    t0 = tl.load(qsl_ptr + s)
    t1 = tl.load(qsl_ptr + s + 1)
    ctx = tl.load(seq_lens_ptr + s) - (t1 - t0)
    ck = tl.arange(0, BLOCK_K)
    cv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = ck < DK
    mv = cv < DV
    m2 = mk[:, None] & mv[None, :]
    slot = tl.load(slots_ptr + s)
    tile = ck[:, None] * DV + cv[None, :]  # [BLOCK_K, BLOCK_V] offsets within one head's state
    state = tl.load(state_ptr + (slot * HV + h) * (DK * DV) + tile, mask=m2 & (ctx > 0), other=0.0).to(tl.float32)
    # NOTE: a `while` loop, not `range(t0, t1)`: the recurrence is sequential anyway (nothing to pipeline),
    # and range() over device scalars fails under TRITON_INTERPRET=1 with numpy >= 2.3 (triton 3.6)
    t = t0
    while t < t1:
        q = tl.load(q_ptr + (t * HK + c) * DK + ck, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + (t * HK + c) * DK + ck, mask=mk, other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * SCALE
        v = tl.load(v_ptr + (t * HV + h) * DV + cv, mask=mv, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + t * HV + h).to(tl.float32))
        beta = tl.load(beta_ptr + t * HV + h).to(tl.float32)
        state = state * decay
        kv = tl.sum(state * k[:, None], axis=0)  # [BLOCK_V]: Sᵀk
        delta = (v - kv) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(state * q[:, None], axis=0)  # [BLOCK_V]: Sᵀq
        tl.store(out_ptr + (t * HV + h) * DV + cv, o.to(out_ptr.dtype.element_ty), mask=mv)
        t += 1
    tl.store(new_state_ptr + (s * HV + h) * (DK * DV) + tile, state, mask=m2)
