"""The host and disk KV tiers on a hybrid (gated DeltaNet) build: its recurrent-state checkpoints go
to the tiers with their KV blocks (io.STATE_GROUP), so a prompt whose blocks and checkpoint the pool
evicted resumes from the host tier, from the disk tier, and from the disk tier after a restart, with
the tokens recomputation gives. Real engines on a tiny random qwen3_5_text build (4-token blocks, a
pool of 15 blocks and 2 checkpoint slots, so other prompts push the first one out)."""

from pathlib import Path

import pytest

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.engine import LLMEngine
from kvexport.runtime.sampling_params import SamplingParams

GEN = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT = [3 + (i * 7) % 120 for i in range(30)]  # 7 full blocks a lookup can hit (28 tokens)
OTHERS = [[5 + (i * 11 + k * 13) % 110 for i in range(30)] for k in range(6)]
SMALL = dict(kv_cache_memory="16KiB", max_num_seqs=1, state_checkpoints=2, state_checkpoint_blocks=2)


@pytest.fixture(scope="module")
def hybrid(hf_folder, tmp_path_factory):
    out, _ = build(str(hf_folder("qwen3_5_text")), tmp_path_factory.mktemp("hyb-tiers") / "b",
                   BuildOptions(block_size=4, max_seq_len=128, validate=False))
    return out


@pytest.fixture(scope="module")
def want(hybrid):
    """PROMPT's greedy tokens, recomputed (no prefix caching)."""
    return _run(LLMEngine(hybrid, EngineConfig(kv_cache_memory="1MiB", enable_prefix_caching=False)), PROMPT).token_ids


def _run(engine: LLMEngine, prompt):
    rid = engine.add_request(list(prompt), GEN)
    while engine.has_unfinished():
        engine.step()
    return engine.pop_output(rid)


def _push_out(engine: LLMEngine) -> None:
    """Other prompts fill the pool and the checkpoint slots: PROMPT's blocks and checkpoints are evicted."""
    for p in OTHERS:
        _run(engine, p)
    assert engine.kv_connector.scheduler.cached(io.FULL_GROUP, engine.kv_connector.prompt_blocks(PROMPT)[0][2]) \
        is None, "PROMPT's first block left the pool"


def test_a_checkpoint_resumes_from_the_host_tier(hybrid, want):
    engine = LLMEngine(hybrid, EngineConfig(**SMALL, kv_offload_memory="16MiB"))
    assert engine.kv_connector.block_bytes[io.STATE_GROUP] == engine.backend.state.bytes_per_slot
    assert _run(engine, PROMPT).token_ids == want
    _push_out(engine)
    again = _run(engine, PROMPT)
    assert again.token_ids == want
    assert again.num_cached_prompt_tokens == 28  # 7 blocks and the state after them, from host memory
    assert engine.kv.state.tier_hits == 1 and engine.stats().tiers.host_hits == 8  # 7 KV + 1 state
    stats = engine.stats().state  # /metrics: kvexport_state_checkpoint_*
    assert stats.tier_hits == 1 and stats.hits == 1
    assert stats.saved > 2  # more than the pool's 2 slots hold: the rest went to the tier


def test_without_tiers_the_evicted_prompt_is_recomputed(hybrid, want):
    """The control: the same traffic with no tier finds nothing (so the hit above is the tier's)."""
    engine = LLMEngine(hybrid, EngineConfig(**SMALL))
    _run(engine, PROMPT)
    _push_out(engine)
    again = _run(engine, PROMPT)
    assert again.token_ids == want and again.num_cached_prompt_tokens == 0


def test_a_checkpoint_resumes_from_the_disk_tier_and_after_a_restart(hybrid, want, tmp_path):
    cfg = EngineConfig(**SMALL, kv_offload_dir=str(tmp_path / "kv"), kv_offload_disk="1MiB")
    engine = LLMEngine(hybrid, cfg)
    _run(engine, PROMPT)
    _push_out(engine)
    again = _run(engine, PROMPT)  # read from disk off the step (the request waits), then loaded
    assert again.token_ids == want and again.num_cached_prompt_tokens == 28
    assert engine.kv.state.tier_hits == 1 and engine.stats().tiers.disk_hits == 8
    engine.close()
    names = {p.name.split("-")[0] for p in (tmp_path / "kv" / "blocks").iterdir()}
    assert names == {io.FULL_GROUP, io.STATE_GROUP}  # checkpoints are files beside the blocks
    restarted = LLMEngine(hybrid, cfg)
    after = _run(restarted, PROMPT)
    assert after.token_ids == want and after.num_cached_prompt_tokens == 28
    assert restarted.kv.state.tier_hits == 1


def test_a_host_tier_smaller_than_a_checkpoint_is_refused_by_name(hybrid):
    with pytest.raises(ConfigError, match="kv_offload_memory '2048' holds no KV block or state checkpoint"):
        LLMEngine(hybrid, EngineConfig(**SMALL, kv_offload_memory="2048"))
