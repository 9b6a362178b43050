"""DeepSeek-V3 / V2 with multi-head latent attention (exporter/mla.py) against transformers on
tiny random models shaped like the real ones: V3 with q_lora_rank (q_a_proj + q_a_layernorm +
q_b_proj), sigmoid routing with e_score_correction_bias, grouped top-k (top-2 sums) and a shared
expert; V2 without q_lora_rank (one q_proj), softmax routing with group_limited_greedy and routed
scaling; the first layer dense (first_k_dense_replace 1), RoPE interleaved. Covers: the spec and
the softmax scale with yarn's mscale, the latent pool's I/O and KV bytes (the real V3 shape:
61 x (512 + 64) x 2 = 70,272 B/token fp16) in the manifest, `kvexport inspect` and `plan`,
fp32 greedy parity (the build's validation) with both attentions (the `plugin` one on the PagedMLA op the build finds:
native, else the float64 reference), serving batched with chunked prefill, preemption and prefix
hits, and the refusals (layouts, KV dtypes, an unimplemented routing field)."""

import json

import pytest

from kvexport import LLM, SamplingParams, io
from kvexport import manifest as manifest_mod
from kvexport.errors import ConfigError, ManifestError, UnsupportedModelError
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import read_spec
from kvexport.exporter.validate import TOLERANCE





from testkit import parity as engine_parity  # noqa: E402

# the tiny configs (TINY_MLA + CASES_MLA) and the real V3's fields: tests/testkit/families.py
from testkit.families import REAL_V3, tiny_config as config  # noqa: E402


@pytest.fixture(scope="module")
def folder(hf_folder):
    """folder(family, **overrides) -> a saved tiny random model (cached; testkit.families: weights
    scaled, V3's score-correction biases random: they pick the experts)."""
    return hf_folder


def test_spec_reads_mla_and_the_yarn_softmax_scale():
    """The real V3's fields: MLA spec, head_dim = the RoPE dims, scale = 192^-0.5 x mscale(40, 1)^2
    (transformers' yarn_apply_mscale); V2 without q_lora_rank reads None (one q_proj)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    c = DeepseekV3Config(**REAL_V3)
    spec = read_spec(c)
    m = spec.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (1536, 512, 128,
                                                                                                   64, 128)
    assert m.rope_interleave and spec.head_dim == 64 and m.row_width == 576
    assert spec.scale == pytest.approx(yarn_apply_mscale(c.rope_parameters, 192 ** -0.5), rel=1e-12)
    assert spec.scale == pytest.approx(192 ** -0.5 * 1.3688879454113936 ** 2, rel=1e-12)
    assert read_spec(config("deepseek_v2")).mla.q_lora_rank is None
    assert type(spec).from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_real_deepseek_v3_kv_bytes_per_token(tmp_path):
    """61 layers x (512 + 64) x 2 bytes = 70,272 B/token fp16 (fp32: 140,544, int8: 35,136), by the one formula
    (io.kv_bytes_per_token), in `kvexport plan` of the real config."""
    from kvexport.exporter.plan import plan

    assert io.kv_bytes_per_token(61, 1, 512 + 64, io.DType.FP16, latent=True) == 70_272
    from transformers import DeepseekV3Config

    DeepseekV3Config(**REAL_V3).save_pretrained(tmp_path)
    p = plan(str(tmp_path / "config.json"))
    by_dtype = {k.kv_dtype: k.bytes_per_token for k in p.kv}
    assert by_dtype == {"fp32": 140_544, "fp16": 70_272, "int8": 35_136}  # MLA: no int4 latent pools
    assert p.num_kv_heads == 1 and p.head_dim == 576 and p.attention == "MLA: latent 512 + rope 64"


@pytest.fixture(scope="module")
def built(folder, tmp_path_factory):
    """built(family, attention) -> (build dir, manifest), validated against transformers (cached)."""
    cache = {}

    def get(family, attention):
        if (family, attention) not in cache:
            cache[family, attention] = build(str(folder(family)), tmp_path_factory.mktemp("b") / family,
                                             BuildOptions(attention=io.Attention(attention), block_size=4,
                                                          max_seq_len=128, validate_steps=8))
        return cache[family, attention]

    return get


@pytest.fixture(scope="module")
def hf_model(folder):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = source.load_model(source.resolve(str(folder(family))))
        return cache[family]

    return get


PARITY = [("deepseek_v3", "onnx"), ("deepseek_v2", "onnx"), ("deepseek_v3", "plugin")]


@pytest.mark.parametrize("family,attention", PARITY, ids=[f"{f}-{a}" for f, a in PARITY])
def test_parity_fp32(built, family, attention):
    """The build's own validation (teacher-forced logits of 4 prompts, greedy tokens) passes at
    fp32's bound; one latent pool per layer, [1, num_blocks, block_size, L + R], no value pool."""
    out, m = built(family, attention)
    v = m.validation
    assert v.passed and v.greedy_identical, v
    assert v.max_abs_diff <= TOLERANCE["fp32"] and v.steps == 8 and len(v.prompt_lengths) == 4
    assert m.kv.latent_rank == 32 and (m.kv.num_kv_heads, m.kv.head_dim) == (1, 40)
    assert m.kv.bytes_per_token == 2 * (32 + 8) * 4  # layers x (L + R) x fp32 bytes
    inputs = {t.name: list(t.shape) for t in m.graphs["decode"].inputs}
    assert inputs["latent_cache.1"] == [1, "num_blocks", 4, 40] and "value_cache.0" not in inputs
    outs = [t.name for t in m.graphs["decode"].outputs]
    assert outs == ["logits"] + ([f"latent_cache_out.{i}" for i in range(2)] + [f"attention_scores.{i}" for i in range(2)]
                                 if attention == "plugin" else [f"new_latent.{i}" for i in range(2)])  # scores: issue 33
    if attention == "plugin":
        import onnx

        g = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False)
        assert [n.op_type for n in g.graph.node if n.domain == io.PLUGIN_DOMAIN] == [io.MLA_PLUGIN_OP] * 2


