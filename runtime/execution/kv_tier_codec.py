"""Compressed KV tiers (issue 46 §4, `--kv-offload-dtype int8`): the blocks a tier holds (host memory and disk)
stored at int8 and decoded when they come back into the pool, so the same tier budget holds ~3.8x the blocks of an
fp32 pool (~1.9x of an fp16 one; head_dim 64). TensorRT-LLM keeps cold pages at NVFP4 and LMCache's CacheGen
compresses them the same way: the pool keeps its own precision; only what leaves it is rounded.

A block's payload (execution/kv_offload.py: each of the group's tensors sliced at the block, concatenated) is
encoded tensor by tensor:

    float32 / float16 tensor [heads, block_size, head_dim]   ->  int8 codes of each head_dim vector (one token of
                                                                 one head) x its own scale absmax / 127 (float32)
    anything else (an int8 / int4 pool's codes, its scales, bfloat16)  ->  kept as it is (raw bytes)

so every token's key and value of every head is rounded on its own scale: the error of an entry is at most half a
step, |x|max / 254 of its vector (the int8 KV pool rounds per head and block to a calibrated scale; this needs no
calibration). The hybrids' recurrent-state checkpoints (io.STATE_GROUP) are never rounded (a state carries the whole
prefix: its error would compound). The codec is part of the disk tier's identity, so a folder written at one dtype
is never read at another.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvexport import io

from ..config import KV_OFFLOAD_DTYPES
_ROUNDED = ("float32", "float16")


class Int8TierCodec:
    """Encode / decode the payloads of each KV cache group's blocks (module docstring). `layout`: group ->
    (dtype, shape of one block's slice) of each tensor, in payload order (kv_offload.layout)."""

    name = "int8"

    def __init__(self, layout: dict[str, list[tuple[str, tuple[int, ...]]]]):
        self.layout = {g: list(ts) for g, ts in layout.items()}

    @staticmethod
    def _rounded(group: str, dtype: str, shape: Sequence[int]) -> bool:
        return group != io.STATE_GROUP and dtype in _ROUNDED and len(shape) >= 1 and int(shape[-1]) > 0

    def encoded_bytes(self, group: str, raw_bytes: int) -> int:
        """Bytes one block of `group` takes in a tier (`raw_bytes`: its payload's at the pool's precision)."""
        if group not in self.layout:
            return raw_bytes
        total = 0
        for dtype, shape in self.layout[group]:
            n = int(np.prod(shape))
            if self._rounded(group, dtype, shape):
                total += n + 4 * (n // int(shape[-1]))  # the codes, one float32 scale per vector
            else:
                total += n * (2 if dtype == "bfloat16" else np.dtype(dtype).itemsize)
        return total

    def encode(self, group: str, payload: np.ndarray) -> np.ndarray:
        """A block's payload (uint8, the pool's precision) -> its tier bytes (uint8)."""
        if group not in self.layout:
            return payload
        out, at = [], 0
        for dtype, shape in self.layout[group]:
            n = int(np.prod(shape))
            size = n * (2 if dtype == "bfloat16" else np.dtype(dtype).itemsize)
            part = payload[at:at + size]
            at += size
            if not self._rounded(group, dtype, shape):
                out.append(part)
                continue
            x = part.view(dtype).astype(np.float32).reshape(-1, int(shape[-1]))  # [vectors, head_dim]
            amax = np.abs(x).max(axis=1, keepdims=True)
            scale = (amax / 127.0).astype(np.float32)
            q = np.rint(x / np.where(scale > 0, scale, 1.0))  # NOTE: an all-zero vector: codes 0, scale 0
            codes = np.clip(q, -127, 127).astype(np.int8)
            out += [codes.reshape(-1).view(np.uint8), scale.reshape(-1).view(np.uint8)]
        assert at == payload.size, "a payload holds exactly one block of the group's tensors"
        return np.concatenate(out) if len(out) > 1 else np.array(out[0], copy=True)

    def decode(self, group: str, data: np.ndarray) -> np.ndarray:
        """A block's tier bytes -> its payload at the pool's precision (uint8)."""
        if group not in self.layout:
            return data
        out, at = [], 0
        for dtype, shape in self.layout[group]:
            n = int(np.prod(shape))
            if not self._rounded(group, dtype, shape):
                size = n * (2 if dtype == "bfloat16" else np.dtype(dtype).itemsize)
                out.append(data[at:at + size])
                at += size
                continue
            d = int(shape[-1])
            codes = data[at:at + n].view(np.int8).reshape(-1, d)
            at += n
            scale = data[at:at + 4 * (n // d)].view(np.float32).reshape(-1, 1)
            at += 4 * (n // d)
            out.append((codes.astype(np.float32) * scale).astype(dtype).reshape(-1).view(np.uint8))
        assert at == data.size, "tier bytes hold exactly one encoded block"
        return np.concatenate(out) if len(out) > 1 else np.array(out[0], copy=True)


def tier_codec(dtype: str, layout: dict) -> Int8TierCodec | None:
    """The codec of `--kv-offload-dtype` (None: the pool's precision)."""
    return Int8TierCodec(layout) if dtype == "int8" else None


__all__ = ["Int8TierCodec", "KV_OFFLOAD_DTYPES", "tier_codec"]
