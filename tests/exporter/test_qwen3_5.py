"""Gated DeltaNet hybrids (qwen3_5_text, qwen3_next: exporter/linear_attention.py) against transformers
on tiny random models (tests/testkit/families.py CASES_HYBRID: 3 linear : 1 gated full-attention layer,
GQA in both): the spec read from config.json, fp32 parity of the paged `onnx` build (greedy identical,
|Δ logits| within the fp32 bound), served by the runtime with the recurrent state in a state pool:
batching, chunked prefill (state carried from chunk to chunk), a long prompt run as several 64-token
chunks of the chunked rule in one step, preemption by recompute, prefix caching resuming from a state
checkpoint with the same tokens as recomputation; and the refusals (layer types, state dims, layouts
and engine features a hybrid cannot carry yet). Quantized KV: test_qwen3_5_quantized_kv.py."""

import json

import pytest

from kvexport import LLM, SamplingParams, io
from kvexport.errors import ConfigError, UnsupportedModelError
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import read_spec
from kvexport.exporter.validate import TOLERANCE
from testkit import parity
from testkit.families import BUILDS_PAGED_ONNX, CASES_HYBRID, tiny_config


@pytest.fixture(scope="module")
def built(hf_folder, tmp_path_factory):
    """family -> (build dir, manifest, transformers model): one validated paged `onnx` build per family
    (max_seq_len 256: long prompts run several chunks of the chunked rule; the `plugin` form, the default,
    is test_qwen3_5_plugin.py's)."""
    cache = {}

    def get(family):
        if family not in cache:
            src = hf_folder(family, **CASES_HYBRID[family])
            out, m = build(str(src), tmp_path_factory.mktemp("hybrid") / family,
                           BuildOptions(block_size=4, max_seq_len=256, attention=io.Attention.ONNX))
            cache[family] = (out, m, source.load_model(source.resolve(str(src))))
        return cache[family]

    return get


@pytest.mark.parametrize("family", CASES_HYBRID)
def test_spec_reads_the_hybrid(hf_folder, family):
    spec = read_spec(source.load_config(source.resolve(str(hf_folder(family, **CASES_HYBRID[family])))))
    la = spec.linear_attn
    assert la.layers == (0, 1, 2) and spec.kv_layers == (3,)
    assert (la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim, la.conv_kernel) == (2, 4, 8, 12, 4)
    assert la.conv_dim == 2 * 2 * 8 + 4 * 12 and spec.attn_output_gate and spec.norm_offset == 1.0
    assert spec.rotary_dim == 4  # partial_rotary_factor 0.25 of head_dim 16
    assert (spec.moe is not None) == (family == "qwen3_next")


@pytest.mark.parametrize("family,layout,attention", [(f, lay, att) for f in CASES_HYBRID for lay, att in BUILDS_PAGED_ONNX])
def test_parity_fp32(built, family, layout, attention):
    out, m, _ = built(family)
    assert (m.kv.layout, m.kv.attention) == (layout, attention)
    v = m.validation
    assert v.passed and v.greedy_identical, v
    assert v.max_abs_diff <= TOLERANCE["fp32"] and v.steps == 16
    # the graphs' I/O: KV pools of the attention layer only, state pools of the three linear layers
    names = [t.name for t in m.graphs["prefill"].inputs]
    assert [n for n in names if "cache" in n] == ["key_cache.3", "value_cache.3"]
    assert [n for n in names if "state" in n] == [io.STATE_SLOTS] + io.state_names(3)
    shapes = {t.name: t.shape for t in m.graphs["decode"].outputs}
    assert shapes["new_recurrent_state.2"] == (io.NUM_SEQS, 4, 8, 12) and shapes["new_conv_state.0"] == (io.NUM_SEQS, 3, 80)
    assert "linear_attn" in json.loads((out / io.MANIFEST_NAME).read_text())["model"]


