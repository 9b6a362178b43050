"""Python launcher of the GatedDeltaRule Triton kernel: `gated_delta_triton(...)`, the same call and
semantics as `reference.gated_delta` (spec.py), on CUDA tensors — or on CPU tensors under
TRITON_INTERPRET=1. The tile configs come from configs.py.
"""

from __future__ import annotations

import torch
import triton

from . import configs, kernels
from .spec import GatedDeltaAttrs

_ACT = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _interpreting() -> bool:
    """Whether the kernel was built for the CPU interpreter (TRITON_INTERPRET=1 when kernels.py was
    first imported)."""
    return type(kernels.gated_delta_kernel).__name__ == "InterpretedFunction"


def gated_delta_triton(query, key, value, g, beta, recurrent_state, state_slots, seq_lens, query_start_loc, *,
                       attrs: GatedDeltaAttrs, tile: configs.TileConfig | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [T, Hv, Dv] in the query's dtype, new_recurrent_state [S, Hv, Dk, Dv] float32)."""
    if query.dtype not in _ACT or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"query, key, value must share one of {list(_ACT)}, "
                         f"got {query.dtype}/{key.dtype}/{value.dtype}")
    if g.dtype != torch.float32 or beta.dtype != torch.float32 or recurrent_state.dtype != torch.float32:
        raise ValueError("g, beta and recurrent_state must be float32")
    tile = tile or (configs.INTERPRET_TILE if _interpreting() else configs.TILES[0])
    t, num_seqs = query.shape[0], state_slots.shape[0]
    out = torch.empty(t, attrs.num_v_heads, attrs.v_head_dim, dtype=query.dtype, device=query.device)
    new = torch.empty(attrs.state_shape(num_seqs), dtype=torch.float32, device=query.device)
    if num_seqs == 0:
        return out, new
    const = configs.constexprs(attrs, tile)
    grid = (num_seqs, attrs.num_v_heads, triton.cdiv(attrs.v_head_dim, const["BLOCK_V"]))
    args = [x.contiguous() for x in (query, key, value, g, beta, recurrent_state, state_slots, seq_lens,
                                     query_start_loc)]
    kernels.gated_delta_kernel[grid](*args, out, new, **const, num_warps=tile.num_warps)
    return out, new
