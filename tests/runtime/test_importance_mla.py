"""Importance eviction (--kv-eviction snapkv, runtime/core/importance.py) on a tiny random DeepSeek-V3
build (MLA: one latent pool row per token) whose kvexport::PagedMLA nodes return attention scores
(plugins/paged_mla/spec.py "Attention scores", the native CPU op): the build declares them with one
"KV head" per layer; with a budget at least the prompt the greedy tokens equal the full cache's;
a small budget releases the prompt's blocks to it; and the `onnx` MLA form does not declare scores,
so eviction on it is refused saying how to rebuild."""

from __future__ import annotations

import pytest

from kvexport import io
from kvexport import manifest as mf
from kvexport.errors import ConfigError
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.llm import LLM
from kvexport.runtime.sampling_params import SamplingParams
from testkit.parity import random_prompts

BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, hf_folder, cpu_op):
    out, _ = build(str(hf_folder("deepseek_v3")), tmp_path_factory.mktemp("imp-mla") / "mla",
                   BuildOptions(block_size=BS, max_seq_len=128, validate=False, attention=io.Attention.PLUGIN))
    return out


def _llm(build_dir, **kw):
    return LLM(build_dir, kv_cache_memory="4MiB", max_num_batched_tokens=64, max_num_seqs=8, **kw)


def _tokens(llm, prompts, n):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))]


def test_mla_build_declares_scores_per_latent_layer(tiny):
    m = mf.load(tiny)
    assert m.kv.attention_scores and m.kv.latent and m.kv.attention == io.Attention.PLUGIN.value
    for phase in ("prefill", "decode"):
        g = m.graphs[phase]
        assert g.inputs[-1].name == io.OBSERVATION_LENS
        scores = [t for t in g.outputs if t.name.startswith("attention_scores.")]
        assert len(scores) == m.kv.num_layers
        assert all(t.shape == (io.NUM_SEQS, 1, io.SCORE_LEN) for t in scores)


def test_budget_at_least_the_prompt_equals_the_full_cache(tiny):
    prompts = random_prompts(4, 128, 30, 60, seed=2)
    full = _tokens(_llm(tiny), prompts, 8)
    llm = _llm(tiny, kv_eviction="snapkv", kv_budget_tokens=128, kv_observation_tokens=8, kv_recent_tokens=8)
    assert _tokens(llm, prompts, 8) == full
    assert llm.engine.pool.num_used_blocks == 0


def test_small_budget_releases_blocks(tiny):
    llm = _llm(tiny, kv_eviction="snapkv", kv_budget_tokens=24, kv_observation_tokens=8, kv_recent_tokens=8)
    eng = llm.engine
    prompt = random_prompts(1, 128, 80, 81, seed=9)[0]
    got = {}

    def run(out, _run=eng.runner.execute):
        result = _run(out)
        got.update(result.attention_scores)
        return result

    eng.runner.execute = run
    rid = eng.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while not got:  # chunked prefill: the step that completes the prompt is scored
        eng.step()
    # the prompt's 80 tokens (20 blocks) are down to the 24-token budget (6 blocks) + the block being written
    assert eng.pool.num_used_blocks <= 24 // BS + 1
    (scores,) = got.values()
    assert scores.shape[0] == 1 and scores.shape[-1] >= 80  # [kv_heads = 1, positions]
    while eng.has_unfinished():
        eng.step()
    assert len(eng.pop_output(rid).token_ids) == 4


def test_onnx_mla_build_is_refused(hf_folder, tmp_path_factory):
    from kvexport.runtime.config import EngineConfig
    from kvexport.runtime.core.importance import importance_policy

    out, _ = build(str(hf_folder("deepseek_v3")), tmp_path_factory.mktemp("imp-mla") / "onnx",
                   BuildOptions(block_size=BS, max_seq_len=64, validate=False, attention=io.Attention.ONNX))
    m = mf.load(out)
    assert not m.kv.attention_scores
    with pytest.raises(ConfigError, match="does not return attention scores.*--attention plugin"):
        importance_policy(out, m, EngineConfig(kv_eviction="snapkv", kv_budget_tokens=32), 64)
