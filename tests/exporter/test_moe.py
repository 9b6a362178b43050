"""Mixtures of experts (exporter/moe.py): qwen3_moe and mixtral end to end, every routing variant at
the numeric level.

- The MoE block alone (router + experts + shared experts), both graph forms ("grouped": each expert
  on its own tokens; "dense": every expert on every token), against transformers' own MoE modules on
  random weights: qwen3_moe, mixtral, qwen2_moe (gated shared expert), deepseek_v3 (sigmoid scores,
  e_score_correction_bias, grouped top-k, norm + routed scaling, shared experts), deepseek_v2 (greedy
  and group_limited_greedy), gpt_oss (router bias, top-k then softmax, interleaved clamped SwiGLU with
  biases); and that each routing feature changes the result (or the check would pin nothing).
- Tiny qwen3_moe (mlp_only_layers, norm_topk_prob, 8 experts top-2, q/k norms) and mixtral (8 experts
  top-2) built in both layouts and both attentions, qwen2_moe (gated shared expert,
  decoder_sparse_step 2) paged with the onnx attention: validated (fp32 greedy tokens identical to
  transformers over 16 steps); qwen3_moe and mixtral served batched with chunked prefill, preemption and prefix-cache
  hits: tokens identical to transformers' generate.
- int8 / int4 weights quantize every expert (own DequantizeLinear -> MatMul) and validate.
- Refusals: routing modes, layer rules and quantization methods not implemented, named."""

import types

import numpy as np
import pytest
import torch

from kvexport import LLM, SamplingParams, io
from kvexport.errors import ConfigError, UnsupportedModelError
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import read_spec
from kvexport.exporter.moe import MoEFields, read_moe
from kvexport.exporter.spec import ModelSpec
from kvexport.exporter.validate import TOLERANCE





from testkit import parity as engine_parity  # noqa: E402
from testkit import moe_blocks  # noqa: E402

