"""Python launcher of the Triton kernels: `paged_attention_triton(...)`, the same call and
semantics as `reference.paged_attention` (spec.py), on CUDA tensors — or on CPU tensors
under TRITON_INTERPRET=1. Picks decode vs prefill (every q_len <= 1 -> decode) and the
split-K partitioning; the tile configs come from configs.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import configs, kernels
from .spec import PagedAttentionAttrs

_ACT = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_KV = {**_ACT, torch.int8: "int8", torch.uint8: "int4"}  # int4: uint8 rows (kvexport/io.py KV_INT4_FORMAT)
MIN_PARTITION = 256  # fewest context tokens per decode split worth a partial


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """What the launcher decided for one call (returned by `plan()`, used by the GPU check)."""

    kind: str  # "prefill" | "decode"
    tile: configs.TileConfig
    num_splits: int  # decode only: context partitions (1 = no split-K)
    partition: int  # decode only: context tokens per partition


def _interpreting() -> bool:
    """Whether the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 when
    kernels.py was first imported: triton.jit decides then)."""
    return type(kernels.prefill_kernel).__name__ == "InterpretedFunction"


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def plan(attrs: PagedAttentionAttrs, num_seqs: int, max_q_len: int, max_seq_len: int, device: torch.device,
         *, num_splits: int | None = None, tile: configs.TileConfig | None = None) -> LaunchPlan:
    """Decode when every sequence has at most one new token. Split-K when the sequences × KV
    heads alone give too few programs to fill the GPU (about 4 programs per SM) and the
    context is long enough that each split still reads >= MIN_PARTITION tokens."""
    if max_q_len > 1:
        return LaunchPlan("prefill", tile or configs.PREFILL_TILES[0], 1, 0)
    tile = tile or configs.DECODE_TILES[0]
    if num_splits is None:
        want = -(-4 * _sm_count(device) // max(1, num_seqs * attrs.num_kv_heads))
        num_splits = min(want, -(-max_seq_len // MIN_PARTITION), configs.MAX_SPLITS)
    num_splits = max(1, min(num_splits, configs.MAX_SPLITS, -(-max_seq_len // tile.block_n)))
    partition = -(-max(1, max_seq_len) // num_splits)
    partition = -(-partition // tile.block_n) * tile.block_n  # a multiple of BLOCK_N
    num_splits = -(-max(1, max_seq_len) // partition)
    return LaunchPlan("decode", tile, num_splits, partition)


def _check(query, key, value, key_cache, value_cache, k_scale, v_scale, attrs: PagedAttentionAttrs) -> None:
    if query.dtype not in _ACT or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"query/key/value must share one of {list(_ACT.values())}, got "
                         f"{query.dtype}/{key.dtype}/{value.dtype}")
    if _KV.get(key_cache.dtype) != attrs.kv_dtype or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"pools must be {attrs.kv_dtype} (attrs.kv_dtype), got {key_cache.dtype}/{value_cache.dtype}")
    if attrs.quantized and (k_scale is None or v_scale is None):
        raise ValueError("int8 KV needs k_scale and v_scale")
    if attrs.quantized:
        shapes = {(attrs.num_kv_heads, attrs.head_dim), (attrs.num_kv_heads,)}
        if tuple(k_scale.shape) not in shapes or v_scale.shape != k_scale.shape:
            raise ValueError(f"k_scale/v_scale must both be [num_kv_heads, head_dim] (or per head [num_kv_heads]), "
                             f"got {tuple(k_scale.shape)}/{tuple(v_scale.shape)}")
    for name, t in (("query", query), ("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the pools are updated in place)")


def paged_attention_triton(query, key, value, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                           slot_mapping, k_scale=None, v_scale=None, *, attrs: PagedAttentionAttrs,
                           max_q_len: int | None = None, max_seq_len: int | None = None,
                           num_splits: int | None = None, tile: configs.TileConfig | None = None) -> torch.Tensor:
    """Stores this step's K/V into the pools (in place) and returns the attention output
    [num_tokens, num_heads, head_dim] in the query's dtype. Shapes: spec.py.

    max_q_len / max_seq_len: host-side maxima of the new-token counts / seq_lens; read from
    the device (a sync) when not given. num_splits: decode split-K partitions (None = the
    heuristic of `plan`, 1 = off). tile: override the configs.py tile (tests, tuning)."""
    _check(query, key, value, key_cache, value_cache, k_scale, v_scale, attrs)
    num_seqs = seq_lens.shape[0]
    num_blocks, max_blocks = key_cache.shape[1], block_tables.shape[1]
    if max_q_len is None:
        max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if num_seqs else 0
    out = torch.empty_like(query)  # [T, H, D]
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    query_start_loc, slot_mapping = query_start_loc.contiguous(), slot_mapping.contiguous()
    if not attrs.quantized:  # the kernels take scale pointers either way; never read
        k_scale = v_scale = torch.ones(attrs.num_kv_heads, dtype=torch.float32, device=query.device)
    k_scale, v_scale = k_scale.float().contiguous(), v_scale.float().contiguous()
    p = plan(attrs, num_seqs, max_q_len, max_seq_len, query.device, num_splits=num_splits, tile=tile)
    const = dict(configs.attn_constexprs(attrs, configs.block_m_for(p.tile, attrs.group_size), p.tile.block_n,
                                         per_channel_scales=k_scale.dim() == 2),
                 INTERPRET=_interpreting(), num_warps=p.tile.num_warps, num_stages=p.tile.num_stages)
    ins = (query, key, value, key_cache, value_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
           k_scale, v_scale)
    if p.kind == "prefill":
        block_q = const["BLOCK_M"] // attrs.group_size
        grid = (query.shape[0] // block_q + num_seqs, attrs.num_kv_heads)
        kernels.prefill_kernel[grid](*ins, num_seqs, max_blocks, num_blocks, out, key_cache, value_cache, **const)
        return out
    split = p.num_splits > 1
    if split:
        part_out = torch.empty(num_seqs, attrs.num_heads, p.num_splits, attrs.head_dim, dtype=torch.float32,
                               device=query.device)  # [S, H, splits, D]
        part_m = torch.empty(num_seqs, attrs.num_heads, p.num_splits, dtype=torch.float32,
                             device=query.device)  # [S, H, splits]
        part_l = torch.empty_like(part_m)
    else:
        part_out = part_m = part_l = out  # unused
    grid = (num_seqs, attrs.num_kv_heads, p.num_splits)
    kernels.decode_kernel[grid](*ins, max_blocks, num_blocks, p.partition, out, key_cache, value_cache,
                                part_out, part_m, part_l, SPLIT=split, **const)
    if split:
        kernels.reduce_kernel[(num_seqs, attrs.num_heads)](
            part_out, part_m, part_l, query_start_loc, out, p.num_splits, NUM_HEADS=attrs.num_heads,
            HEAD_DIM=attrs.head_dim, BLOCK_D=configs.pow2(attrs.head_dim),
            MAX_SPLITS=configs.pow2(p.num_splits), num_warps=configs.REDUCE_WARPS, **configs.sink_constexprs(attrs))
    return out


def attention_scores_triton(query, key_cache, block_tables, seq_lens, query_start_loc, observation_lens,
                            k_scale=None, *, attrs: PagedAttentionAttrs,
                            tile: configs.TileConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The optional attention_scores output (spec.py "Attention scores"): float32 [num_seqs,
    num_kv_heads, max_blocks * block_size], the same call and meaning as `reference.attention_scores`
    (into `out` when given: its contents are overwritten, zeros included). Call it after
    `paged_attention_triton` of the same step (the pools then hold this step's keys),
    and only for a step that observes: the attention launch itself is unchanged (a second kernel,
    kernels.scores_kernel, one program per sequence × KV head). tile: override configs.SCORES_TILE."""
    if _KV.get(key_cache.dtype) != attrs.kv_dtype:
        raise ValueError(f"key_cache must be {attrs.kv_dtype} (attrs.kv_dtype), got {key_cache.dtype}")
    if query.dtype not in _ACT:
        raise ValueError(f"query must be one of {list(_ACT.values())}, got {query.dtype}")
    if attrs.quantized and k_scale is None:
        raise ValueError("int8 KV needs k_scale")
    num_seqs, max_blocks = block_tables.shape
    score_len = max_blocks * attrs.block_size
    if num_seqs == 0 or query.shape[0] == 0:
        return torch.zeros(num_seqs, attrs.num_kv_heads, score_len, dtype=torch.float32, device=query.device)
    # NOTE: need not be zeroed: the kernel zeroes every row it owns (as a TensorRT output needs)
    shape = (num_seqs, attrs.num_kv_heads, score_len)
    scores = torch.empty(shape, dtype=torch.float32, device=query.device) if out is None else out
    if tuple(scores.shape) != shape or scores.dtype != torch.float32 or not scores.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {list(shape)}")
    if not attrs.quantized:
        k_scale = torch.ones(attrs.num_kv_heads, dtype=torch.float32, device=query.device)
    k_scale = k_scale.float().contiguous()
    tile = tile or configs.SCORES_TILE
    const = dict(configs.attn_constexprs(attrs, configs.block_m_for(tile, attrs.group_size), tile.block_n,
                                         per_channel_scales=k_scale.dim() == 2),
                 INTERPRET=_interpreting(), num_warps=tile.num_warps, num_stages=tile.num_stages)
    kernels.scores_kernel[(num_seqs, attrs.num_kv_heads)](
        query.contiguous(), key_cache, block_tables.contiguous(), seq_lens.contiguous(), query_start_loc.contiguous(),
        k_scale, observation_lens.to(torch.int64).contiguous(), max_blocks, key_cache.shape[1], score_len, scores,
        **const)
    return scores
