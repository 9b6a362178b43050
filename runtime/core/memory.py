"""KV memory budgets. This module owns turning a user's size string ("2GiB") into bytes
and a byte budget into KV pools: `kv_pool_sizes` is the one pool sizing, used by the engine
(runtime/engine.py) and by `kvexport plan` (exporter/plan.py). Bytes per token come from
`kvexport.io.kv_bytes_per_token_by_group`, the one formula every planner uses.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvexport.errors import ConfigError
from kvexport.io import FULL_GROUP, LOCAL_GROUP, PAD_BLOCK_ID

from .windowed_kv_cache_manager import split_budget

# Unit (lower case) -> bytes. SI prefixes are powers of 1000, IEC ("i") of 1024.
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``"2GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"4096"`` or an int.

    Units (case-insensitive): B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of
    1024); none means bytes. Fractions are allowed and rounded down to whole bytes.
    Raises `ConfigError` naming the accepted forms for anything else."""
    if isinstance(text, bool):
        raise ConfigError(f"size {text!r}: expected a number of bytes or a string like '2GiB'")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size {text}: must be >= 0 bytes")
        return text
    if not isinstance(text, str):
        raise ConfigError(f"size {text!r}: expected a number of bytes or a string like '2GiB'")
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(
            f"size {text!r}: expected a non-negative number with an optional unit, e.g. '2GiB', "
            "'512MiB', '1.5GB' or '4096' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return math.floor(float(m.group(1)) * _UNITS[unit])


def num_blocks_for_budget(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """How many KV blocks of ``block_size`` tokens fit in ``budget_bytes`` at
    ``bytes_per_token`` (K and V of all layers). The result counts the pad block, so it
    is the ``num_blocks`` of `BlockPool` and of the KV tensors; ``result - 1`` blocks are
    usable. Raises `ConfigError` when fewer than 2 blocks fit."""
    args = {"budget_bytes": budget_bytes, "bytes_per_token": bytes_per_token, "block_size": block_size}
    for name, value in args.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name}={value!r}: must be a positive integer")
    bytes_per_block = bytes_per_token * block_size
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 2:
        raise ConfigError(
            f"a KV budget of {budget_bytes} bytes holds {num_blocks} block(s) of {bytes_per_block} bytes "
            f"({block_size} tokens x {bytes_per_token} bytes); at least 2 are needed (block "
            f"{PAD_BLOCK_ID} is the pad block): raise the budget to >= {2 * bytes_per_block} bytes "
            "or lower block_size"
        )
    return num_blocks


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """The KV pools a budget buys (`kv_pool_sizes`); block counts include the pad block."""

    block_size: int  # tokens per block
    num_blocks: int  # blocks of each full-group layer's pool (the full group's BlockPool)
    local_num_blocks: int | None  # blocks of each local-group layer's pool; None: one group
    bytes_per_block: int  # K and V of every full-group layer, one block, bytes
    local_bytes_per_block: int  # K and V of every local-group layer, one block, bytes; 0: one group

    @property
    def bytes(self) -> int:
        """Bytes of all pools."""
        return self.num_blocks * self.bytes_per_block + (self.local_num_blocks or 0) * self.local_bytes_per_block

    @property
    def pool_tokens(self) -> int:
        """Tokens the full group's usable blocks hold: the scheduler caps a sequence at it."""
        return (self.num_blocks - 1) * self.block_size


def kv_pool_sizes(budget_bytes: int, block_size: int, bytes_per_token: Mapping[str, int], local_window: int | None,
                  max_num_seqs: int, max_num_batched_tokens: int) -> PoolSizes:
    """The KV pools `budget_bytes` buys, exactly as the engine allocates them. `bytes_per_token`:
    `kvexport.io.kv_bytes_per_token_by_group` of the build's layers (group -> bytes); `local_window`:
    the local group's window, tokens (the manifest's ``kv.local_window``; None: one group, sized by
    `num_blocks_for_budget`). With a local group, `split_budget` (windowed_kv_cache_manager.py) gives
    it what `max_num_seqs` windows and one step of `max_num_batched_tokens` need, the full group
    the rest. Raises `ConfigError` when the budget holds less than the minimum."""
    if local_window is None:
        assert set(bytes_per_token) == {FULL_GROUP}, bytes_per_token
        n = num_blocks_for_budget(budget_bytes, bytes_per_token[FULL_GROUP], block_size)
        return PoolSizes(block_size, n, None, bytes_per_token[FULL_GROUP] * block_size, 0)
    s = split_budget(budget_bytes, block_size, bytes_per_token[FULL_GROUP], bytes_per_token[LOCAL_GROUP],
                     local_window, max_num_seqs, max_num_batched_tokens)
    return PoolSizes(block_size, s.full_blocks, s.local_blocks, s.full_bytes_per_block, s.local_bytes_per_block)


def available_memory() -> int:
    """Bytes of memory available to new allocations (Linux MemAvailable; else physical)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory()


def physical_memory() -> int:
    """Bytes of physical memory: no KV pool held in host memory can be larger."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_budget(text: str | int) -> int:
    """A KV budget: a size (see `parse_size`) or a percentage of the memory available now,
    e.g. ``"30%"`` (the CPU analogue of a GPU memory-utilisation fraction)."""
    if isinstance(text, str) and text.strip().endswith("%"):
        try:
            pct = float(text.strip()[:-1])
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 90:
            raise ConfigError(f"KV budget {text!r}: a percentage must be in (0, 90]")
        return int(available_memory() * pct / 100)
    return parse_size(text)
