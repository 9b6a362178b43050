"""The runtime's metrics: one table of names, kinds and help texts, read by both front
ends that publish them — `kvexport serve`'s Prometheus `/metrics` (`prometheus_text`) and
the Triton model's custom metrics (triton_model.py), so the two cannot drift apart.
docs/DEPLOYMENT.md lists the same table (`markdown_table`; a test compares them).

Every value comes from the engine thread's `Counters` (the engine's typed `SchedulerStats`,
runtime/core/stats.py, read as they are: no figure is derived again here, and the front ends'
token and request counts) plus one figure the front end counts itself: the requests its clients
cancelled (a closed stream, a disconnected client).
Run `python -m kvexport.runtime.serving.metrics` to print the table for the docs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..core.stats import SpecDecodingStats
    from .engine_thread import Counters

PREFIX = "kvexport_"
GAUGE, COUNTER = "gauge", "counter"


@dataclass(frozen=True, slots=True)
class Metric:
    name: str  # without PREFIX
    kind: str  # GAUGE (may go down) | COUNTER (only grows)
    help: str
    get: Callable[[Counters, int], float]  # (engine-thread counters, cancelled requests) -> value

    @property
    def full_name(self) -> str:
        return PREFIX + self.name


def _spec(c: Counters) -> SpecDecodingStats:
    return c.stats.spec_decoding_or_zero  # all 0 when speculation is off


METRICS: tuple[Metric, ...] = (
    Metric("requests_running", GAUGE, "Sequences being computed", lambda c, _: c.running),
    Metric("requests_waiting", GAUGE, "Sequences waiting for KV blocks or a batch slot", lambda c, _: c.waiting),
    Metric("kv_blocks_used", GAUGE, "KV-cache blocks held by sequences", lambda c, _: c.stats.kv_blocks_used),
    Metric("kv_blocks_total", GAUGE, "Usable KV-cache blocks", lambda c, _: c.stats.kv_blocks_total),
    Metric("kv_cache_usage", GAUGE, "Fraction of KV-cache blocks in use", lambda c, _: c.stats.kv_cache_usage),
    Metric("prefix_cache_hit_rate", GAUGE, "Prefix-cache hits / queries since the start",
           lambda c, _: c.stats.prefix_cache.hit_rate),
    Metric("prefix_cache_queries_total", COUNTER, "Full blocks looked up in the prefix cache",
           lambda c, _: c.stats.prefix_cache.queries),
    Metric("prefix_cache_hits_total", COUNTER, "Full blocks found in the prefix cache",
           lambda c, _: c.stats.prefix_cache.hits),
    Metric("preemptions_total", COUNTER, "Sequences preempted for KV blocks", lambda c, _: c.stats.num_preemptions),
    Metric("context_shifts_total", COUNTER, "Streaming eviction: sequences whose kept KV was recomputed at "
           "max_model_len", lambda c, _: c.stats.num_context_shifts),
    # the KV tiers below the pool (--kv-offload-memory, --kv-offload-dir; runtime/core/kv_tiers.py)
    Metric("kv_offload_host_blocks", GAUGE, "KV blocks kept in the host-memory tier",
           lambda c, _: c.stats.tiers.host_blocks),
    Metric("kv_offload_disk_blocks", GAUGE, "KV blocks kept in the disk tier",
           lambda c, _: c.stats.tiers.disk_blocks),
    Metric("kv_offload_host_hits_total", COUNTER, "Prefix blocks loaded into the pool from host memory",
           lambda c, _: c.stats.tiers.host_hits),
    Metric("kv_offload_disk_hits_total", COUNTER, "Prefix blocks loaded into the pool from disk",
           lambda c, _: c.stats.tiers.disk_hits),
    Metric("kv_offload_host_write_bytes_total", COUNTER, "Bytes copied from the pool into host memory",
           lambda c, _: c.stats.tiers.host_write_bytes),
    Metric("kv_offload_host_read_bytes_total", COUNTER, "Bytes copied from host memory into the pool",
           lambda c, _: c.stats.tiers.host_read_bytes),
    Metric("kv_offload_disk_write_bytes_total", COUNTER, "Bytes written to the disk tier",
           lambda c, _: c.stats.tiers.disk_write_bytes),
    Metric("kv_offload_disk_read_bytes_total", COUNTER, "Bytes read from the disk tier (verified)",
           lambda c, _: c.stats.tiers.disk_read_bytes),
    Metric("kv_offload_load_seconds_total", COUNTER, "Seconds spent loading tier hits (disk reads + copies "
           "into the pool); / kv_offload_loads_total = load latency per block",
           lambda c, _: c.stats.tiers.load_seconds),
    Metric("kv_offload_loads_total", COUNTER, "Blocks loaded into the pool from a tier",
           lambda c, _: c.stats.tiers.loads),
    Metric("kv_offload_disk_errors_total", COUNTER, "Corrupt, truncated or foreign block files refused (recomputed)",
           lambda c, _: c.stats.tiers.disk_errors),
    # a hybrid's recurrent-state checkpoints (runtime/core/state_pool.py): all 0 for other builds
    Metric("state_checkpoints_saved_total", COUNTER, "Hybrids: recurrent-state checkpoints saved at block boundaries",
           lambda c, _: c.stats.state.saved),
    Metric("state_checkpoint_hits_total", COUNTER, "Hybrids: prefix-cache hits resumed from a state checkpoint "
           "(the pool's or a KV tier's)", lambda c, _: c.stats.state.hits),
    Metric("state_checkpoint_tier_hits_total", COUNTER, "Hybrids: state checkpoints loaded from the host or disk "
           "KV tier (also counted in kv_offload_*_hits_total)",
           lambda c, _: c.stats.state.tier_hits),
    # speculative decoding (--speculative; runtime/core/speculation.py): all 0 when it is off
    Metric("spec_decode_drafts_total", COUNTER, "Speculative decoding: decode steps that verified drafts",
           lambda c, _: _spec(c).num_drafts),
    Metric("spec_decode_draft_tokens_total", COUNTER, "Speculative decoding: tokens drafted",
           lambda c, _: _spec(c).num_draft_tokens),
    Metric("spec_decode_accepted_tokens_total", COUNTER, "Speculative decoding: drafted tokens the model accepted",
           lambda c, _: _spec(c).num_accepted_tokens),
    Metric("spec_decode_acceptance_rate", GAUGE, "Speculative decoding: accepted / drafted tokens since the start",
           lambda c, _: _spec(c).acceptance_rate),
    Metric("spec_decode_mean_accepted_length", GAUGE, "Speculative decoding: tokens per verifying step (accepted "
           "drafts + 1) since the start", lambda c, _: _spec(c).mean_accepted_length),
    Metric("spec_decode_step_cost_seconds", GAUGE, "Speculative decoding's step-cost model: a step's fixed seconds "
           "(a of a + b x rows; 0 until fitted)", lambda c, _: _spec(c).step_seconds),
    Metric("spec_decode_row_cost_seconds", GAUGE, "Speculative decoding's step-cost model: seconds per row of a step "
           "(b; a draft is worth it while its expected tokens pay for b)", lambda c, _: _spec(c).row_seconds),
    Metric("generation_tokens_total", COUNTER, "Tokens generated", lambda c, _: c.generation_tokens),
    Metric("prompt_tokens_total", COUNTER, "Prompt tokens received", lambda c, _: c.prompt_tokens),
    Metric("requests_total", COUNTER, "Sequences admitted (n samples count n)", lambda c, _: c.requests),
    Metric("requests_cancelled_total", COUNTER,
           "Sequences stopped because the client cancelled or went away (n samples count n)",
           lambda _, cancelled: cancelled),
)
NAMES = tuple(m.full_name for m in METRICS)


def values(counters: Counters, cancelled: int) -> list[tuple[Metric, float]]:
    """Every metric with its current value."""
    return [(m, float(m.get(counters, cancelled))) for m in METRICS]


def prometheus_text(counters: Counters, cancelled: int) -> str:
    """The Prometheus text exposition format (version 0.0.4) of every metric."""
    return "".join(f"# HELP {m.full_name} {m.help}\n# TYPE {m.full_name} {m.kind}\n{m.full_name} {_num(v)}\n"
                   for m, v in values(counters, cancelled))


def _num(v: float) -> str:
    return str(int(v)) if v.is_integer() else repr(v)


def markdown_table() -> str:
    """The table as docs/DEPLOYMENT.md lists it."""
    rows = ["| metric | kind | what |", "|---|---|---|"]
    rows += [f"| `{m.full_name}` | {m.kind} | {m.help} |" for m in METRICS]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
