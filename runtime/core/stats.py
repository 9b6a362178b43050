"""The engine's statistics, typed (vLLM v1's `metrics/stats.py` `SchedulerStats` and
`spec_decode/metrics.py` `SpecDecodingStats`): frozen snapshots, each figure with its unit.

    Scheduler.stats(tiers, state) ──▶ SchedulerStats ──▶ LLMEngine.stats() ──▶ every reader
      pool: blocks, prefix cache       .tiers            KVTierStats          /metrics and Triton's metrics
      queues, preemptions, shifts      .state            StateCheckpointStats    (serving/metrics.py, through
      speculation policy               .spec_decoding    SpecDecodingStats       EngineThread.Counters),
      (KVConnector.tier_stats, StatePool.stats: what the scheduler cannot see)   bench, Dynamo, Triton, tests

One producer: `Scheduler.stats()` (called by `LLMEngine.stats()`, which adds the KV connector's tier
figures and a hybrid's checkpoint counts). Readers take the figures as they are; a ratio
(acceptance rate, mean accepted length, hit rate, load time per block) is a property here,
computed in this one place, never again by a reader. Counters are since the engine started;
gauges (blocks held, usage, queue lengths) are as of the call.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_pool import PrefixCacheStats


@dataclass(frozen=True, slots=True)
class KVTierStats:
    """The KV tiers below the pool (core/kv_tiers.py index, execution/kv_offload.py bytes); all 0
    without tiers."""

    host_blocks: int = 0  # blocks held in host memory now (blocks)
    disk_blocks: int = 0  # blocks held on disk now (blocks)
    host_hits: int = 0  # blocks loaded into the pool from host memory (blocks)
    disk_hits: int = 0  # blocks loaded into the pool from disk: read, staged, loaded (blocks)
    host_write_bytes: int = 0  # pool -> host memory (bytes)
    host_read_bytes: int = 0  # host memory -> pool (bytes)
    disk_write_bytes: int = 0  # -> disk files (bytes)
    disk_read_bytes: int = 0  # disk files -> staging, verified (bytes)
    load_seconds: float = 0.0  # loading tier hits: disk reads + copies into the pool (seconds)
    loads: int = 0  # blocks loaded into the pool from a tier (blocks)
    disk_errors: int = 0  # block files refused: corrupt, truncated, foreign, torn, too slow (files)
    disk_on: bool = False  # the disk tier is configured and has not been turned off

    @property
    def load_seconds_per_block(self) -> float | None:
        """Load latency per block (seconds); None before the first load."""
        return self.load_seconds / self.loads if self.loads else None


@dataclass(frozen=True, slots=True)
class StateCheckpointStats:
    """A hybrid's recurrent-state checkpoints (core/state_pool.py); all 0 for other builds."""

    saved: int = 0  # checkpoints saved at block boundaries (checkpoints)
    hits: int = 0  # prefix-cache hits resumed from a checkpoint, the pool's or a tier's (checkpoints)
    tier_hits: int = 0  # of those, loaded from the host or disk KV tier (checkpoints)


@dataclass(frozen=True, slots=True)
class SpecDecodingStats:
    """Speculative decoding (core/speculation.py): what was drafted and accepted, and the
    step-cost model's fit."""

    num_drafts: int = 0  # verification steps: decode steps that carried drafts (steps)
    num_draft_tokens: int = 0  # tokens drafted (tokens)
    num_accepted_tokens: int = 0  # drafted tokens the target accepted (tokens)
    # [k]: drafts accepted at draft position 0..k-1 (tokens); position j counts only when 0..j-1 were
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    step_seconds: float = 0.0  # the cost model's fixed seconds per step, a of a + b x rows (seconds; 0: not fitted)
    row_seconds: float = 0.0  # the cost model's seconds per row of a step, b (seconds; 0: not fitted)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens, 0..1 (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step emitted on average: its accepted drafts + the target's token
        (0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_json(self) -> dict:
        """The bench's "speculative" figures."""
        return {"num_drafts": self.num_drafts, "draft_tokens": self.num_draft_tokens,
                "accepted_tokens": self.num_accepted_tokens, "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_accepted_length": round(self.mean_accepted_length, 4)}


NO_SPEC_DECODING = SpecDecodingStats()  # what a reader shows when speculation is off: all 0


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """One snapshot of the engine: queues, the full group's KV pool and prefix cache,
    preemption and eviction counts, the tiers, checkpoints and speculation."""

    num_running: int = 0  # requests holding KV blocks (requests)
    num_waiting: int = 0  # requests queued for admission, new or preempted (requests)
    running_computed_tokens: tuple[tuple[str, int], ...] = ()  # (request id, tokens whose KV is stored)
    kv_blocks_used: int = 0  # blocks held by requests; evictable cached blocks count as free (blocks)
    kv_blocks_total: int = 0  # usable blocks of the pool, the pad block excluded (blocks)
    kv_cache_usage: float = 0.0  # kv_blocks_used / kv_blocks_total (fraction, 0..1)
    prefix_cache: PrefixCacheStats = PrefixCacheStats(0, 0, 0)  # queries, hits, evictions (blocks)
    num_preemptions: int = 0  # requests preempted for KV blocks (preemptions)
    num_context_shifts: int = 0  # streaming eviction: kept KV recomputed at max_model_len (shifts)
    tiers: KVTierStats = KVTierStats()
    state: StateCheckpointStats = StateCheckpointStats()
    spec_decoding: SpecDecodingStats | None = None  # None: speculation is off

    @property
    def spec_decoding_or_zero(self) -> SpecDecodingStats:
        """`spec_decoding`, or all 0 when speculation is off (what /metrics exports then)."""
        return self.spec_decoding if self.spec_decoding is not None else NO_SPEC_DECODING


__all__ = ["KVTierStats", "NO_SPEC_DECODING", "PrefixCacheStats", "SchedulerStats", "SpecDecodingStats",
           "StateCheckpointStats"]
