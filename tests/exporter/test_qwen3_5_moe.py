"""qwen3_5_moe (the text part of Qwen3.5-MoE: model_type qwen3_5_moe_text) against transformers on a tiny
random model (tests/testkit/families.py CASES_HYBRID_MOE: Qwen3.5's 3 gated DeltaNet : 1 gated attention
layers, 4 experts top-2 with a gated shared expert on every layer): the spec read from config.json (hybrid
layers and experts together), fp32 parity of the paged `onnx` and `plugin` builds (greedy identical, |Δ logits|
within the fp32 bound; the plugin form through the native GatedDeltaRule and PagedAttention ops), and the runtime
serving it with the recurrent state in its state pool: batched, chunked, and prefix caching resuming from a state checkpoint with the same tokens as recomputation and transformers."""

import pytest

from kvexport import LLM, SamplingParams, io
from kvexport.errors import UnsupportedModelError
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import read_spec
from kvexport.exporter.validate import TOLERANCE
from testkit import parity
from testkit.families import CASES_HYBRID_MOE, tiny_config

FAMILY = "qwen3_5_moe"


def _build(hf_folder, tmp_path_factory, attention: io.Attention):
    src = hf_folder(FAMILY, **CASES_HYBRID_MOE[FAMILY])
    out, m = build(str(src), tmp_path_factory.mktemp("hybrid-moe") / f"{FAMILY}-{attention.value}",
                   BuildOptions(block_size=4, max_seq_len=256, attention=attention))
    return out, m, source.load_model(source.resolve(str(src)))


@pytest.fixture(scope="module")
def built(hf_folder, tmp_path_factory):
    """(build dir, manifest, transformers model): one validated paged `onnx` build."""
    return _build(hf_folder, tmp_path_factory, io.Attention.ONNX)


def test_spec_reads_hybrid_layers_and_experts(hf_folder):
    spec = read_spec(source.load_config(source.resolve(str(hf_folder(FAMILY, **CASES_HYBRID_MOE[FAMILY])))))
    assert spec.family == FAMILY and spec.model_type == "qwen3_5_moe_text"
    assert spec.linear_attn.layers == (0, 1, 2) and spec.kv_layers == (3,) and spec.attn_output_gate
    m = spec.moe
    assert (m.num_experts, m.top_k, m.expert_intermediate_size, m.shared_intermediate_size) == (4, 2, 32, 40)
    assert m.norm_topk_prob and m.shared_gate and m.sparse_layers == (0, 1, 2, 3)


@pytest.mark.parametrize("layout,attention", [("paged", "onnx"), ("paged", "plugin")])
def test_parity_fp32(built, hf_folder, tmp_path_factory, layout, attention):
    if attention == "plugin":
        from kvexport.plugins.gated_delta import native

        if native.library_or_why()[0] is None:
            pytest.skip("the native op library has no GatedDeltaRule (scripts/build_cpu_ops.sh)")
        out, m, _ = _build(hf_folder, tmp_path_factory, io.Attention.PLUGIN)
        assert m.validation.op == "native"
    else:
        out, m, _ = built
    assert (m.kv.layout, m.kv.attention) == (layout, attention)
    v = m.validation
    assert v.passed and v.greedy_identical, v
    assert v.max_abs_diff <= TOLERANCE["fp32"] and v.steps == 16
    names = [t.name for t in m.graphs["prefill"].inputs]
    assert [n for n in names if "cache" in n] == ["key_cache.3", "value_cache.3"]
    assert [n for n in names if "state" in n] == [io.STATE_SLOTS] + io.state_names(3)
    assert m.kv.bytes_per_token == 2 * 2 * 16 * 4  # the attention layer's KV only


def test_served_and_prefix_cached_like_recomputation(built):
    """5 prompts sharing a 20-token prefix, 8-token chunks, a checkpoint every 2 blocks: the later prompts resume
    from a state checkpoint; tokens equal recomputation's (no prefix caching) and transformers' greedy ones."""
    out, _, model = built
    prefix = parity.random_prompts(1, 128, 20, 21, seed=7)[0]
    prompts = parity.random_prompts(5, 128, 3, 12, seed=8, prefix=prefix)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm = LLM(out, kv_cache_memory="1MiB", max_num_seqs=1, max_num_batched_tokens=8, state_checkpoint_blocks=2)
    got = llm.generate(prompts, params)
    assert llm.engine.kv.state.hits >= 4 and all(o.num_cached_prompt_tokens >= 16 for o in got[1:])
    batched = LLM(out, kv_cache_memory="1MiB", max_num_batched_tokens=8, enable_prefix_caching=False)
    want = parity.hf_greedy(model, prompts, 8)
    assert [o.token_ids for o in got] == [o.token_ids for o in batched.generate(prompts, params)] == want


def test_refusals(hf_folder, tmp_path):
    with pytest.raises(UnsupportedModelError, match="'layer_types' has 'sliding_attention'"):
        read_spec(tiny_config(FAMILY, layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                                   "full_attention"]))
    src = str(hf_folder(FAMILY, **CASES_HYBRID_MOE[FAMILY]))
    with pytest.raises(UnsupportedModelError, match="--layout contiguous"):
        build(src, tmp_path / "x", BuildOptions(block_size=4, max_seq_len=64, validate=False,
                                                layout=io.KVLayout.CONTIGUOUS))