VARIANTS = ["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "deepseek_v2", "deepseek_v2_grouped", "gpt_oss"]


def _run_hf(module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        y = module(torch.from_numpy(x)[None])
    return (y[0] if isinstance(y, tuple) else y)[0].numpy()


@pytest.mark.parametrize("variant", VARIANTS)
def test_block_matches_transformers(variant):
    module, config, f = moe_blocks.hf_block(variant)
    spec = moe_blocks.spec_of(config, f)
    lw = moe_blocks.layer_weights(module, spec, f)
    rng = np.random.default_rng(1)
    for form in ("grouped", "dense"):
        sess, _ = moe_blocks.block_session(spec, lw, form)
        for n in (1, 3, 29):  # one token: most experts get no rows
            x = rng.standard_normal((n, moe_blocks.H)).astype(np.float32)
            got = sess.run(None, {"x": x})[0]
            np.testing.assert_allclose(got, _run_hf(module, x), atol=2e-5, rtol=1e-5, err_msg=f"{form} n={n}")


# variant, the config change that must change the output (the feature the check above pins)
FEATURES = [("deepseek_v3", dict(n_group=1, topk_group=1)), ("deepseek_v3", dict(routed_scaling_factor=1.0)),
            ("deepseek_v3", dict(norm_topk_prob=False)), ("deepseek_v2_grouped", dict(topk_method="greedy")),
            ("gpt_oss", dict(swiglu_limit=1e4)), ("qwen3_moe", dict(norm_topk_prob=False))]


@pytest.mark.parametrize("variant,change", FEATURES, ids=[f"{v}-{next(iter(c))}" for v, c in FEATURES])
def test_routing_features_change_the_result(variant, change):
    x = np.random.default_rng(2).standard_normal((29, moe_blocks.H)).astype(np.float32)
    a = _run_hf(moe_blocks.hf_block(variant)[0], x)
    b = _run_hf(moe_blocks.hf_block(variant, **change)[0], x)
    assert np.abs(a - b).max() > 1e-2


def test_score_correction_bias_chooses_experts_not_weights():
    """deepseek_v3: zeroing e_score_correction_bias changes which experts are chosen (the output);
    the graph reads it (test above) only to choose."""
    module, config, f = moe_blocks.hf_block("deepseek_v3")
    x = np.random.default_rng(3).standard_normal((29, moe_blocks.H)).astype(np.float32)
    a = _run_hf(module, x)
    with torch.no_grad():
        module.gate.e_score_correction_bias.zero_()
    assert np.abs(a - _run_hf(module, x)).max() > 1e-2


def test_grouped_graph_runs_each_expert_on_its_rows():
    """The grouped form: per expert one up and one down MatMul on the rows NonZero picked for it
    (gathered from x); the dense form: one batched MatMul over stacked [E, H, 2I] weights."""
    module, config, f = moe_blocks.hf_block("qwen3_moe")
    spec = moe_blocks.spec_of(config, f)
    lw = moe_blocks.layer_weights(module, spec, f)
    _, model = moe_blocks.block_session(spec, lw, "grouped")
    nodes = model.graph.node
    producer = {o: n for n in nodes for o in n.output}
    ups = [n for n in nodes if n.op_type == "MatMul" and ".experts." in n.input[1] and n.input[1].endswith("up.weight")]
    assert sorted(n.input[1] for n in ups) == sorted(f"model.layers.0.mlp.experts.{e}.up.weight" for e in range(8))
    for n in ups:
        rows = producer[n.input[0]]  # Gather(x repeated k times, NonZero(experts == e))
        assert rows.op_type == "Gather" and producer[rows.input[1]].op_type == "NonZero"
    assert sum(n.op_type == "NonZero" for n in nodes) == 8
    _, dense = moe_blocks.block_session(spec, lw, "dense")
    stacked = [i for i in dense.graph.initializer if i.name.endswith("stacked.up.weight")]
    assert [list(i.dims) for i in stacked] == [[8, moe_blocks.H, 48]]


# ---- end to end ---------------------------------------------------------------------------
from testkit.families import CASES_MOE as CASES  # noqa: E402  (the family-coverage checks read it there)
EXPECTED = {"qwen3_moe": dict(num_experts=8, top_k=2, expert_intermediate_size=32, sparse_layers=(1, 2),
                              norm_topk_prob=True, scoring="softmax"),
            "mixtral": dict(num_experts=8, top_k=2, expert_intermediate_size=48, sparse_layers=(0, 1),
                            norm_topk_prob=True),
            "qwen2_moe": dict(sparse_layers=(1,), norm_topk_prob=False, shared_intermediate_size=40, shared_gate=True)}
from testkit.families import BUILDS_ALL as BUILDS  # noqa: E402
# NOTE: the contiguous layout once (its MoE block is the paged one's, on [B, S, H] rows); qwen2_moe
# (qwen2's attention, whose plugin path is tested with qwen2) with the onnx attention, paged
PARAMS = [(f, lay, att) for f in CASES for lay, att in BUILDS
          if (lay == "paged" or f == "qwen3_moe") and (f != "qwen2_moe" or att == "onnx")]


@pytest.fixture(scope="module")
def folder(hf_folder):
    return lambda family, **extra: hf_folder(family, **{**CASES[family], **extra})


@pytest.fixture(scope="module")
def built(folder, tmp_path_factory):
    """(family, layout, attention) -> (build dir, manifest, transformers model), validated, cached."""
    cache = {}

    def get(family, layout, attention):
        key = (family, layout, attention)
        if key not in cache:
            src = folder(family)
            out, m = build(str(src), tmp_path_factory.mktemp("moe") / family,
                           BuildOptions(layout=io.KVLayout(layout), attention=io.Attention(attention), block_size=4,
                                        max_seq_len=128))
            cache[key] = (out, m, source.load_model(source.resolve(str(src))))
        return cache[key]

    return get


@pytest.mark.parametrize("family", CASES)
def test_spec_reads_the_moe_fields(folder, family):
    spec = read_spec(source.load_config(source.resolve(str(folder(family)))))
    for name, want in EXPECTED[family].items():
        assert getattr(spec.moe, name) == want, name
    assert ModelSpec.from_json(spec.to_json()) == spec  # the manifest's model.moe loads back


@pytest.mark.parametrize("family,layout,attention", PARAMS, ids=[f"{f}-{l}-{a}" for f, l, a in PARAMS])
def test_parity_fp32(built, family, layout, attention, request):
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    _, m, _ = built(family, layout, attention)
    v = m.validation
    assert v.passed and v.greedy_identical and v.max_abs_diff <= TOLERANCE["fp32"], v
    assert v.steps == 16 and len(v.prompt_lengths) == 4
    assert m.model.spec["moe"]["num_experts"] == 8
    assert tuple(m.model.spec["moe"]["sparse_layers"]) == EXPECTED[family]["sparse_layers"]


def test_plan_counts_every_expert(built):
    """`kvexport plan`'s weights estimate of a MoE build: its parameters exactly and the bytes of
    every tensor in weights.data (experts, float32 routers), as for dense builds (test_plan.py)."""
    from kvexport.exporter.plan import plan
    from testkit.builds import stored_tensors

    out, m, _ = built("qwen3_moe", "paged", "onnx")
    stored = stored_tensors(out)
    e = next(e for e in plan(str(out)).weights if e.precision == "fp32")
    assert (e.parameters, e.bytes) == (m.weights.parameters, sum(stored.values()))


SERVED = [(f, a) for f in ("qwen3_moe", "mixtral") for a in ("onnx", "plugin")]


@pytest.mark.parametrize("family,attention", SERVED, ids=[f"{f}-{a}" for f, a in SERVED])
def test_served_with_chunked_prefill_preemption_and_prefix_hits(built, family, attention, request):
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    out, m, model = built(family, "paged", attention)
    prompts = engine_parity.random_prompts(6, 128, 10, 31, seed=1)
    # 13 usable 4-token blocks for 6 sequences of up to 46 tokens: preemption; 8-token budget: chunks
    llm = LLM(out, kv_cache_memory=14 * 4 * m.kv.bytes_per_token, max_num_batched_tokens=8)
    got = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == engine_parity.hf_greedy(model, prompts, 16)
    # prompts sharing a 17-token prefix, one at a time: the later ones hit the prefix cache
    prefix = engine_parity.random_prompts(1, 128, 17, 18, seed=5)[0]
    shared = engine_parity.random_prompts(3, 128, 2, 9, seed=2, prefix=prefix)
    llm = LLM(out, kv_cache_memory="1MiB", max_num_seqs=1)
    got = llm.generate(shared, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in got] == engine_parity.hf_greedy(model, shared, 8)
    assert all(o.num_cached_prompt_tokens == 16 for o in got[1:])


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_cover_the_experts(folder, tmp_path, weights):
    import onnx

    # NOTE: validated once (int4, the lossier); int8's experts take the same DequantizeLinear -> MatMul path
    out, m = build(str(folder("qwen3_moe")), tmp_path / "b",
                   BuildOptions(attention=io.Attention.ONNX, block_size=4, max_seq_len=64, weights=weights,
                                quant_method="rtn", validate=weights == "int4"))
    assert weights == "int8" or m.validation.passed, m.validation
    g = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False)
    codes = {i.name for i in g.graph.initializer if i.name.endswith(".q")}
    for layer in (1, 2):
        for e in range(8):
            for which in ("up", "down"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{which}.weight.q" in codes
    assert "model.layers.0.mlp.up.weight.q" in codes  # the dense layer
    with pytest.raises(ConfigError, match="--quant-method smoothquant.*experts.*--quant-method rtn"):
        build(str(folder("qwen3_moe")), tmp_path / "s", BuildOptions(block_size=4, max_seq_len=64, weights="int8",
                                                                    validate=False))


# ---- refusals -----------------------------------------------------------------------------
DS = MoEFields(experts="n_routed_experts", layers="deepseek", scaling="routed_scaling_factor", groups="topk_method",
               shared_experts="n_shared_experts")


def _cfg(**kw):
    base = dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=8, first_k_dense_replace=1,
                n_shared_experts=1, routed_scaling_factor=1.0, n_group=4, topk_group=2, topk_method="greedy")
    return types.SimpleNamespace(**{**base, **kw})


def test_unsupported_routing_is_refused_by_name():
    moe = read_moe(_cfg(), DS, 3)
    assert moe.sparse_layers == (1, 2) and moe.group_score is None and moe.shared_intermediate_size == 8
    assert read_moe(_cfg(topk_method="group_limited_greedy"), DS, 3).group_score == "max"
    with pytest.raises(UnsupportedModelError, match="'topk_method' is 'noaux_tc'; supported values: greedy, "
                                                    "group_limited_greedy"):
        read_moe(_cfg(topk_method="noaux_tc"), DS, 3)
    with pytest.raises(UnsupportedModelError, match="'moe_layer_freq' is 2"):
        read_moe(_cfg(moe_layer_freq=2), DS, 3)
    with pytest.raises(ConfigError, match="'num_experts_per_tok' \\(17\\) must not exceed 'n_routed_experts'"):
        read_moe(_cfg(num_experts_per_tok=17), DS, 3)
    with pytest.raises(ConfigError, match="'n_group' \\(5\\) must divide"):
        read_moe(_cfg(n_group=5, topk_method="group_limited_greedy"), DS, 3)
    with pytest.raises(ConfigError, match="'topk_group' \\(5\\) must not exceed 'n_group' \\(4\\)"):
        read_moe(_cfg(topk_group=5, topk_method="group_limited_greedy"), DS, 3)
    with pytest.raises(ConfigError, match="exceeds the experts of 'topk_group' \\(1\\) groups of 4"):
        read_moe(_cfg(topk_group=1, num_experts_per_tok=5, topk_method="group_limited_greedy"), DS, 3)
    with pytest.raises(ConfigError, match="'n_routed_experts' must be a positive integer, got 0"):
        read_moe(_cfg(n_routed_experts=0), DS, 3)
    qwen = MoEFields(experts="num_experts", layers="qwen")
    with pytest.raises(ConfigError, match="'mlp_only_layers' must list layer indices below 3"):
        read_moe(types.SimpleNamespace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                       decoder_sparse_step=1, mlp_only_layers=[7]), qwen, 3)
    gpt = MoEFields(experts="num_local_experts", intermediate="intermediate_size", expert_activation="gpt_oss")
    with pytest.raises(ConfigError, match="'swiglu_limit' must be a positive number, got None"):
        read_moe(types.SimpleNamespace(num_local_experts=4, num_experts_per_tok=2, intermediate_size=8), gpt, 3)
