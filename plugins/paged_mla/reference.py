"""Readable, slow reference of `kvexport::PagedMLA` (see spec.py): the executable definition
every other implementation is tested against.

torch, so the same code runs on CPU in CI and on the GPU at real sizes (scripts/gpu_check.sh),
and so bfloat16 pools exist. Computation is in float64, one sequence at a time.
"""

from __future__ import annotations

import torch

from ..common.cases import paged_batch
from ..paged_attention.reference import quantize, torch_dtype
from .spec import PagedMLAAttrs

__all__ = ["paged_mla", "attention_scores", "store_rows", "read_rows", "quantize", "scales_from_absmax", "make_case",
           "realistic_rows", "torch_dtype"]


def store_rows(cache: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor, attrs: PagedMLAAttrs,
               kv_scale: torch.Tensor | None) -> None:
    """cache [1, NB, bs, W] (in place) <- latent [T, W] at slot_mapping (slot < 0: skipped)."""
    keep = slot_mapping >= 0
    slots, new = slot_mapping[keep], latent[keep]
    if attrs.quantized:
        vals = quantize(new, kv_scale.float())  # [T, W] QuantizeLinear rounding (float32 division)
    else:  # rounded to the pool's declared dtype even when handed a wider buffer (ort.py)
        vals = new.to(torch_dtype(attrs.kv_dtype)).to(cache.dtype)
    cache[0, slots // attrs.block_size, slots % attrs.block_size, :] = vals


def read_rows(cache: torch.Tensor, table: torch.Tensor, n: int, attrs: PagedMLAAttrs,
              kv_scale: torch.Tensor | None) -> torch.Tensor:
    """The first n rows of one sequence: [n, W] float64."""
    pos = torch.arange(n, device=cache.device)
    x = cache[0, table[pos // attrs.block_size], pos % attrs.block_size, :]  # [n, W]
    if attrs.quantized:  # code * scale, exact in float64
        return x.double() * kv_scale.double()[None, :]
    return x.double()


def paged_mla(query, latent, latent_cache, block_tables, seq_lens, query_start_loc, slot_mapping,
              kv_scale=None, *, attrs: PagedMLAAttrs) -> torch.Tensor:
    """Writes this step's rows into the pool (in place) and returns the attended latent
    [num_tokens, num_heads, kv_lora_rank] in the query's dtype. Shapes: spec.py."""
    if attrs.quantized and kv_scale is None:
        raise ValueError("int8 KV needs kv_scale")
    store_rows(latent_cache, slot_mapping, latent, attrs, kv_scale)
    lr = attrs.kv_lora_rank
    out = torch.zeros(query.shape[0], query.shape[1], lr, dtype=torch.float64, device=query.device)
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        q_len, total = end - start, int(seq_lens[s])
        if q_len == 0:
            continue
        ctx = total - q_len
        rows = read_rows(latent_cache, block_tables[s], total, attrs, kv_scale)  # [n, W]
        q = query[start:end].double().transpose(0, 1)  # [H, q_len, W]
        scores = attrs.scale * (q @ rows.T)  # [H, q_len, n]
        qpos = ctx + torch.arange(q_len, device=query.device)[:, None]
        kpos = torch.arange(total, device=query.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        out[start:end] = (torch.softmax(scores, dim=-1) @ rows[:, :lr]).transpose(0, 1)  # [q_len, H, L]
    return out.to(query.dtype)


def attention_scores(query, latent_cache, block_tables, seq_lens, query_start_loc, observation_lens, kv_scale=None,
                     *, attrs: PagedMLAAttrs) -> torch.Tensor:
    """The optional output `attention_scores` (spec.py "Attention scores"), float64
    [num_seqs, 1, max_blocks * block_size]: for sequence s, its last min(observation_lens[s], q_len)
    new tokens' softmax probabilities, summed over those queries and over all query heads, at each
    pool position j (0 where nothing attends). Call it after `paged_mla` (the pool then holds this
    step's rows)."""
    num_seqs, max_blocks = block_tables.shape
    out = torch.zeros(num_seqs, 1, max_blocks * attrs.block_size, dtype=torch.float64, device=query.device)
    for s in range(num_seqs):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        q_len, total = end - start, int(seq_lens[s])
        obs = min(int(observation_lens[s]), q_len)
        if obs <= 0:
            continue
        rows = read_rows(latent_cache, block_tables[s], total, attrs, kv_scale)  # [n, W]
        q = query[end - obs:end].double().transpose(0, 1)  # [H, obs, W]
        scores = attrs.scale * (q @ rows.T)  # [H, obs, n]
        qpos = total - obs + torch.arange(obs, device=query.device)[:, None]
        kpos = torch.arange(total, device=query.device)[None, :]
        probs = torch.softmax(scores.masked_fill(kpos > qpos, float("-inf")), dim=-1)  # [H, obs, n]
        out[s, 0, :total] = probs.sum((0, 1))
    return out


def scales_from_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """Static int8 scales [W] from the calibration's per-channel absmax: absmax / 127 (channels
    never seen nonzero get the smallest normal float32, so the division stays finite)."""
    return torch.clamp(absmax.float() / 127.0, min=torch.finfo(torch.float32).tiny)


def realistic_rows(n: int, attrs: PagedMLAAttrs, gen: torch.Generator, *, seed_profile: int = 1234) -> torch.Tensor:
    """n rows [n, W] float32 shaped like DeepSeek's: the latent part is an RMS-normalised vector
    times kv_a_layernorm's per-channel gains (log-normal spread, a few channels ~8x), the RoPE
    part a rotated key whose channel pairs have a per-pair magnitude (a few outlier pairs ~10x)
    and a position-dependent rotation. The channel profile depends only on `seed_profile`, so two
    calls (calibration text, evaluation text) share the same "model"."""
    lr, r = attrs.kv_lora_rank, attrs.qk_rope_head_dim
    prof = torch.Generator().manual_seed(seed_profile)
    gains = torch.exp(0.5 * torch.randn(lr, generator=prof))
    gains[torch.randperm(lr, generator=prof)[:max(1, lr // 64)]] *= 8.0
    c = torch.randn(n, lr, generator=gen)
    c = c / c.pow(2).mean(-1, keepdim=True).sqrt() * gains  # RMSNorm * weight
    if r == 0:
        return c
    pair_mag = torch.exp(0.7 * torch.randn(r // 2, generator=prof))
    pair_mag[torch.randperm(r // 2, generator=prof)[:max(1, r // 16)]] *= 10.0
    theta = 10000.0 ** (-torch.arange(r // 2).float() / max(1, r // 2))
    pos = torch.arange(n).float()[:, None] + torch.randint(0, 4096, (1,), generator=gen).float()
    phase = torch.randn(n, r // 2, generator=gen) * 0.3 + pos * theta
    amp = pair_mag * (1.0 + 0.3 * torch.randn(n, r // 2, generator=gen))
    k = torch.stack([amp * torch.cos(phase), amp * torch.sin(phase)], -1).reshape(n, r // 2 * 2)
    if r % 2:
        k = torch.cat([k, torch.randn(n, 1, generator=gen)], -1)
    return torch.cat([c, k], -1)


def make_case(*, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, block_size: int, q_lens: list[int],
              ctx_lens: list[int], num_blocks: int | None = None, kv_dtype: str = "float32",
              act_dtype: str = "float32", scale: float | None = None, shared_prefix_blocks: int = 0,
              realistic: bool = False, seed: int = 0, device: str = "cpu") -> tuple[dict, PagedMLAAttrs]:
    """A random ragged batch: sequence s has ctx_lens[s] rows already in the pool and q_lens[s]
    new ones. Block ids are shuffled (tables have holes: unused ids in between; block 0 is the
    pad block); the first `shared_prefix_blocks` full blocks of every sequence are the same
    physical blocks (a shared prompt prefix, as prefix caching produces).
    scale: the softmax scale (None: W ** -0.5), rounded to float32 as an ONNX attribute is.
    int8: random codes in the pool and per-channel scales in [0.01, 0.03). realistic: rows from
    `realistic_rows` (pool and step alike; int8 scales calibrated on other rows of the same profile)
    and queries of matching magnitude.
    Returns (inputs by spec.INPUTS name, attrs)."""
    gen = torch.Generator().manual_seed(seed)
    w = kv_lora_rank + qk_rope_head_dim
    scale = float(torch.tensor(w ** -0.5 if scale is None else scale, dtype=torch.float32))  # as the ONNX attribute
    attrs = PagedMLAAttrs(num_heads, kv_lora_rank, qk_rope_head_dim, block_size, scale, kv_dtype)
    batch = paged_batch(block_size, q_lens, ctx_lens, num_blocks, shared_prefix_blocks, gen)
    num_blocks = batch.num_blocks
    shape = attrs.pool_shape(num_blocks)
    t = batch.num_tokens
    act = torch_dtype(act_dtype)
    kv_scale = torch.ones(w)
    if realistic:
        rows = realistic_rows(num_blocks * block_size, attrs, gen).reshape(shape)
        latent = realistic_rows(t, attrs, gen)
        if kv_dtype == "int8":
            kv_scale = scales_from_absmax(realistic_rows(4096, attrs, gen).abs().amax(0))
            cache = quantize(rows, kv_scale)
        else:
            cache = rows.to(torch_dtype(kv_dtype))
        # absorbed queries: per-channel magnitudes so that scores spread over a few units
        query = torch.randn(t, num_heads, w, generator=gen) / rows.reshape(-1, w).std(0).clamp(min=1e-3) * 1.5
    else:
        if kv_dtype == "int8":
            cache = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
            kv_scale = torch.rand(w, generator=gen) * 0.02 + 0.01
        else:
            cache = torch.randn(shape, generator=gen).to(torch_dtype(kv_dtype))
        latent = torch.randn(t, w, generator=gen)
        query = torch.randn(t, num_heads, w, generator=gen)
    inputs = dict(query=query.to(act), latent=latent.to(act), latent_cache=cache, block_tables=batch.block_tables,
                  seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc, slot_mapping=batch.slot_mapping,
                  kv_scale=kv_scale.float())
    if device != "cpu":
        inputs = {k: v.to(device) for k, v in inputs.items()}
    return inputs, attrs
