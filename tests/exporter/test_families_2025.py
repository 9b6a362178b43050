"""The 2025-26 families (qwen3, olmo2, gemma2, gemma3_text, smollm3) against transformers on
tiny random models: both KV layouts, `onnx` and `plugin` attention, fp32 greedy tokens
identical over 16 steps on prompts of 5..30 tokens (longer than the 8-token windows), fp16
within its tolerance, and served by the runtime with chunked prefill and preemption.

Each family's tiny config switches on the spec features it brings (exporter/spec.py):
per-layer windows and RoPE kinds, q/k norms, post/sandwich norms, (1 + w) norms, embedding
scale, attention and final soft-caps, query_pre_attn_scalar, NoPE layers."""

import json
import types

import pytest

from kvexport import LLM, SamplingParams, io
from kvexport.errors import ConfigError, ManifestError, UnsupportedModelError
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import read_spec
from kvexport.exporter.validate import TOLERANCE, prompt_ids, reference
from kvexport import manifest as manifest_mod

SLIDING, FULL = "sliding_attention", "full_attention"
# family -> tiny-config overrides (on top of tests/conftest.py's tiny_config); every feature on
from testkit.families import CASES_2025 as CASES  # noqa: E402  (the family-coverage checks read it there)
# what read_spec must make of them (spec field -> value)
EXPECTED = {
    "qwen3": dict(qk_norm="head", head_dim=24, layer_norms="pre", layer_windows=None),
    "olmo2": dict(qk_norm="all", layer_norms="post"),
    "gemma2": dict(layer_norms="sandwich", norm_offset=1.0, embed_scale=8.0, attn_scale=24 ** -0.5,
                   attn_softcap=2.0, final_softcap=5.0, sliding_window=8, layer_windows=(8, None),
                   activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(qk_norm="head", layer_norms="sandwich", norm_offset=1.0, layer_windows=(8, 8, 8, None),
                        layer_rope=("local", "local", "local", "global"), final_softcap=5.0),
    "smollm3": dict(layer_rope=("global", "none", "global", "none")),
}
from testkit.families import BUILDS_ALL as BUILDS  # noqa: E402




from testkit import parity as engine_parity  # noqa: E402


@pytest.fixture(scope="module")
def folder(hf_folder):
    """folder(family, **extra overrides) -> saved tiny HF model with the family's CASES config."""
    return lambda family, **extra: hf_folder(family, **{**CASES[family], **extra})


@pytest.mark.parametrize("family", CASES)
def test_spec_reads_the_family_features(folder, family):
    spec = read_spec(source.load_config(source.resolve(str(folder(family)))))  # through config.json
    for name, want in EXPECTED[family].items():
        got = getattr(spec, name)
        if name == "layer_windows" and want is not None and len(want) < spec.num_layers:  # alternating
            want = tuple(want[i % len(want)] for i in range(spec.num_layers))
        assert got == (pytest.approx(want) if isinstance(want, float) else want), name


PARAMS = [(f, lay, att) for f in CASES for lay, att in BUILDS]


@pytest.mark.parametrize("family,layout,attention", PARAMS, ids=[f"{f}-{l}-{a}" for f, l, a in PARAMS])
def test_parity_fp32(folder, tmp_path, family, layout, attention, request):
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    _, m = build(str(folder(family)), tmp_path / "b",
                 BuildOptions(layout=io.KVLayout(layout), attention=io.Attention(attention), block_size=4,
                              max_seq_len=64))
    v = m.validation
    assert v.passed and v.greedy_identical, v
    assert v.max_abs_diff <= TOLERANCE["fp32"]
    assert v.steps == 16 and len(v.prompt_lengths) == 4
    if m.model.sliding_window:  # the windows only prove something if sequences outgrow them
        assert max(v.prompt_lengths) > m.model.sliding_window
    if v.cross_check is not None:
        assert v.cross_check.passed, v.cross_check


def test_plugin_nodes_carry_each_layers_attention(folder, tmp_path):
    """gemma2: window 8 on layers 0 and 2 only, scale query_pre_attn_scalar ** -0.5 and the
    soft-cap on every PagedAttention node (the `onnx` form: one mask per distinct window)."""
    import onnx

    from kvexport.plugins.paged_attention.spec import PagedAttentionAttrs

    out, m = build(str(folder("gemma2", num_hidden_layers=4)), tmp_path / "b",
                   BuildOptions(attention=io.Attention.PLUGIN, block_size=4, max_seq_len=64, validate=False))
    g = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False)
    attrs = [PagedAttentionAttrs.from_onnx_attributes({a.name: onnx.helper.get_attribute_value(a)
                                                       for a in n.attribute})
             for n in g.graph.node if n.domain == io.PLUGIN_DOMAIN]
    assert [a.sliding_window for a in attrs] == [8, 0, 8, 0]
    assert all(a.scale == pytest.approx(24 ** -0.5) and a.logit_softcap == 2.0 for a in attrs)
    out, _ = build(str(folder("gemma2", num_hidden_layers=4)), tmp_path / "o",
                   BuildOptions(attention=io.Attention.ONNX, block_size=4, max_seq_len=64, validate=False))
    g = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False)
    scopes = {n.name.split("/")[1] for n in g.graph.node if n.name.startswith("/attn_mask")}
    assert scopes == {"attn_mask", "attn_mask_w8"}


