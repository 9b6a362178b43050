"""GPT-OSS (`gpt_oss`) end to end against transformers on a tiny random model shaped like the real
one: 16 query heads over 2 KV heads (group 8, as gpt-oss-20b's 64 / 8), head_dim 64 != hidden / heads,
sliding window (8) on alternate layers, yarn RoPE, q/k/v/o biases, learned attention sinks set
random (transformers' init makes them ~0), 8 experts with top-4 routing, router and expert biases,
the clamped SwiGLU. Built with the `onnx` and the `plugin` attention (paged; the contiguous layout's
attention too), validated (fp32 greedy tokens identical to transformers, logits within tolerance),
served batched with chunked prefill, preemption and prefix-cache hits: tokens identical to
transformers' generate. Unsupported config values are refused by name."""

import types

import numpy as np
import pytest
import torch

from kvexport import LLM, SamplingParams, io
from kvexport.errors import ConfigError, UnsupportedModelError
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import read_spec
from kvexport.exporter.validate import TOLERANCE

SLIDING, FULL = "sliding_attention", "full_attention"
# the tiny config and its parity builds: tests/testkit/families.py (the family-coverage checks read them there)
from testkit.families import TINY_GPT_OSS as TINY  # noqa: E402
from testkit.families import make_hf_folder  # noqa: E402




from testkit import parity as engine_parity  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_folder("gpt_oss", tmp_path_factory.mktemp("gpt-oss") / "src")


@pytest.fixture(scope="module")
def builds(folder, tmp_path_factory):
    """attention -> (build dir, manifest): paged, block 4, validated against transformers."""
    cache = {}

    def get(attention):
        if attention not in cache:
            cache[attention] = build(str(folder), tmp_path_factory.mktemp("b") / attention,
                                     BuildOptions(attention=io.Attention(attention), block_size=4, max_seq_len=64))
        return cache[attention]

    return get


@pytest.fixture(scope="module")
def hf_model(folder):
    return source.load_model(source.resolve(str(folder)))


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    """prompts -> transformers' 16 greedy tokens of each (cached: both attentions serve the same prompts)."""
    cache = {}

    def get(prompts):
        key = tuple(map(tuple, prompts))
        if key not in cache:
            cache[key] = engine_parity.hf_greedy(hf_model, prompts, 16)
        return cache[key]

    return get


def test_spec_reads_gpt_oss(folder):
    spec = read_spec(source.load_config(source.resolve(str(folder))))
    assert spec.family == "gpt_oss" and spec.attn_sinks
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size) == (16, 2, 64, 64)
    assert spec.layer_windows == (8, None) and spec.qkv_bias and spec.o_bias
    assert spec.rope.rope_type == "yarn" and spec.rope.factor == 4.0
    moe = spec.moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (8, 4, 32)
    assert moe.scoring == "topk_softmax" and moe.router_bias and moe.expert_bias
    assert moe.expert_activation == "gpt_oss" and moe.swiglu_limit == 7.0 and moe.swiglu_alpha == 1.702
    assert moe.sparse_layers == (0, 1)


def test_sinks_move_transformers_logits(hf_model):
    """Sanity of the parity below: the random sinks change the model's output."""
    ids = torch.tensor([engine_parity.random_prompts(1, 128, 20, 21, seed=3)[0]])
    with torch.no_grad():
        a = hf_model(ids).logits
        saved = [layer.self_attn.sinks.clone() for layer in hf_model.model.layers]
        for layer in hf_model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # no sinks
        b = hf_model(ids).logits
        for layer, s in zip(hf_model.model.layers, saved):
            layer.self_attn.sinks.copy_(s)
    assert (a - b).abs().max().item() > 0.1


