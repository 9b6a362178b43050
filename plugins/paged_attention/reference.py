"""Readable, slow reference of `kvexport::PagedAttention` (see spec.py): the executable
definition every other implementation is tested against.

torch, so the same code runs on CPU in CI and on the GPU at real sizes (scripts/gpu_check.sh),
and so bfloat16 pools exist. Computation is in float64, one sequence at a time.
"""

from __future__ import annotations

import torch

from kvexport import io

from ..common.cases import paged_batch
from .spec import PagedAttentionAttrs

# the pools' torch dtype by kv_dtype (int4: uint8 rows of codes and scales, io.KV_INT4_FORMAT)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
           "int4": torch.uint8}
F16_MAX = 65504.0
INT4_MIN_SCALE = 2.0 ** -14  # the smallest normal float16: a constant group still divides


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def channel_scales(scale: torch.Tensor, attrs: PagedAttentionAttrs) -> torch.Tensor:
    """int8 scales as [kv_heads, head_dim] float32: per-channel scales as given, a per-head
    vector [kv_heads] (builds calibrated before per-channel scales) broadcast along head_dim."""
    scale = scale.float()
    if scale.dim() == 1:
        scale = scale[:, None].expand(attrs.num_kv_heads, attrs.head_dim)
    return scale


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., kv_heads, head_dim] / scale [kv_heads, head_dim] rounded half to even,
    saturated to int8 (ONNX QuantizeLinear, zero point 0).
    NOTE: the division is in float32, as onnxruntime's QuantizeLinear does it (dividing in
    float64 rounds ~1 value in a million differently, near ties)."""
    q = torch.round(x.float() / scale.float())
    return q.clamp(-128, 127).to(torch.int8)


def _f16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float16, round to nearest even, saturating at ±65504."""
    return x.clamp(-F16_MAX, F16_MAX).to(torch.float16)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float16 [...] -> its IEEE bits as little-endian bytes [..., 2] uint8."""
    bits = x.view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([bits & 0xFF, bits >> 8], -1).to(torch.uint8)


def _f16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """little-endian bytes [..., 2] uint8 -> float16 [...] (bit for bit)."""
    bits = b[..., 0].to(torch.int32) | (b[..., 1].to(torch.int32) << 8)
    return torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.float16)


def quantize_int4(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] -> int4 rows [..., io.kv_row_width(head_dim, "int4")] uint8
    (io.KV_INT4_FORMAT; every step in float32, as spec.py writes it)."""
    x = x.float()
    d = x.shape[-1]
    g = x.reshape(*x.shape[:-1], d // io.KV_INT4_GROUP, io.KV_INT4_GROUP)  # [..., groups, 32]
    lo, hi = g.amin(-1), g.amax(-1)
    pos = hi >= -lo  # the extreme is the maximum (ties: the maximum)
    mag = _f16(torch.clamp(torch.where(pos, hi, -lo) / 8.0, min=INT4_MIN_SCALE))  # [..., groups] float16
    scale = torch.where(pos, -mag, mag)  # the extreme maps to code -8
    code = torch.round(g / scale.float()[..., None]).clamp(-8, 7) + 8  # nibble = code + 8
    pairs = code.to(torch.uint8).reshape(*x.shape[:-1], d // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)  # [..., D/2]
    return torch.cat([packed, _f16_bytes(scale).reshape(*x.shape[:-1], -1)], -1)  # [..., D/2 + groups * 2]


def dequantize_int4(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int4 rows [..., row_width] uint8 -> [..., head_dim] float32: code * scale (exact)."""
    groups = head_dim // io.KV_INT4_GROUP
    packed = rows[..., :head_dim // 2]
    code = torch.stack([packed & 15, packed >> 4], -1).reshape(*rows.shape[:-1], groups, io.KV_INT4_GROUP)
    scale = _f16_from_bytes(rows[..., head_dim // 2:].reshape(*rows.shape[:-1], groups, 2)).float()
    x = (code.float() - 8.0) * scale[..., None]
    return x.reshape(*rows.shape[:-1], head_dim)


def store_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, new: torch.Tensor, attrs: PagedAttentionAttrs,
             scale: torch.Tensor | None) -> None:
    """cache [kvH, NB, bs, D] (in place) <- new [T, kvH, D] at slot_mapping (slot < 0: skipped)."""
    keep = slot_mapping >= 0
    slots, new = slot_mapping[keep], new[keep]
    if attrs.quantized:
        vals = quantize(new, channel_scales(scale, attrs))  # [T, kvH, D]
    elif attrs.int4:
        vals = quantize_int4(new)  # [T, kvH, row_width]
    else:  # rounded to the pool's declared dtype even when handed a wider buffer (ort.py)
        vals = new.to(torch_dtype(attrs.kv_dtype)).to(cache.dtype)
    cache[:, slots // attrs.block_size, slots % attrs.block_size, :] = vals.transpose(0, 1)


def read_kv(cache: torch.Tensor, table: torch.Tensor, n: int, attrs: PagedAttentionAttrs,
            scale: torch.Tensor | None) -> torch.Tensor:
    """The first n tokens of one sequence: [kvH, n, D] float64."""
    pos = torch.arange(n, device=cache.device)
    x = cache[:, table[pos // attrs.block_size], pos % attrs.block_size, :]  # [kvH, n, D]
    if attrs.quantized:  # q * scale, exact in float64
        return x.double() * channel_scales(scale, attrs).double()[:, None, :]
    if attrs.int4:
        return dequantize_int4(x, attrs.head_dim).double()
    return x.double()


def paged_attention(query, key, value, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                    slot_mapping, k_scale=None, v_scale=None, *, attrs: PagedAttentionAttrs) -> torch.Tensor:
    """Writes this step's K/V into the pools (in place) and returns the attention output
    [num_tokens, num_heads, head_dim] in the query's dtype. Shapes: spec.py."""
    if attrs.quantized and (k_scale is None or v_scale is None):
        raise ValueError("int8 KV needs k_scale and v_scale")
    store_kv(key_cache, slot_mapping, key, attrs, k_scale)
    store_kv(value_cache, slot_mapping, value, attrs, v_scale)
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    g = attrs.group_size
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        q_len, total = end - start, int(seq_lens[s])
        if q_len == 0:
            continue
        ctx = total - q_len
        k = read_kv(key_cache, block_tables[s], total, attrs, k_scale)  # [kvH, L, D]
        v = read_kv(value_cache, block_tables[s], total, attrs, v_scale)
        k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)  # [H, L, D]
        q = query[start:end].double().transpose(0, 1)  # [H, q_len, D]
        scores = attrs.scale * (q @ k.transpose(1, 2))  # [H, q_len, L]
        if attrs.logit_softcap:  # Gemma 2: soft-capped before the mask and softmax
            scores = attrs.logit_softcap * torch.tanh(scores / attrs.logit_softcap)
        qpos = ctx + torch.arange(q_len, device=query.device)[:, None]
        kpos = torch.arange(total, device=query.device)[None, :]
        visible = kpos <= qpos
        if attrs.sliding_window:
            visible &= (qpos - kpos) < attrs.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if attrs.attention_sinks:  # GPT-OSS: one more logit per head in the softmax, with no value
            sink = torch.tensor(attrs.attention_sinks, dtype=torch.float64, device=query.device)
            scores = torch.cat([scores, sink[:, None, None].expand(-1, q_len, 1)], dim=-1)  # [H, q_len, L + 1]
            probs = torch.softmax(scores, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = (probs @ v).transpose(0, 1)  # [q_len, H, D]
    return out.to(query.dtype)


def attention_scores(query, key_cache, block_tables, seq_lens, query_start_loc, observation_lens, k_scale=None,
                     *, attrs: PagedAttentionAttrs) -> torch.Tensor:
    """The optional output `attention_scores` (spec.py "Attention scores"), float64
    [num_seqs, num_kv_heads, max_blocks * block_size]: for sequence s, its last
    min(observation_lens[s], q_len) new tokens' softmax probabilities, summed over those queries
    and over the query heads of each KV head, at each key position j (0 where nothing attends).
    Call it after `paged_attention` (the pools then hold this step's keys)."""
    num_seqs, max_blocks = block_tables.shape
    out = torch.zeros(num_seqs, attrs.num_kv_heads, max_blocks * attrs.block_size, dtype=torch.float64,
                      device=query.device)
    g = attrs.group_size
    for s in range(num_seqs):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        q_len, total = end - start, int(seq_lens[s])
        obs = min(int(observation_lens[s]), q_len)
        if obs <= 0:
            continue
        k = read_kv(key_cache, block_tables[s], total, attrs, k_scale).repeat_interleave(g, dim=0)  # [H, L, D]
        q = query[end - obs:end].double().transpose(0, 1)  # [H, obs, D]
        scores = attrs.scale * (q @ k.transpose(1, 2))  # [H, obs, L]
        if attrs.logit_softcap:
            scores = attrs.logit_softcap * torch.tanh(scores / attrs.logit_softcap)
        qpos = total - obs + torch.arange(obs, device=query.device)[:, None]
        kpos = torch.arange(total, device=query.device)[None, :]
        visible = kpos <= qpos
        if attrs.sliding_window:
            visible &= (qpos - kpos) < attrs.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if attrs.attention_sinks:
            sink = torch.tensor(attrs.attention_sinks, dtype=torch.float64, device=query.device)
            scores = torch.cat([scores, sink[:, None, None].expand(-1, obs, 1)], dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)  # [H, obs, L]
        out[s, :, :total] = probs.sum(1).reshape(attrs.num_kv_heads, g, total).sum(1)
    return out


def make_case(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, q_lens: list[int],
              ctx_lens: list[int], num_blocks: int | None = None, kv_dtype: str = "float32",
              act_dtype: str = "float32", sliding_window: int = 0, shared_prefix_blocks: int = 0,
              scale: float | None = None, logit_softcap: float = 0.0, per_head_scales: bool = False,
              attention_sinks=(), seed: int = 0, device: str = "cpu") -> tuple[dict, PagedAttentionAttrs]:
    """A random ragged batch: sequence s has ctx_lens[s] tokens already in the pool and
    q_lens[s] new ones. Block ids are shuffled (tables have holes: unused ids in between);
    the first `shared_prefix_blocks` full blocks of every sequence are the same physical
    blocks (a shared prompt prefix, as prefix caching produces; their contents must then
    be equal across sequences, which holds because they are only written once).
    scale: the softmax scale (None: head_dim ** -0.5). int8 scales are per channel
    [kv_heads, head_dim], or per head [kv_heads] with `per_head_scales` (older builds).
    attention_sinks: num_heads sink logits (GPT-OSS), () for none.
    Returns (inputs by spec.INPUTS name, attrs)."""
    gen = torch.Generator().manual_seed(seed)
    attrs = PagedAttentionAttrs(num_heads, num_kv_heads, head_dim, block_size,
                                head_dim ** -0.5 if scale is None else scale, sliding_window, kv_dtype,
                                logit_softcap, tuple(attention_sinks))
    batch = paged_batch(block_size, q_lens, ctx_lens, num_blocks, shared_prefix_blocks, gen)
    num_blocks = batch.num_blocks
    f = torch.float32
    pool_dtype = torch_dtype(kv_dtype)
    kvh, d = num_kv_heads, head_dim
    pool_shape = (kvh, num_blocks, block_size, d)
    if kv_dtype == "int4":  # valid rows (finite scales): random values quantized
        key_cache = quantize_int4(torch.randn(pool_shape, generator=gen))
        value_cache = quantize_int4(torch.randn(pool_shape, generator=gen))
        k_scale = v_scale = None
    elif kv_dtype == "int8":
        key_cache = torch.randint(-127, 128, pool_shape, generator=gen, dtype=torch.int8)
        value_cache = torch.randint(-127, 128, pool_shape, generator=gen, dtype=torch.int8)
        scale_shape = (kvh,) if per_head_scales else (kvh, d)
        k_scale = (torch.rand(scale_shape, generator=gen) * 0.02 + 0.01)
        v_scale = (torch.rand(scale_shape, generator=gen) * 0.02 + 0.01)
    else:
        key_cache = torch.randn(pool_shape, generator=gen, dtype=f).to(pool_dtype)
        value_cache = torch.randn(pool_shape, generator=gen, dtype=f).to(pool_dtype)
        k_scale = v_scale = None
    t = batch.num_tokens
    act = torch_dtype(act_dtype)
    inputs = dict(
        query=torch.randn(t, num_heads, d, generator=gen).to(act),
        key=torch.randn(t, kvh, d, generator=gen).to(act),
        value=torch.randn(t, kvh, d, generator=gen).to(act),
        key_cache=key_cache, value_cache=value_cache, block_tables=batch.block_tables, seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc, slot_mapping=batch.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    if device != "cpu":
        inputs = {k: (v.to(device) if v is not None else None) for k, v in inputs.items()}
    return inputs, attrs
