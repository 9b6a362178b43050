"""The one interface of the KV cache managers, as the scheduler uses it: a request's block
table and slots, prefix hits, growth, caching and release. Implemented by the attention managers
`KVCacheManager` (one KV cache group, runtime/core/kv_cache_manager.py) and
`WindowedKVCacheManager` (a full and a local group, runtime/core/windowed_kv_cache_manager.py), the
attention specs' managers; an engine's scheduler gets the `KVCacheCoordinator` over them and, for a
hybrid, the recurrent state's (runtime/core/kv_cache_coordinator.py).

NOTE: running out of blocks returns ``None`` from `allocate_slots` (the scheduler preempts
or waits); a call out of protocol (unknown request, double free) raises `KVCacheError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, TypeVar

from .block_pool import BlockPool
from .kv_cache_manager import GroupBlocks
from .kv_tiers import TierEvents, TierOp

if TYPE_CHECKING:
    from .state_pool import StateStep


class ComputedHits(Protocol):
    """What `get_computed_blocks` found for a prompt; passed unchanged to `allocate_slots`."""

    @property
    def num_computed_tokens(self) -> int: ...  # prompt tokens already held by cached blocks


C = TypeVar("C", bound=ComputedHits)


class KVCacheManagerProtocol(Protocol[C]):
    pool: BlockPool  # the full group's pool: sequences are sized by it, the engine reports it
    block_size: int  # tokens per block

    def __contains__(self, request_id: object) -> bool: ...

    @property
    def usage(self) -> float: ...  # fraction of usable blocks held, in [0, 1]

    def num_slots(self, request_id: str) -> int: ...  # tokens the request has slots for

    def block_table(self, request_id: str) -> list[int]: ...  # the full group's table (a copy)

    def slot_mapping(self, request_id: str, start_pos: int, num_tokens: int) -> list[int]: ...

    def extra_groups(self, request_id: str, start_pos: int, num_tokens: int) -> tuple[GroupBlocks, ...]: ...

    def get_computed_blocks(self, request_tokens: Sequence[int], salt: str | None = None) -> C: ...

    def allocate_slots(self, request_id: str, num_new_tokens: int,
                       computed_blocks: C | None = None) -> list[int] | None: ...

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None: ...

    def free(self, request_id: str) -> None: ...

    # KV tiers below the pool (runtime/core/kv_tiers.py); managers without tiers find nothing there
    def prefetch_tier_hits(self, computed_blocks: C) -> bool: ...  # True: wait for disk reads first

    def take_tier_ops(self) -> tuple[TierOp, ...]: ...  # this step's transfers, for SchedulerOutput.kv_ops

    def apply_tier_events(self, events: TierEvents) -> None: ...

    def free_outside_window(self, request_id: str, num_computed_tokens: int, window: int,
                            keep_first: int = 0) -> list[int]: ...

    def release_blocks(self, request_id: str, indices: Sequence[int]) -> list[int]: ...  # importance eviction

    # per-sequence state beside the KV (a hybrid's recurrent state: core/state_manager.py, through the
    # coordinator); the attention managers return n and None
    def clip_chunk(self, start: int, n: int, prompt_len: int, request_id: str | None = None) -> int: ...  # a chunk
    # [start, start + n) of a prompt cut where the state must be checkpointed

    def state_step(self, request_id: str, start: int, n: int, tokens: Sequence[int],
                   prompt_len: int) -> StateStep | None: ...  # the chunk's state slot, restore and checkpoint