@pytest.mark.parametrize("attention", ["onnx", "plugin"])
def test_parity_fp32(builds, folder, attention, request):
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    out, m = builds(attention)
    v = m.validation
    assert v.passed and v.greedy_identical and v.max_abs_diff <= TOLERANCE["fp32"], v
    assert max(v.prompt_lengths) > 8  # sequences outgrow the window
    assert m.kv.local_window == 8 and m.layer_groups == ("local", "full")
    if attention == "plugin":  # every node carries its layer's sinks (float32) and window
        import onnx
        from safetensors.torch import load_file

        from kvexport.plugins.paged_attention.spec import PagedAttentionAttrs

        sd = load_file(str(folder / "model.safetensors"))
        g = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False)
        attrs = [PagedAttentionAttrs.from_onnx_attributes({a.name: onnx.helper.get_attribute_value(a)
                                                           for a in n.attribute})
                 for n in g.graph.node if n.domain == io.PLUGIN_DOMAIN]
        assert [a.sliding_window for a in attrs] == [8, 0]
        for i, a in enumerate(attrs):
            want = sd[f"model.layers.{i}.self_attn.sinks"].float().numpy()
            np.testing.assert_array_equal(np.array(a.attention_sinks, np.float32), want)


def test_parity_contiguous(folder, tmp_path):
    """The contiguous layout's own attention (left-padded batches) with the sinks (4 steps: the paged
    builds above compare 16)."""
    _, m = build(str(folder), tmp_path / "c", BuildOptions(layout=io.KVLayout.CONTIGUOUS, max_seq_len=64,
                                                           validate_steps=4))
    assert m.validation.passed and m.validation.greedy_identical, m.validation


@pytest.mark.parametrize("attention", ["onnx", "plugin"])
def test_served_with_chunked_prefill_preemption_and_prefix_hits(builds, hf_greedy, attention, request):
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    out, m = builds(attention)
    prompts = engine_parity.random_prompts(6, 128, 10, 31, seed=1)  # 10..30 tokens: past the 8-token window
    # 13 usable 4-token blocks for 6 sequences of up to 46 tokens: preemption; 8-token budget: chunks
    llm = LLM(out, kv_cache_memory=14 * 4 * m.kv.bytes_per_token, max_num_batched_tokens=8)
    assert llm.engine.scheduler.config.sliding_window == 8
    got = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == hf_greedy(prompts)
    assert llm.engine.pool.num_used_blocks == 0
    # a shared 17-token prefix, one request at a time: later ones find its 4 full blocks cached
    prefix = engine_parity.random_prompts(1, 128, 17, 18, seed=5)[0]
    prompts = engine_parity.random_prompts(3, 128, 2, 9, seed=2, prefix=prefix)
    llm = LLM(out, kv_cache_memory="4MiB", max_num_seqs=1)
    got = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in got] == hf_greedy(prompts)
    assert all(o.num_cached_prompt_tokens == 16 for o in got[1:])


def _config(**fields):
    base = dict(model_type="gpt_oss", **{k: v for k, v in TINY.items() if k != "rope_parameters"},
                rms_norm_eps=1e-5, hidden_act="silu", attention_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702,
                layer_types=[SLIDING, FULL], rope_parameters=dict(TINY["rope_parameters"]))
    return types.SimpleNamespace(**{**base, **fields})


def test_unsupported_gpt_oss_config_values_are_refused_by_name():
    assert read_spec(_config()).attn_sinks
    with pytest.raises(UnsupportedModelError, match="'rope_parameters.rope_type' of a gpt_oss model is 'dynamic'; "
                                                    "supported values: default, yarn"):
        read_spec(_config(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))
    with pytest.raises(UnsupportedModelError, match="'layer_types' has 'chunked_attention'"):
        read_spec(_config(layer_types=[SLIDING, "chunked_attention"]))
    with pytest.raises(ConfigError, match="'layer_types' must list one type for each of the 2 layers"):
        read_spec(_config(layer_types=[SLIDING]))
    with pytest.raises(ConfigError, match="'swiglu_limit' must be a positive number"):
        read_spec(_config(swiglu_limit=0))
    with pytest.raises(ConfigError, match="'num_experts_per_tok' \\(9\\) must not exceed 'num_local_experts' \\(8\\)"):
        read_spec(_config(num_experts_per_tok=9))
