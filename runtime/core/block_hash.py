"""Prefix-cache keys. This module owns how a full block of tokens is named in the
prefix cache: a chained hash over (parent block's hash, the block's token ids, salt).

Chaining makes a block's key depend on every token before it, so two blocks with equal
keys hold the same KV (KV at position p depends on tokens 0..p). The salt (e.g. a
per-user or per-LoRA string) keeps requests that must not share KV apart.

NOTE: keys are SHA-256 digests (32 bytes), not Python ``hash()`` of tuples. They are
deterministic across processes (no PYTHONHASHSEED) and a collision, which would make a
request silently read another prompt's KV, is not a practical concern; 64-bit
``hash()`` gives neither guarantee. Hashing a block of int64 tokens costs about a
microsecond, nothing next to a model step.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

# Parent of a request's first block: a fixed digest, so every key hashes exactly
# 32 parent bytes and the encoding below stays unambiguous.
_ROOT = hashlib.sha256(b"kvexport.prefix-cache.root").digest()


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None
) -> BlockHash:
    """Key of one full block: sha256(parent or ROOT | salt tag | token ids as int64).

    Takes the previous block's key (None for the first block), the block's token ids and
    the request's salt; returns a 32-byte key."""
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    if salt is None:
        h.update(b"\x00")
    else:
        encoded = salt.encode("utf-8")
        h.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    h.update(array("q", token_ids).tobytes())
    return BlockHash(h.digest())


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    *,
    parent_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Keys of every full block of ``token_ids`` (a trailing partial block has none).

    ``parent_hashes`` are keys already computed for the first blocks; they are kept and
    the chain continues from the last of them. Returns the keys of all full blocks."""
    hashes = list(parent_hashes)
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], salt))
    return hashes