def test_paged_builds_of_windowed_and_full_layers_take_a_local_kv_group(folder, hf_folder, tmp_path):
    """gemma2 (window 8 on layers 0 and 2): the windowed layers read `block_tables.local` /
    `slot_mapping.local` and have pools on the `num_blocks.local` axis, in both attentions; the
    manifest records the local group's window. A one-window model's graphs keep today's I/O."""
    import onnx

    src = folder("gemma2", num_hidden_layers=4)
    local_pool = [2, "num_blocks.local", 4, 16]
    for attention in (io.Attention.ONNX, io.Attention.PLUGIN):
        out, m = build(str(src), tmp_path / attention.value,
                       BuildOptions(attention=attention, block_size=4, max_seq_len=64, validate=False))
        assert m.kv.local_window == 8 and m.layer_groups == ("local", "full", "local", "full")
        inputs = {t.name: list(t.shape) for t in m.graphs["decode"].inputs}
        assert [n for n in inputs][:8] == ["input_ids", "positions", "query_start_loc", "seq_lens", "block_tables",
                                           "slot_mapping", "block_tables.local", "slot_mapping.local"]
        assert inputs["key_cache.0"] == inputs["value_cache.2"] == local_pool
        assert inputs["key_cache.1"] == [2, "num_blocks", 4, 16]
        g = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False)
        if attention is io.Attention.PLUGIN:
            reads = {n.input[3]: (n.input[5], n.input[8]) for n in g.graph.node if n.domain == io.PLUGIN_DOMAIN}
            assert reads == {"key_cache.0": ("block_tables.local", "slot_mapping.local"),
                             "key_cache.1": ("block_tables", "slot_mapping"),
                             "key_cache.2": ("block_tables.local", "slot_mapping.local"),
                             "key_cache.3": ("block_tables", "slot_mapping")}
        else:
            gathers = {n.input[0]: n.input[1] for n in g.graph.node if n.op_type == "Gather"
                       and n.input[0].startswith("key_cache.")}
            assert gathers == {"key_cache.0": "block_tables.local", "key_cache.1": "block_tables",
                               "key_cache.2": "block_tables.local", "key_cache.3": "block_tables"}
        assert "local_window" in (out / io.MANIFEST_NAME).read_text()
    d = json.loads((out / io.MANIFEST_NAME).read_text())
    with pytest.raises(ManifestError, match="'kv.local_window' is 5, but the model's layer windows give 8"):
        manifest_mod.Manifest.from_json({**d, "kv": {**d["kv"], "local_window": 5}})
    del d["kv"]["local_window"]  # read as one group: the graphs then do not match
    (out / io.MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ManifestError, match="block_tables.local"):
        manifest_mod.load(out)
    out, c = build(str(src), tmp_path / "c", BuildOptions(layout=io.KVLayout.CONTIGUOUS, max_seq_len=64,
                                                          validate=False))
    assert c.kv.local_window is None and c.layer_groups is None
    out, llama = build(str(hf_folder("llama")), tmp_path / "l", BuildOptions(block_size=4, max_seq_len=64,
                                                                             validate=False))
    assert llama.kv.local_window is None and "local_window" not in (out / io.MANIFEST_NAME).read_text()
    assert [t.name for t in llama.graphs["prefill"].inputs][:6] == [
        "input_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping"]
    assert not any("local" in str(t.shape) + t.name for t in llama.graphs["prefill"].inputs)


