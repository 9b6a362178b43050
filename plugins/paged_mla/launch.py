"""Python launcher of the MLA Triton kernels: `paged_mla_triton(...)`, the same call and semantics
as `reference.paged_mla` (spec.py), on CUDA tensors — or on CPU tensors under TRITON_INTERPRET=1.
Picks the split-K partitioning; the tile configs come from configs.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import configs, kernels
from .spec import PagedMLAAttrs

_ACT = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_KV = {**_ACT, torch.int8: "int8"}
MIN_PARTITION = 256  # fewest keys per split worth a partial


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """What the launcher decided for one call (returned by `plan()`, used by the GPU check)."""

    tile: configs.TileConfig
    heads: int  # query heads per program
    num_splits: int  # context partitions (1 = no split-K)
    partition: int  # keys per partition (0 without splits)


def _interpreting() -> bool:
    """Whether the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 when kernels.py
    was first imported: triton.jit decides then)."""
    return type(kernels.mla_kernel).__name__ == "InterpretedFunction"


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def plan(attrs: PagedMLAAttrs, num_tokens: int, num_seqs: int, max_q_len: int, max_seq_len: int,
         device: torch.device, *, num_splits: int | None = None, tile: configs.TileConfig | None = None) -> LaunchPlan:
    """Split-K when decode steps (every q_len <= 1) give too few programs to fill the GPU (about 4
    per SM) and each split still reads >= MIN_PARTITION keys. Prefill steps are not split."""
    tile = tile or configs.TILES[0]
    heads = configs.heads_per_program(tile, attrs.num_heads)
    programs = (num_tokens * heads // tile.block_m + num_seqs) * -(-attrs.num_heads // heads)
    if num_splits is None:
        want = -(-4 * _sm_count(device) // max(1, programs)) if max_q_len <= 1 else 1
        num_splits = min(want, -(-max_seq_len // MIN_PARTITION), configs.MAX_SPLITS)
    num_splits = max(1, min(num_splits, configs.MAX_SPLITS, -(-max(1, max_seq_len) // tile.block_n)))
    if num_splits == 1:
        return LaunchPlan(tile, heads, 1, 0)
    partition = -(-max(1, max_seq_len) // num_splits)
    partition = -(-partition // tile.block_n) * tile.block_n  # a multiple of BLOCK_N
    return LaunchPlan(tile, heads, -(-max(1, max_seq_len) // partition), partition)


def _check(query, latent, latent_cache, kv_scale, attrs: PagedMLAAttrs) -> None:
    w = attrs.row_width
    if query.dtype not in _ACT or latent.dtype != query.dtype:
        raise ValueError(f"query/latent must share one of {list(_ACT.values())}, got {query.dtype}/{latent.dtype}")
    if _KV.get(latent_cache.dtype) != attrs.kv_dtype:
        raise ValueError(f"latent_cache must be {attrs.kv_dtype} (attrs.kv_dtype), got {latent_cache.dtype}")
    if tuple(query.shape[1:]) != (attrs.num_heads, w) or tuple(latent.shape[1:]) != (w,):
        raise ValueError(f"query must be [T, {attrs.num_heads}, {w}] and latent [T, {w}], got "
                         f"{tuple(query.shape)} / {tuple(latent.shape)}")
    if latent_cache.dim() != 4 or latent_cache.shape[0] != 1 or tuple(latent_cache.shape[2:]) != (attrs.block_size, w):
        raise ValueError(f"latent_cache must be [1, num_blocks, {attrs.block_size}, {w}], "
                         f"got {tuple(latent_cache.shape)}")
    if attrs.quantized and (kv_scale is None or tuple(kv_scale.shape) != (w,)):
        raise ValueError(f"int8 KV needs kv_scale [{w}]")
    for name, t in (("query", query), ("latent", latent), ("latent_cache", latent_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the pool is updated in place)")


def paged_mla_triton(query, latent, latent_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
                     kv_scale=None, *, attrs: PagedMLAAttrs, max_q_len: int | None = None,
                     max_seq_len: int | None = None, num_splits: int | None = None,
                     tile: configs.TileConfig | None = None) -> torch.Tensor:
    """Stores this step's rows into the pool (in place) and returns the attended latent
    [num_tokens, num_heads, kv_lora_rank] in the query's dtype. Shapes: spec.py.

    max_q_len / max_seq_len: host-side maxima of the new-token counts / seq_lens; read from the
    device (a sync) when not given. num_splits: split-K partitions (None = the heuristic of
    `plan`, 1 = off). tile: override the configs.py tile (tests, tuning)."""
    _check(query, latent, latent_cache, kv_scale, attrs)
    num_seqs, num_tokens = seq_lens.shape[0], query.shape[0]
    if max_q_len is None:
        max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if num_seqs else 0
    out = torch.empty(num_tokens, attrs.num_heads, attrs.kv_lora_rank, dtype=query.dtype, device=query.device)
    if num_seqs == 0 or num_tokens == 0:
        return out
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    query_start_loc, slot_mapping = query_start_loc.contiguous(), slot_mapping.contiguous()
    if kv_scale is None:  # the kernels take a scale pointer either way; read only for int8
        kv_scale = torch.ones(attrs.row_width, dtype=torch.float32, device=query.device)
    kv_scale = kv_scale.float().contiguous()
    p = plan(attrs, num_tokens, num_seqs, max_q_len, max_seq_len, query.device, num_splits=num_splits, tile=tile)
    const = dict(configs.constexprs(attrs, p.tile), INTERPRET=_interpreting(), num_warps=p.tile.num_warps,
                 num_stages=p.tile.num_stages)
    ins = (query, latent, latent_cache, block_tables, seq_lens, query_start_loc, slot_mapping, kv_scale)
    block_q = p.tile.block_m // p.heads
    chunks = -(-attrs.num_heads // p.heads)
    max_blocks = block_tables.shape[1]
    if p.num_splits == 1:
        grid = (num_tokens // block_q + num_seqs, chunks)
        kernels.mla_kernel[grid](*ins, num_seqs, max_blocks, latent_cache.shape[1], out, latent_cache, **const)
        return out
    part_out = torch.empty(num_tokens, attrs.num_heads, p.num_splits, attrs.kv_lora_rank, dtype=torch.float32,
                           device=query.device)
    part_m = torch.empty(num_tokens, attrs.num_heads, p.num_splits, dtype=torch.float32, device=query.device)
    part_l = torch.empty_like(part_m)
    grid = (num_tokens // block_q + num_seqs, chunks, p.num_splits)
    kernels.mla_split_kernel[grid](*ins, num_seqs, max_blocks, p.partition, latent_cache, part_out, part_m, part_l,
                                   **const)
    kernels.mla_reduce_kernel[(num_tokens, attrs.num_heads)](
        part_out, part_m, part_l, out, p.num_splits, NUM_HEADS=attrs.num_heads, LORA=attrs.kv_lora_rank,
        BLOCK_L=const["BLOCK_L"], MAX_SPLITS=configs.pow2(p.num_splits), num_warps=configs.REDUCE_WARPS)
    return out


def attention_scores_triton(query, latent_cache, block_tables, seq_lens, query_start_loc, observation_lens,
                            kv_scale=None, *, attrs: PagedMLAAttrs,
                            tile: configs.TileConfig | None = None) -> torch.Tensor:
    """The optional attention_scores output (spec.py "Attention scores"): float32 [num_seqs, 1,
    max_blocks * block_size], the same call and meaning as `reference.attention_scores`. Call it after
    `paged_mla_triton` of the same step (the pool then holds this step's rows), and only for a step
    that observes: the attention launch itself is unchanged (a second kernel, kernels.mla_scores_kernel,
    one program per sequence × head chunk, each into its own partial row, summed here).
    tile: override configs.SCORES_TILE."""
    if _KV.get(latent_cache.dtype) != attrs.kv_dtype:
        raise ValueError(f"latent_cache must be {attrs.kv_dtype} (attrs.kv_dtype), got {latent_cache.dtype}")
    if query.dtype not in _ACT or tuple(query.shape[1:]) != (attrs.num_heads, attrs.row_width):
        raise ValueError(f"query must be [T, {attrs.num_heads}, {attrs.row_width}] of {list(_ACT.values())}, "
                         f"got {tuple(query.shape)} {query.dtype}")
    if attrs.quantized and (kv_scale is None or tuple(kv_scale.shape) != (attrs.row_width,)):
        raise ValueError(f"int8 KV needs kv_scale [{attrs.row_width}]")
    num_seqs, max_blocks = block_tables.shape
    score_len = max_blocks * attrs.block_size
    if num_seqs == 0 or query.shape[0] == 0:
        return torch.zeros(num_seqs, 1, score_len, dtype=torch.float32, device=query.device)
    if kv_scale is None:
        kv_scale = torch.ones(attrs.row_width, dtype=torch.float32, device=query.device)
    tile = tile or configs.SCORES_TILE
    heads = configs.heads_per_program(tile, attrs.num_heads)
    chunks = -(-attrs.num_heads // heads)
    part = torch.zeros(num_seqs, chunks, score_len, dtype=torch.float32, device=query.device)  # [S, chunks, L]
    const = dict(configs.constexprs(attrs, tile), INTERPRET=_interpreting(), num_warps=tile.num_warps,
                 num_stages=tile.num_stages)
    kernels.mla_scores_kernel[(num_seqs, chunks)](
        query.contiguous(), latent_cache, block_tables.contiguous(), seq_lens.contiguous(),
        query_start_loc.contiguous(), kv_scale.float().contiguous(), observation_lens.to(torch.int64).contiguous(),
        max_blocks, score_len, part, **const)
    return part.sum(1, keepdim=True)  # [S, 1, score_len]
