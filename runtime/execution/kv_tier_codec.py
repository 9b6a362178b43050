"""Compressed KV tiers (issue 46 §4, `--kv-offload-dtype int8|int4`): the blocks a tier holds (host memory and
disk) stored at int8 or int4 and decoded when they come back into the pool, so the same tier budget holds ~3.8x
(int8) or ~7.1x (int4) the blocks of an fp32 pool (head_dim 64; half that of an fp16 pool). TensorRT-LLM keeps cold
pages at NVFP4 and LMCache's CacheGen compresses them the same way: the pool keeps its own precision; only what
leaves it is rounded.

A block's payload (execution/kv_offload.py: each of the group's tensors sliced at the block, concatenated) is
encoded tensor by tensor:

    float32 / float16 tensor [heads, block_size, head_dim]   ->  each head_dim vector (one token of one head):
        int8: codes x its own scale absmax / 127 (float32)
        int4: rotated by the normalized Walsh-Hadamard transform (head_dim a power of two), then codes in
              [-7, 7] x absmax / 7 of the rotated vector, two codes a byte
    anything else (an int8 / int4 pool's codes, its scales, bfloat16)  ->  kept as it is (raw bytes)

so every token's key and value of every head is rounded on its own scale: an entry (of the rotated vector, for int4)
is off by at most half a step. The rotation spreads an outlier channel over the whole vector (QuaRot's argument,
as the int4 KV pool's key transform does), so one large entry no longer sets a coarse step for the others; it is
orthonormal, so the error's L2 norm is the same after the inverse. The hybrids' recurrent-state checkpoints
(io.STATE_GROUP) are never rounded (a state carries the whole prefix: its error would compound). The codec is part
of the disk tier's identity, so a folder written at one dtype is never read at another.
"""

from __future__ import annotations

import numpy as np

from kvexport import io

_ROUNDED = ("float32", "float16")


def itemsize(dtype: str) -> int:
    """Bytes of one element of a pool tensor's dtype (bfloat16: torch pools; numpy has none)."""
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def hadamard(x: np.ndarray) -> np.ndarray:
    """x [n, d] (d a power of two) times the normalized Walsh-Hadamard matrix (orthonormal and symmetric: its own
    inverse), by the fast transform's butterflies."""
    n, d = x.shape
    y, h = x, 1
    while h < d:
        y = y.reshape(n, d // (2 * h), 2, h)
        y = np.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], axis=2)
        h *= 2
    return y.reshape(n, d) / np.float32(np.sqrt(d))


class TierCodec:
    """Encode / decode the payloads of each KV cache group's blocks at `bits` (8 or 4; module docstring).
    `layout`: group -> (dtype, shape of one block's slice) of each tensor, in payload order (kv_offload.layout)."""

    def __init__(self, layout: dict[str, list[tuple[str, tuple[int, ...]]]], bits: int = 8):
        assert bits in (8, 4), "int8 or int4"
        self.layout, self.bits = {g: list(ts) for g, ts in layout.items()}, bits
        self.name = f"int{bits}"
        self._qmax = 127 if bits == 8 else 7

    def _parts(self, group: str):
        """(dtype, vector width d or 0 when kept as it is, elements, bytes at the pool's precision, bytes in the
        tier) of each tensor of `group`'s payload, in order."""
        for dtype, shape in self.layout[group]:
            n, d = int(np.prod(shape)), int(shape[-1]) if len(shape) else 0
            if not (group != io.STATE_GROUP and dtype in _ROUNDED and d > 0 and (self.bits == 8 or d % 2 == 0)):
                d = 0
            codes = n if self.bits == 8 else n // 2
            yield dtype, d, n, n * itemsize(dtype), (codes + 4 * (n // d) if d else n * itemsize(dtype))

    def _rotated(self, d: int) -> bool:
        return self.bits == 4 and d & (d - 1) == 0

    def encoded_bytes(self, group: str, raw_bytes: int) -> int:
        """Bytes one block of `group` takes in a tier (`raw_bytes`: its payload's at the pool's precision)."""
        if group not in self.layout:
            return raw_bytes
        return sum(tier for *_, tier in self._parts(group))

    def encode(self, group: str, payload: np.ndarray) -> np.ndarray:
        """A block's payload (uint8, the pool's precision) -> its tier bytes (uint8)."""
        if group not in self.layout:
            return payload
        out, at = [], 0
        for dtype, d, _, raw, _ in self._parts(group):
            part = payload[at:at + raw]
            at += raw
            if not d:
                out.append(part)
                continue
            x = part.view(dtype).astype(np.float32).reshape(-1, d)  # [vectors, head_dim]
            if self._rotated(d):
                x = hadamard(x)
            scale = (np.abs(x).max(axis=1, keepdims=True) / np.float32(self._qmax)).astype(np.float32)
            q = np.clip(np.rint(x / np.where(scale > 0, scale, 1.0)), -self._qmax, self._qmax)  # zeros: codes 0
            if self.bits == 8:
                codes = q.astype(np.int8).reshape(-1).view(np.uint8)
            else:
                u = (q.astype(np.int16) + 8).astype(np.uint8).reshape(-1, 2)  # [1, 15], two a byte: low, high
                codes = (u[:, 0] | (u[:, 1] << 4)).astype(np.uint8)
            out += [codes, scale.reshape(-1).view(np.uint8)]
        assert at == payload.size, "a payload holds exactly one block of the group's tensors"
        return np.concatenate(out) if len(out) > 1 else np.array(out[0], copy=True)

    def decode(self, group: str, data: np.ndarray) -> np.ndarray:
        """A block's tier bytes -> its payload at the pool's precision (uint8)."""
        if group not in self.layout:
            return data
        out, at = [], 0
        for dtype, d, n, _, tier in self._parts(group):
            part = data[at:at + tier]
            at += tier
            if not d:
                out.append(part)
                continue
            raw, scale = part[:tier - 4 * (n // d)], part[tier - 4 * (n // d):].view(np.float32).reshape(-1, 1)
            if self.bits == 8:
                q = raw.view(np.int8).astype(np.float32)
            else:
                q = np.stack([(raw & 0xF).astype(np.float32) - 8, (raw >> 4).astype(np.float32) - 8], axis=1)
            x = q.reshape(-1, d) * scale
            if self._rotated(d):
                x = hadamard(x)  # its own inverse
            out.append(x.astype(dtype).reshape(-1).view(np.uint8))
        assert at == data.size, "tier bytes hold exactly one encoded block"
        return np.concatenate(out) if len(out) > 1 else np.array(out[0], copy=True)


def tier_codec(dtype: str, layout: dict) -> TierCodec | None:
    """The codec of `--kv-offload-dtype` (None for auto: the pool's precision)."""
    return {"int8": TierCodec(layout, 8), "int4": TierCodec(layout, 4)}.get(dtype)


__all__ = ["TierCodec", "hadamard", "itemsize", "tier_codec"]