@pytest.mark.parametrize("attention", ["onnx", "plugin"])
def test_windowed_layers_hold_only_the_window_while_serving(served, attention, request):
    """gemma3_text (3 local : 1 global, window 8): while a 40-token prompt is served in 8-token
    chunks and decoded, after every step the local group holds only the blocks the next token's
    window reaches (<= 3 of 4 tokens), the full group every block; the tokens equal transformers'."""
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    from kvexport.runtime.core.windowed_kv_cache_manager import WindowedKVCacheManager

    out, m, model = served("gemma3_text", attention)
    prompt = engine_parity.random_prompts(1, 128, 40, 41, seed=7)[0]
    llm = LLM(out, kv_cache_memory="1MiB", max_num_batched_tokens=8, max_num_seqs=4)
    kv = llm.engine.kv.attention  # the attention groups' manager behind the KV cache coordinator
    assert isinstance(kv, WindowedKVCacheManager) and kv.window == 8
    rid = llm.engine.add_request(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    held_local = []
    while llm.engine.has_unfinished():
        llm.engine.step()
        req = llm.engine.scheduler.requests[rid]
        if rid in kv:
            local = [b for b in kv.local.block_table(rid) if b != io.PAD_BLOCK_ID]
            assert len(kv.block_table(rid)) == -(-req.num_computed_tokens // 4)
            assert len(local) <= 3 and kv.local_pool.num_used_blocks == len(local)
            held_local.append(len(local))
    assert max(held_local) == 3 and len(held_local) > 16
    assert list(llm.engine.output(rid).token_ids) == engine_parity.hf_greedy(model, [prompt], 16)[0]
    assert kv.local_pool.num_used_blocks == 0 and kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("attention", ["onnx", "plugin"])
def test_int8_kv_served_with_a_local_group(folder, tmp_path, attention, request):
    """int8 KV in both KV cache groups (gemma3_text, window 8): served with chunked prefill,
    preemption and the local group freed behind the window, the tokens equal those of the same
    build served roomily (each prompt in one chunk, no preemption)."""
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    out, m = build(str(folder("gemma3_text")), tmp_path / "b",
                   BuildOptions(kv_dtype=io.DType.INT8, attention=io.Attention(attention), block_size=4,
                                max_seq_len=128, calibration_tokens=256, validate=False))
    assert m.kv.dtype == "int8" and m.kv.local_window == 8
    prompts = engine_parity.random_prompts(6, 128, 10, 31, seed=1)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    roomy = LLM(out, kv_cache_memory="4MiB", max_num_batched_tokens=256).generate(prompts, params)
    tight = LLM(out, kv_cache_memory=14 * 4 * m.kv.bytes_per_token, max_num_batched_tokens=8)
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in roomy]


@pytest.mark.parametrize("family", CASES)
def test_parity_fp16(folder, tmp_path, family):
    _, m = build(str(folder(family)), tmp_path / "b",
                 BuildOptions(dtype=io.DType.FP16, block_size=4, max_seq_len=64, attention=io.Attention.ONNX))
    assert m.kv.dtype == "fp16" and m.validation.passed, m.validation
    assert m.validation.max_abs_diff <= TOLERANCE["fp16"]


@pytest.fixture(scope="module")
def served(folder, tmp_path_factory):
    cache = {}

    def get(family, attention, **extra):
        key = (family, attention, tuple(sorted(extra.items())))
        if key not in cache:
            src = folder(family, **extra)
            out, m = build(str(src), tmp_path_factory.mktemp("rt") / family,
                           BuildOptions(block_size=4, max_seq_len=128, validate=False,
                                        attention=io.Attention(attention)))
            cache[key] = (out, m, source.load_model(source.resolve(str(src))))
        return cache[key]

    return get


# family, extra overrides, the window the scheduler frees blocks behind (None: keeps them all)
# NOTE: gemma2/gemma3 and qwen3 with max_window_layers=1 mix windowed and full-attention layers:
# their windowed layers' KV is a second cache group whose blocks behind the window are freed
# (runtime/core/windowed_kv_cache_manager.py); the full-attention layers keep every block
SERVED = [("qwen3", {}, None), ("olmo2", {}, None), ("gemma2", {}, 8), ("gemma3_text", {}, 8),
          ("smollm3", {}, None),
          # every layer windowed alike: blocks behind the window are freed while serving
          ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), 8),
          # windows on some layers only: two KV cache groups, the windowed one freed
          ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), 8)]
