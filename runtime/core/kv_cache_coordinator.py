"""The KV cache coordinator (issue 43 §2, vLLM v1's `kv_cache_coordinator.py`): the one object behind
KVCacheManagerProtocol that an engine's scheduler, KV connector and tiers see, over one manager per
cache spec of the build:

    spec                                  manager
    full attention (one group)            KVCacheManager            (kv_cache_manager.py)
    full + sliding-window attention       WindowedKVCacheManager    (windowed_kv_cache_manager.py)
      (two groups sharing the tables' hits)
    MLA latent                            KVCacheManager (a latent row per token: io.KV_FORMS)
    recurrent / conv state (gated         RecurrentStateManager     (state_manager.py, slots and
      DeltaNet, short conv: a hybrid)                                checkpoints from state_pool.py)

Calls that only the attention groups answer (tables, slots, tiers' ops, window and importance frees)
go to the attention manager; calls where the specs meet are made here, in one order:

    get_computed_blocks   attention's hit, cut by the state to a checkpoint it holds (the longest hit
                          every spec can resume from, as vLLM's find_longest_cache_hit)
    allocate_slots        state slot (admit) ─▶ attention blocks ─▶ state resumes (or both undone)
    cache_blocks / free   both specs
    clip_chunk / state_step   the state's (attention-only builds: n, None)

The scheduler never asks which specs a build has; it only calls the protocol.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvexport.io import FULL_GROUP

from .block_hash import BlockHash
from .block_pool import BlockPool
from .kv_cache_manager import GroupBlocks
from .kv_tiers import TierEvents, TierOp
from .state_manager import RecurrentStateManager
from .state_pool import CheckpointPool, StatePool, StateStep, refusal
from .stats import StateCheckpointStats


class KVCacheCoordinator:
    """`attention`: the attention groups' manager (KVCacheManager or WindowedKVCacheManager);
    `state`: the recurrent state's (None: the build has none)."""

    def __init__(self, attention: Any, state: RecurrentStateManager | None = None):
        self.attention, self.recurrent = attention, state

    # ---- the attention groups' alone -----------------------------------------------------
    @property
    def pool(self) -> BlockPool:
        return self.attention.pool

    @property
    def block_size(self) -> int:
        return self.attention.block_size

    @property
    def tiers(self) -> Any:
        return self.attention.tiers

    @property
    def usage(self) -> float:
        return self.attention.usage

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.attention

    def num_slots(self, request_id: str) -> int:
        return self.attention.num_slots(request_id)

    def block_table(self, request_id: str) -> list[int]:
        return self.attention.block_table(request_id)

    def slot_mapping(self, request_id: str, start_pos: int, num_tokens: int) -> list[int]:
        return self.attention.slot_mapping(request_id, start_pos, num_tokens)

    def extra_groups(self, request_id: str, start_pos: int, num_tokens: int) -> tuple[GroupBlocks, ...]:
        return self.attention.extra_groups(request_id, start_pos, num_tokens)

    def take_tier_ops(self) -> tuple[TierOp, ...]:
        return self.attention.take_tier_ops()

    def apply_tier_events(self, events: TierEvents) -> None:
        self.attention.apply_tier_events(events)

    def free_outside_window(self, request_id: str, num_computed_tokens: int, window: int,
                            keep_first: int = 0) -> list[int]:
        return self.attention.free_outside_window(request_id, num_computed_tokens, window, keep_first)

    def release_blocks(self, request_id: str, indices: Sequence[int]) -> list[int]:
        return self.attention.release_blocks(request_id, indices)

    # ---- where the specs meet -------------------------------------------------------------
    def get_computed_blocks(self, request_tokens: Sequence[int], salt: str | None = None):
        st = self.recurrent
        if st is None:
            return self.attention.get_computed_blocks(request_tokens, salt)
        if not st.interval:  # no checkpoints: a hybrid resumes from nothing
            return self.attention.get_computed_blocks((), salt)
        return st.cut_hit(self.attention.get_computed_blocks(request_tokens, salt))

    def prefetch_tier_hits(self, computed) -> bool:
        wait = self.attention.prefetch_tier_hits(computed)
        return (self.recurrent is not None and self.recurrent.prefetch(computed)) or wait

    def allocate_slots(self, request_id: str, num_new_tokens: int, computed_blocks=None) -> list[int] | None:
        st = self.recurrent
        if st is None:
            return self.attention.allocate_slots(request_id, num_new_tokens, computed_blocks)
        taken = st.admit(request_id, computed_blocks)
        if taken is None:
            return None  # no state slot free: like no blocks
        got = self.attention.allocate_slots(request_id, num_new_tokens, computed_blocks)
        if got is None:
            st.unadmit(request_id, computed_blocks, taken)
            return None
        st.admitted(request_id, computed_blocks, taken)
        return got

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        self.attention.cache_blocks(request_id, token_ids, num_computed_tokens)
        if self.recurrent is not None:
            self.recurrent.publish(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        self.attention.free(request_id)
        if self.recurrent is not None:
            self.recurrent.free(request_id)

    def clip_chunk(self, start: int, n: int, prompt_len: int, request_id: str | None = None) -> int:
        return n if self.recurrent is None else self.recurrent.clip_chunk(start, n, prompt_len, request_id)

    def state_step(self, request_id: str, start: int, n: int, tokens: Sequence[int],
                   prompt_len: int) -> StateStep | None:
        return None if self.recurrent is None else self.recurrent.state_step(request_id, start, n, tokens, prompt_len)

    # ---- the recurrent state, for the engine and the connector ----------------------------
    @property
    def state(self) -> StatePool | None:
        """The recurrent state's slot pool (None: no such spec)."""
        return self.recurrent.pool if self.recurrent is not None else None

    @property
    def checkpoints(self) -> CheckpointPool | None:
        """The state checkpoints as the KV connector's io.STATE_GROUP pool (None: no such spec)."""
        return self.recurrent.checkpoints if self.recurrent is not None else None

    def state_stats(self) -> StateCheckpointStats:
        return self.recurrent.stats() if self.recurrent is not None else StateCheckpointStats()


def coordinator_for(attention: Any, model_spec: dict, config: Any) -> KVCacheCoordinator:
    """The engine's coordinator for a build: `attention`'s groups, and for a build with recurrent state
    (the manifest's model.linear_attn) a RecurrentStateManager of max_num_seqs running slots and
    state_checkpoints checkpoint slots (none without prefix caching, or with state_checkpoint_blocks /
    state_checkpoints 0). A setting such a build cannot serve yet is refused (state_pool.refusal)."""
    from kvexport.errors import ConfigError

    if model_spec.get("linear_attn") is None:
        return KVCacheCoordinator(attention)
    if (why := refusal(config)) is not None:
        raise ConfigError(why)
    every = config.state_checkpoint_blocks if config.enable_prefix_caching and config.state_checkpoints else 0
    pool = StatePool(config.max_num_seqs, config.state_checkpoints if every else 0)
    tiers = attention.tiers

    def kv_held(key: BlockHash) -> bool:
        """The attention block a checkpoint ends is held (the pool, a KV tier): else no hit, not worth a copy."""
        return attention.pool.get_cached_block(key) is not None or (
            tiers is not None and tiers.where((FULL_GROUP, key)) is not None)

    return KVCacheCoordinator(attention, RecurrentStateManager(pool, attention.block_size, every, tiers, kv_held))


__all__ = ["KVCacheCoordinator", "coordinator_for"]
