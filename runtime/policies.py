"""Which scheduler policies an engine runs: its settings (runtime/config.py EngineConfig) read
against its build. `policies_for` makes each policy with the factory beside its implementation and
refuses, naming the setting, what the build cannot serve; `check_before_load` refuses what can be
told from the manifest alone, before any session loads. The policies' interfaces are
core/policies.py; this module only chooses them.

    kv_eviction  streaming    ─▶ StreamingWindow (core/streaming.py; SchedulerConfig.streaming)
                 snapkv / h2o ─▶ ImportanceEviction (core/importance.py importance_policy)
    speculative  ngram / draft ─▶ SpeculativeDecoding + the Drafter that proposes for it (speculative.py)
    hybrid build (linear attention) ─▶ the recurrent state's spec beside the attention groups' (core/
                 kv_cache_coordinator.py coordinator_for, where the KV managers are made); the settings it
                 cannot serve: refused here
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvexport import io
from kvexport.errors import ConfigError, KvExportError
from kvexport.manifest import Manifest

from .config import EngineConfig
from .core import state_pool
from .core.importance import ImportanceEviction, importance_policy
from .core.speculation import SpeculativeDecoding
from .core.streaming import StreamingWindow, check_model, streaming_window
from .execution.proposers import Drafter
from .speculative import drafter_for, speculation_policy


@dataclass(frozen=True, slots=True)
class EnginePolicies:
    """The policies an engine's settings ask for; None: off (the scheduler's default policy)."""

    streaming: StreamingWindow | None = None  # kv_eviction "streaming": sinks + a recent window
    importance: ImportanceEviction | None = None  # kv_eviction "snapkv" / "h2o": attention-scored, within a budget
    speculation: SpeculativeDecoding | None = None  # speculative "ngram" / "draft": budgets, verifies, rolls back
    drafter: Drafter | None = None  # speculation's proposer, run by the model runner after each step's forward


def check_before_load(build_dir: Path, manifest: Manifest, config: EngineConfig) -> None:
    """Refuse what the manifest alone shows this engine cannot serve: a contiguous build
    (KvExportError), a setting a hybrid build cannot serve yet (ConfigError naming it). Called
    before the sessions load and the disk tier's folder is taken."""
    if manifest.kv.layout != io.KVLayout.PAGED.value:
        raise KvExportError(f"the runtime serves paged builds; {build_dir} has layout {manifest.kv.layout!r}: "
                            f"rebuild it with `kvexport build MODEL --layout paged`")
    if state_pool.is_hybrid(manifest.model.spec) and (why := state_pool.refusal(config)) is not None:
        raise ConfigError(why)


def policies_for(build_dir: Path, manifest: Manifest, config: EngineConfig, *, max_model_len: int,
                 pool_tokens: int) -> EnginePolicies:
    """The policies of `config` for this build. `max_model_len`: tokens per sequence served;
    `pool_tokens`: tokens the full-attention KV pool holds (streaming's window must fit it)."""
    streaming = (_streaming(build_dir, manifest, config, max_model_len, pool_tokens)
                 if config.kv_eviction == "streaming" else None)
    speculation = speculation_policy(build_dir, manifest, config)
    drafter = drafter_for(build_dir, manifest, config, speculation)  # opens and checks a draft model
    return EnginePolicies(streaming, importance_policy(build_dir, manifest, config, max_model_len), speculation,
                          drafter)


def _streaming(build_dir: Path, manifest: Manifest, config: EngineConfig, max_model_len: int,
               pool_tokens: int) -> StreamingWindow:
    """The streaming eviction policy for this build and pool (core/streaming.py); refuses what it cannot serve."""
    model, kv = manifest.model, manifest.kv
    if manifest.layer_groups is not None:
        raise ConfigError(f"--kv-eviction streaming: {build_dir} has a windowed-layer KV cache group "
                          f"(window {kv.local_window}), which already bounds those layers' KV; serve it with "
                          f"--kv-eviction none")
    check_model(windows=model.layer_windows, ropes=[r for r in (model.spec.get("rope"), model.spec.get("rope_local"))
                                                    if isinstance(r, dict)], max_model_len=max_model_len)
    return streaming_window(sink_tokens=config.kv_sink_tokens, recent_tokens=config.kv_recent_tokens,
                            block_size=kv.block_size, max_model_len=max_model_len, pool_tokens=pool_tokens,
                            max_num_batched_tokens=config.max_num_batched_tokens)


__all__ = ["EnginePolicies", "check_before_load", "policies_for"]