SERVED_PARAMS = [(f, ov, w, a) for f, ov, w in SERVED for a in ("onnx", "plugin")]


@pytest.mark.parametrize("family,extra,window,attention", SERVED_PARAMS,
                         ids=[f"{f}{'-w' + str(ov['max_window_layers']) if ov else ''}-{a}"
                              for f, ov, _, a in SERVED_PARAMS])
def test_served_with_chunked_prefill_and_preemption(served, family, extra, window, attention, request):
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    out, m, model = served(family, attention, **extra)
    prompts = engine_parity.random_prompts(6, 128, 10, 31, seed=1)  # 10..30 tokens: past the 8-token windows
    # 13 usable 4-token blocks = 52 tokens for 6 sequences of up to 46: preemption; 8-token budget: chunks
    llm = LLM(out, kv_cache_memory=14 * 4 * m.kv.bytes_per_token, max_num_batched_tokens=8)
    assert llm.engine.scheduler.config.sliding_window == window
    got = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == engine_parity.hf_greedy(model, prompts, 16)
    assert llm.engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("attention", ["onnx", "plugin"])
def test_prefix_cache_hits_with_local_and_global_layers(served, attention, request):
    """gemma3_text (3 local : 1 global, window 8): prompts sharing a 17-token prefix, served one
    at a time so later ones find it cached, still match transformers exactly."""
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    out, _, model = served("gemma3_text", attention)
    prefix = engine_parity.random_prompts(1, 128, 17, 18, seed=5)[0]
    prompts = engine_parity.random_prompts(4, 128, 2, 9, seed=2, prefix=prefix)
    llm = LLM(out, kv_cache_memory="1MiB", max_num_seqs=1)
    got = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in got] == engine_parity.hf_greedy(model, prompts, 16)
    assert all(o.num_cached_prompt_tokens == 16 for o in got[1:])


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3"])
@pytest.mark.parametrize("attention", ["onnx", "plugin"])
def test_int8_kv_validates(folder, tmp_path, family, attention, request):
    """int8 KV (calibrated scales) on q/k-normed keys and per-layer windows: the build's own
    validation (int8 bound: |Δ| <= 3, >= 75% greedy agreement) passes."""
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    _, m = build(str(folder(family)), tmp_path / "b",
                 BuildOptions(kv_dtype=io.DType.INT8, attention=io.Attention(attention), block_size=4,
                              max_seq_len=64, calibration_tokens=256))
    assert m.kv.dtype == "int8" and m.validation.passed, m.validation