def test_served_batched_chunked_preempted(built):
    """6 prompts of 10..30 tokens in 8-token chunks on 14 usable 4-token blocks: batching, state carried
    across chunks, preemptions (recompute from a zero state); then one 150-token prompt in a single step
    (three 64-token chunks of the chunked rule) beside short ones. Tokens equal transformers' greedy ones."""
    llm, _ = parity.check_hybrid_served(*built("qwen3_5_text"))
    assert llm.engine.pool.num_usable_blocks == 14
    assert llm.engine.pool.num_used_blocks == 0 and not llm.engine.kv.state._by_request  # slots freed


def test_prefix_cache_resumes_from_a_state_checkpoint(built):
    """Prompts sharing a 27-token prefix, served one at a time with a checkpoint every 2 blocks (8 tokens):
    later prompts resume from the checkpoint at 24 tokens (the nearest below their shared prefix), and their
    tokens equal both recomputation (no prefix caching) and transformers'."""
    out, _, model = built("qwen3_5_text")
    prefix = parity.random_prompts(1, 128, 27, 28, seed=5)[0]
    prompts = parity.random_prompts(4, 128, 2, 9, seed=2, prefix=prefix)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    llm = LLM(out, kv_cache_memory="1MiB", max_num_seqs=1, state_checkpoint_blocks=2, state_checkpoints=8)
    got = llm.generate(prompts, params)
    state = llm.engine.kv.state
    assert state.hits == 3 and state.saved >= 3
    assert [o.num_cached_prompt_tokens for o in got] == [0, 24, 24, 24]
    again = LLM(out, kv_cache_memory="1MiB", max_num_seqs=1, enable_prefix_caching=False).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in again] == parity.hf_greedy(model, prompts, 10)


def test_refusals(hf_folder, built, tmp_path):
    make = lambda **kw: read_spec(tiny_config("qwen3_5_text", **kw))  # noqa: E731
    with pytest.raises(UnsupportedModelError, match="'layer_types' has 'sliding_attention'"):
        make(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"])
    with pytest.raises(UnsupportedModelError, match="'layer_types' lists no full_attention layer"):
        make(layer_types=["linear_attention"] * 4)
    with pytest.raises(ConfigError, match="'linear_num_value_heads' \\(3\\) must be a multiple of "
                                          "'linear_num_key_heads'.*inconsistent state dims"):
        make(linear_num_value_heads=3)
    with pytest.raises(UnsupportedModelError, match="'hidden_act' is 'gelu'"):
        make(hidden_act="gelu")
    src = str(hf_folder("qwen3_5_text", **CASES_HYBRID["qwen3_5_text"]))
    with pytest.raises(UnsupportedModelError, match="--layout contiguous"):  # quantized KV: its own module
        build(src, tmp_path / "x", BuildOptions(block_size=4, max_seq_len=64, validate=False,
                                                layout=io.KVLayout.CONTIGUOUS))
    out, _, _ = built("qwen3_5_text")
    with pytest.raises(ConfigError, match="kv_eviction 'streaming' cannot run on a hybrid"):
        LLM(out, kv_cache_memory="1MiB", kv_eviction="streaming")
    with pytest.raises(ConfigError, match="speculative 'ngram' cannot run on a hybrid"):
        LLM(out, kv_cache_memory="1MiB", speculative="ngram")


def test_plan_counts_state_per_sequence_and_kv_of_the_attention_layers(hf_folder):
    """`kvexport plan`: the recurrent state is constant per sequence (3 linear layers x (3 x 80 conv inputs +
    4 x 8 x 12 state) x 4 bytes), the KV per token is layer 3's only (2 x 2 heads x 16 x 4 bytes in fp32)."""
    from kvexport.exporter.plan import plan

    p = plan(str(hf_folder("qwen3_5_text", **CASES_HYBRID["qwen3_5_text"])), max_model_len=128)
    assert (p.state_bytes_per_seq, p.linear_layers) == (3 * (3 * 80 + 4 * 8 * 12) * 4, 3)
    fp32 = next(k for k in p.kv if k.kv_dtype == "fp32")
    assert fp32.bytes_per_token == 2 * 2 * 16 * 4 and [g.layers for g in fp32.groups] == [1]
    assert any("gated DeltaNet" in n for n in p.notes)