@pytest.mark.parametrize("attention", ["onnx", "plugin"])
def test_served_with_chunked_prefill_preemption_and_prefix_hits(built, hf_model, attention):
    """deepseek_v3: 4 prompts of 10..20 tokens in 9 usable 4-token blocks with an 8-token budget
    (chunks and preemption), then prompts sharing a 17-token prefix one at a time (prefix hits):
    every token equals transformers' greedy tokens."""
    out, m = built("deepseek_v3", attention)
    model = hf_model("deepseek_v3")
    prompts = engine_parity.random_prompts(4, 128, 10, 21, seed=1)
    llm = LLM(out, kv_cache_memory=10 * 4 * m.kv.bytes_per_token, max_num_batched_tokens=8)
    got = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == engine_parity.hf_greedy(model, prompts, 8)
    assert llm.engine.pool.num_used_blocks == 0
    prefix = engine_parity.random_prompts(1, 128, 17, 18, seed=5)[0]
    shared = engine_parity.random_prompts(2, 128, 2, 9, seed=2, prefix=prefix)
    llm = LLM(out, kv_cache_memory="1MiB", max_num_seqs=1)
    got = llm.generate(shared, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in got] == engine_parity.hf_greedy(model, shared, 6)
    assert got[1].num_cached_prompt_tokens == 16


def test_int8_latent_kv(folder, tmp_path):
    """int8 latent rows with calibrated per-channel scales [L + R] (kv_scales.{i}.latent): the
    build's validation passes the int8 bound (|Δ| <= 3, >= 75% greedy agreement; measured on this
    config: |Δ| 0.05, 98.5% over 16 steps); one byte per element in the pool."""
    import onnx

    out, m = build(str(folder("deepseek_v3")), tmp_path / "b",
                   BuildOptions(kv_dtype=io.DType.INT8, attention=io.Attention.ONNX, block_size=4, max_seq_len=64,
                                calibration_tokens=256, validate_steps=4))
    assert m.validation.passed, m.validation
    assert m.kv.bytes_per_token == 2 * 40 and m.kv.quantization["scheme"] == "static-per-channel-symmetric-latent"
    assert [len(row) for row in m.kv.quantization["scales"]] == [40, 40]
    g = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False)
    scales = {t.name: list(t.dims) for t in g.graph.initializer if t.name.startswith("kv_scales.")}
    assert scales == {"kv_scales.0.latent": [40], "kv_scales.1.latent": [40]}


def test_refusals(folder, built, tmp_path):
    """MLA builds are paged, float or int8 KV, float or rtn int8/int4 weights (test_mla_quantized_weights.py);
    a V2 routing field transformers does not
    honour is refused by name; a manifest whose latent rank disagrees with its model is refused."""
    src = str(folder("deepseek_v3"))
    for opts, match in ((BuildOptions(layout=io.KVLayout.CONTIGUOUS, validate=False), "--layout contiguous"),
                        (BuildOptions(kv_dtype=io.DType.INT4, validate=False), "--kv-dtype int4"),
                        (BuildOptions(weights="int8", validate=False), "--quant-method smoothquant is not "
                                                                       "implemented for multi-head latent attention")):
        with pytest.raises(ConfigError, match=match):
            build(src, tmp_path / "x", opts)
    with pytest.raises(UnsupportedModelError, match="'norm_topk_prob' is True for a deepseek_v2 model"):
        read_spec(config("deepseek_v2", norm_topk_prob=True))
    with pytest.raises(ConfigError, match="'q_lora_rank'"):
        read_spec(config("deepseek_v3", q_lora_rank=0))
    out, m = built("deepseek_v3", "onnx")
    d = json.loads((out / io.MANIFEST_NAME).read_text())
    with pytest.raises(ManifestError, match="'kv.latent_rank' is 16, but the model's MLA spec gives 32"):
        manifest_mod.Manifest.from_json({**d, "kv": {**d["kv"], "latent_rank": 16}})
    with pytest.raises(ManifestError, match="kv.bytes_per_token"):
        manifest_mod.Manifest.from_json({**d, "kv": {**d["kv"], "bytes_per_token": 2 * m.kv.bytes_per_token}})