def test_soft_caps_change_the_result(folder):
    """Sanity of the test itself: gemma2's small soft-caps must move transformers' logits, or
    the parity above would not pin them."""
    import numpy as np

    capped = source.load_model(source.resolve(str(folder("gemma2"))))
    loose = source.load_model(source.resolve(str(folder("gemma2", attn_logit_softcapping=1e6,
                                                        final_logit_softcapping=1e6))))
    prompts = prompt_ids(None, 128)
    _, a = reference(capped, prompts, 1)
    _, b = reference(loose, prompts, 1)
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) > 1e-1


def test_new_fields_stay_out_of_older_families_manifests(folder, hf_folder, tmp_path):
    """Fields at their default are left out of the spec: a llama manifest keeps the keys it
    had before the 2025 families; a gemma2 one records its per-layer windows and loads back."""
    _, llama = build(str(hf_folder("llama")), tmp_path / "l", BuildOptions(block_size=4, max_seq_len=64,
                                                                           validate=False))
    assert set(llama.model.spec) == {
        "family", "model_type", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
        "intermediate_size", "vocab_size", "max_positions", "norm", "norm_eps", "activation", "gated_mlp",
        "qkv_bias", "o_bias", "mlp_bias", "position", "rope", "sliding_window", "tie_embeddings",
        "bos_token_id", "eos_token_ids"}
    out, gemma = build(str(folder("gemma2")), tmp_path / "g", BuildOptions(block_size=4, max_seq_len=64,
                                                                          validate=False))
    loaded = manifest_mod.load(out)
    assert loaded.model.layer_windows == (8, None) and loaded.model.uniform_window is None
    assert loaded.model.spec == gemma.model.spec


def _config(**fields):
    base = dict(model_type="gemma3_text", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_hidden_layers=2, intermediate_size=96, vocab_size=128, max_position_embeddings=64,
                rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", sliding_window=8,
                layer_types=[SLIDING, FULL], rope_parameters={FULL: {"rope_theta": 1e6}, SLIDING: {"rope_theta": 1e4}})
    return types.SimpleNamespace(**{**base, **fields})


def test_unsupported_options_are_refused_by_name():
    assert read_spec(_config()).layer_windows == (8, None)
    with pytest.raises(UnsupportedModelError, match="'layer_types' has 'chunked_attention'.*full_attention, "
                                                    "sliding_attention"):
        read_spec(_config(layer_types=[SLIDING, "chunked_attention"]))
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        read_spec(_config(use_bidirectional_attention=True))
    with pytest.raises(UnsupportedModelError, match="rope_type.*'dynamic'"):
        read_spec(_config(rope_parameters={FULL: {"rope_type": "dynamic", "factor": 2.0}, SLIDING: {}}))
    with pytest.raises(ConfigError, match="'layer_types' must list one type for each of the 2 layers"):
        read_spec(_config(layer_types=[SLIDING]))
    with pytest.raises(ConfigError, match="'query_pre_attn_scalar' must be > 0"):
        read_spec(_config(query_pre_attn_scalar=0))
    with pytest.raises(ConfigError, match="'no_rope_layers' must list 0 or 1"):
        read_spec(types.SimpleNamespace(**{**vars(_config(model_type="smollm3", hidden_act="silu")),
                                           "no_rope_layers": [1]}))


# ---- phi3 with longrope (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) -----------------------
def _longrope(original_max: int, **extra) -> dict:
    rope = dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)],
                long_factor=[1.0 + 0.5 * i for i in range(8)], **extra)
    return dict(original_max_position_embeddings=original_max, rope_parameters=rope)


# short: no validation sequence (<= 46 tokens) outgrows 64, so the short factors throughout;
# long: past 1 token from the first prefill chunk on, so the long factors throughout (an explicit
# attention_factor: transformers' default divides by log(original_max) = 0)
LONGROPE = {"short": _longrope(64), "long": _longrope(1, attention_factor=1.2)}
LR_PARAMS = [(k, lay, att) for k in LONGROPE for lay, att in BUILDS]


