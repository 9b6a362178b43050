"""Prefix-cache keys. This module owns how a full block of tokens is named in the
prefix cache: a chained hash over (parent block's hash, the block's token ids, salt).

Chaining makes a block's key depend on every token before it, so two blocks with equal
keys hold the same KV (KV at position p depends on tokens 0..p). The salt keeps requests
that must not share KV apart: `request_salt(tenant, cache_salt)` names it, from the API
key's tenant (`kvexport serve --api-keys`) and the request's `cache_salt` (as vLLM's).

NOTE: only a request's first block is salted (as vLLM: its `cache_salt` joins the extra
keys of the block starting at token 0; TensorRT-LLM mixes its cache_salt_id into the root
only). Every later key hashes its parent's, so the salt reaches the whole chain; salting each
block again would add nothing. Everything keyed by these hashes (the pool, and the host and
disk tiers below it) is therefore salted without knowing salts exist.

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
        # the salt goes into the first block only; the chain carries it (see the module's NOTE)
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size],
                                        salt if parent is None else None))
    return hashes


def request_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The prefix-cache salt of a request: its tenant (the API key's, None without keys) and its
    own `cache_salt` (None: none), or None when it has neither (it shares with every unsalted
    request). Requests share cached blocks only when both parts are equal.

    NOTE: both parts are length-prefixed under their own tag, so no choice of one can equal
    another choice of the other: tenant "a" without a salt, salt "a" without a tenant, tenant
    "a|s" and tenant "a" with salt "s" all differ (vLLM's flat extra keys once let a LoRA name
    equal a cache_salt)."""
    if tenant is None and cache_salt is None:
        return None
    return "".join(f"{tag}{len(v)}:{v};" for tag, v in (("tenant", tenant), ("salt", cache_salt)) if v is not None)


def split_salt(salt: str | None) -> tuple[str | None, str | None]:
    """`request_salt`'s inverse: a prefix-cache salt -> (tenant, cache_salt). For observers that
    must name a block's salt as the client gave it (a cluster router hashing the request's own
    cache_salt: runtime/serving/dynamo_protocol.py). Raises ValueError for a string
    `request_salt` cannot have made."""
    parts: dict[str, str] = {}
    rest = salt or ""
    for tag in ("tenant", "salt"):
        if rest.startswith(tag):
            head, sep, tail = rest[len(tag):].partition(":")
            if not sep or not head.isdigit() or tail[int(head):int(head) + 1] != ";":
                raise ValueError(f"not a kvexport prefix-cache salt: {salt!r}")
            parts[tag], rest = tail[:int(head)], tail[int(head) + 1:]
    if rest or (salt is not None and not parts):
        raise ValueError(f"not a kvexport prefix-cache salt: {salt!r}")
    return parts.get("tenant"), parts.get("salt")