@pytest.mark.parametrize("which,layout,attention", LR_PARAMS, ids=[f"{k}-{l}-{a}" for k, l, a in LR_PARAMS])
def test_longrope_parity(hf_folder, tmp_path, which, layout, attention, request):
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    _, m = build(str(hf_folder("phi3", **LONGROPE[which])), tmp_path / "b",
                 BuildOptions(layout=io.KVLayout(layout), attention=io.Attention(attention), block_size=4,
                              max_seq_len=64))
    v = m.validation
    assert m.model.spec["rope"]["rope_type"] == "longrope"
    assert v.passed and v.greedy_identical and v.max_abs_diff <= TOLERANCE["fp32"], v


def test_longrope_fp16(hf_folder, tmp_path):
    _, m = build(str(hf_folder("phi3", **LONGROPE["long"])), tmp_path / "b",
                 BuildOptions(dtype=io.DType.FP16, block_size=4, max_seq_len=64, attention=io.Attention.ONNX))
    assert m.validation.passed and m.validation.max_abs_diff <= TOLERANCE["fp16"], m.validation


def test_longrope_factor_sets_change_the_result(hf_folder):
    """Sanity of the tests above: the short and the long factors give different logits."""
    import numpy as np

    short = source.load_model(source.resolve(str(hf_folder("phi3", **_longrope(64, attention_factor=1.2)))))
    long = source.load_model(source.resolve(str(hf_folder("phi3", **LONGROPE["long"]))))
    _, a = reference(short, prompt_ids(None, 128), 1)
    _, b = reference(long, prompt_ids(None, 128), 1)
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) > 1e-1


def _cached_greedy(model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens from transformers' forward with its cache carried step to step (no
    `generate`): keys keep the rotation they were computed with."""
    import torch

    out_tokens = []
    with torch.no_grad():
        for p in prompts:
            out, toks = model(torch.tensor([p]), use_cache=True), []
            for _ in range(steps):
                toks.append(int(out.logits[0, -1].argmax()))
                out = model(torch.tensor([[toks[-1]]]), cache=out.past_key_values, use_cache=True)
            out_tokens.append(toks)
    return out_tokens


@pytest.mark.parametrize("attention", ["onnx", "plugin"])
def test_longrope_sequences_crossing_original_max(hf_folder, tmp_path, attention, request):
    """Prompts of 20..30 tokens, 16 greedy steps, original_max 32: every sequence switches to the
    long factors during decode. Served with chunked prefill (8-token budget), the tokens equal
    transformers' forward with its cache carried along (short-rotated keys stay in the cache).
    transformers' `generate` instead drops the cache of a Phi-3 sequence when it first outgrows
    original_max and recomputes it with the long factors (Phi3ForCausalLM.prepare_inputs_for_
    generation): its tokens are those of the full recompute, and differ (docs/ARCHITECTURE.md "longrope")."""
    from kvexport.exporter.validate import reference

    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    src = hf_folder("phi3", **_longrope(32))
    out, _ = build(str(src), tmp_path / "b", BuildOptions(block_size=4, max_seq_len=64, validate=False,
                                                          attention=io.Attention(attention)))
    model = source.load_model(source.resolve(str(src)))
    prompts = engine_parity.random_prompts(6, 128, 20, 31, seed=1)
    assert max(map(len, prompts)) <= 32 < min(map(len, prompts)) + 16
    llm = LLM(out, kv_cache_memory="1MiB", max_num_batched_tokens=8)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    assert got == _cached_greedy(model, prompts, 16)
    if attention == "plugin":
        return  # what transformers' generate does is checked once
    generate = engine_parity.hf_greedy(model, prompts, 16)
    # the build's validation reference decodes over transformers' cache, as the graphs do (exporter/validate.py)
    assert [t[:16] for t in reference(model, prompts, 16)[0]] == got
    assert generate != got
