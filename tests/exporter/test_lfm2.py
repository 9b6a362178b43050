"""lfm2 (Liquid LFM2: exporter/short_conv.py, exporter/families.py) against transformers on a tiny random model
(tests/testkit/families.py CASES_LFM2: 3 short-conv : 1 attention layer, GQA with per-head q/k norms, RoPE): the
spec read from config.json (layer_types conv / full_attention, the MLP width by transformers' Lfm2MLP rule, the
norms' norm_eps) and its manifest form (linear_attn with mixer "short_conv": a conv state per conv layer, no
recurrent matrix); fp32 parity of the paged `onnx` and `plugin` builds (greedy identical, |Δ logits| within the
fp32 bound), and of a conv_bias, untied-head variant; served by the runtime with the conv state in its state pool:
batching, chunked prefill, preemption; prefix caching resuming from a state checkpoint with the same tokens as
recomputation and transformers, and from the host KV tier; `kvexport plan`'s bytes; and the refusals."""

import onnx
import pytest

from kvexport import SamplingParams, io
from kvexport.errors import UnsupportedModelError
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import read_spec
from kvexport.exporter.plan import plan
from kvexport.exporter.short_conv import ShortConvSpec
from kvexport.exporter.spec import ModelSpec
from kvexport.exporter.validate import TOLERANCE
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.engine import LLMEngine
from kvexport.runtime.execution.state_store import StateStore
from testkit import parity
from testkit.builds import stored_tensors
from testkit.families import CASES_LFM2, tiny_config

FAMILY = "lfm2"
VARIANTS = {"released": {}, "bias": dict(conv_bias=True, tie_word_embeddings=False)}


def _native_or_skip():
    from kvexport.plugins.paged_attention import native

    if native.library() is None:
        pytest.skip("the native PagedAttention op library is not built (scripts/build_cpu_ops.sh)")


@pytest.fixture(scope="module")
def built(hf_folder, tmp_path_factory):
    """(attention, variant) -> (build dir, manifest, transformers model): validated paged builds
    (max_seq_len 256: a long prompt pads a step's rows to several 64-token chunks)."""
    cache = {}

    def get(attention: io.Attention, variant: str = "released"):
        if (attention, variant) not in cache:
            src = hf_folder(FAMILY, **CASES_LFM2[FAMILY], **VARIANTS[variant])
            out, m = build(str(src), tmp_path_factory.mktemp("lfm2") / f"{variant}-{attention.value}",
                           BuildOptions(block_size=4, max_seq_len=256, attention=attention))
            cache[attention, variant] = (out, m, source.load_model(source.resolve(str(src))))
        return cache[attention, variant]

    return get


def test_spec_reads_lfm2(hf_folder):
    spec = read_spec(source.load_config(source.resolve(str(hf_folder(FAMILY, **CASES_LFM2[FAMILY])))))
    sc = spec.linear_attn
    assert spec.family == FAMILY and isinstance(sc, ShortConvSpec)
    assert (sc.layers, sc.conv_dim, sc.conv_kernel, sc.conv_bias) == ((0, 1, 3), 64, 3, False)
    assert spec.kv_layers == (2,) and [spec.norms_at(i) for i in range(4)] == ["pre"] * 4
    assert spec.intermediate_size == 112  # int(2/3 x 100) = 66, int(x 1.5) = 99, up to a multiple of 16
    assert (spec.norm_eps, spec.activation, spec.qk_norm, spec.tie_embeddings) == (1e-6, "silu", "head", True)
    assert (spec.position, spec.rope.theta, spec.rotary_dim) == ("rope", 1e6, 16)
    d = spec.to_json()["linear_attn"]
    assert d == {"layers": [0, 1, 3], "conv_dim": 64, "conv_kernel": 3, "conv_bias": False, "mixer": io.SHORT_CONV}
    assert ModelSpec.from_json(spec.to_json()) == spec
    # the state schema: a conv state per conv layer, no recurrent matrix
    n, dims = io.state_dims(spec.to_json())
    assert (n, dims, dims.recurrent, dims.shapes) == (3, io.StateDims(2, 64), False, ((2, 64),))
    assert io.state_names(n, dims.recurrent) == ["conv_state.0", "conv_state.1", "conv_state.2"]
    assert io.new_state_names(n, dims.recurrent) == ["new_conv_state.0", "new_conv_state.1", "new_conv_state.2"]
    assert io.state_bytes_per_sequence(n, dims) == 3 * 2 * 64 * 4
    store = StateStore.for_model(spec.to_json(), num_slots=2)
    assert store.names == io.state_names(3, False) and store.layout() == [("float32", (2, 64))] * 3
    assert store.bytes_per_slot == 3 * 2 * 64 * 4 == store.read(1).nbytes
    # transformers' default MLP rule (multiplier 1.0, multiple of 256) and the rule switched off
    assert read_spec(tiny_config(FAMILY, block_multiple_of=256, block_ffn_dim_multiplier=1.0)).intermediate_size == 256
    assert read_spec(tiny_config(FAMILY, block_auto_adjust_ff_dim=False)).intermediate_size == 100


@pytest.mark.parametrize("layout,attention", [("paged", "onnx"), ("paged", "plugin")])
def test_parity_fp32(built, layout, attention):
    if attention == "plugin":
        _native_or_skip()
    out, m, _ = built(io.Attention(attention))
    assert (m.kv.layout, m.kv.attention) == (layout, attention)
    v = m.validation
    assert v.passed and v.greedy_identical, v
    assert v.max_abs_diff <= TOLERANCE["fp32"] and v.steps == 16
    if attention == "plugin":
        assert v.op == "native" and v.cross_check is not None and v.cross_check.passed
    for phase in ("prefill", "decode"):
        g = m.graphs[phase]
        names = [t.name for t in g.inputs]
        assert [n for n in names if "cache" in n] == ["key_cache.2", "value_cache.2"]
        assert [n for n in names if "state" in n] == [io.STATE_SLOTS, "conv_state.0", "conv_state.1", "conv_state.2"]
        assert [t.name for t in g.outputs if "state" in t.name] == io.new_state_names(3, recurrent=False)
    assert m.kv.bytes_per_token == 2 * 2 * 16 * 4  # the attention layer's KV only
    graph = onnx.load(str(out / m.graphs["decode"].file), load_external_data=False).graph
    custom = [n.op_type for n in graph.node if n.domain == io.PLUGIN_DOMAIN]
    assert custom == ([io.PLUGIN_OP] if attention == "plugin" else [])  # the conv: standard ONNX in both forms


def test_parity_fp32_conv_bias_untied(built):
    """conv_bias (in_proj, conv and out_proj biases) and an lm_head of its own."""
    out, m, _ = built(io.Attention.ONNX, "bias")
    v = m.validation
    assert m.model.spec["linear_attn"]["conv_bias"] and not m.model.spec["tie_embeddings"]
    assert v.passed and v.greedy_identical and v.max_abs_diff <= TOLERANCE["fp32"], v


def test_served_batched_chunked_preempted(built):
    """6 prompts of 10..30 tokens in 8-token chunks on 14 usable 4-token blocks (batching, the conv state carried
    across chunks, preemption by recompute), then a 150-token prompt in one step beside short ones: tokens equal
    transformers' greedy ones."""
    _, want = parity.check_hybrid_served(*built(io.Attention.ONNX))
    assert len({t for w in want for t in w}) > 12  # not one repeated token


def test_prefix_cache_resumes_from_a_state_checkpoint(built):
    """The default (`plugin`) build: later prompts resume from a conv-state checkpoint with the tokens of
    recomputation and transformers (testkit.parity.check_hybrid_prefix_resume)."""
    _native_or_skip()
    out, _, model = built(io.Attention.PLUGIN)
    parity.check_hybrid_prefix_resume(out, model)


def test_a_checkpoint_resumes_from_the_host_tier(built):
    """The conv-state checkpoints move through the host KV tier with the blocks (io.STATE_GROUP: a checkpoint's
    payload is every conv-state pool's slot): a prompt whose blocks and checkpoint the pool evicted resumes from
    host memory with the tokens recomputation gives."""
    out, _, _ = built(io.Attention.ONNX)
    gen = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = [3 + (i * 7) % 120 for i in range(30)]  # 7 full blocks a lookup can hit (28 tokens)
    others = [[5 + (i * 11 + k * 13) % 110 for i in range(30)] for k in range(6)]

    def run(engine, p):
        rid = engine.add_request(list(p), gen)
        while engine.has_unfinished():
            engine.step()
        return engine.pop_output(rid)

    want = run(LLMEngine(out, EngineConfig(kv_cache_memory="1MiB", enable_prefix_caching=False)), prompt).token_ids
    engine = LLMEngine(out, EngineConfig(kv_cache_memory="16KiB", max_num_seqs=1, state_checkpoints=2,
                                         state_checkpoint_blocks=2, kv_offload_memory="16MiB"))
    assert engine.kv_connector.block_bytes[io.STATE_GROUP] == engine.backend.state.bytes_per_slot == 3 * 2 * 64 * 4
    assert run(engine, prompt).token_ids == want
    for p in others:  # fill the pool and the checkpoint slots: the prompt's blocks and checkpoints are evicted
        run(engine, p)
    assert engine.kv_connector.scheduler.cached(io.FULL_GROUP, engine.kv_connector.prompt_blocks(prompt)[0][2]) is None
    again = run(engine, prompt)
    assert again.token_ids == want and again.num_cached_prompt_tokens == 28
    assert engine.kv.state.tier_hits == 1 and engine.stats().tiers.host_hits == 8  # 7 KV + 1 state


def test_plan_counts_the_bytes_the_build_stores(built):
    """`kvexport plan` of a build: the weights estimate equals the parameters and the tensors in weights.data (conv
    layers: in_proj / out_proj matmuls, float32 taps; the attention layer's per-head q/k norms), and the fit gives
    each sequence its conv state (layers x (K-1) x hidden x 4 bytes)."""
    for variant in VARIANTS:
        out, m, _ = built(io.Attention.ONNX, variant)
        stored = stored_tensors(out)
        p = plan(str(out), m.weights.bytes + 1_000_000, max_num_seqs=2, max_num_batched_tokens=16)
        e = next(e for e in p.weights if e.precision == (m.weights.precision or m.dtype))
        assert (e.parameters, e.bytes) == (m.weights.parameters, sum(stored.values())), variant
        assert (p.state_bytes_per_seq, p.linear_layers) == (3 * 2 * 64 * 4, 3)
        assert any("short-conv (LFM2): no KV, 1,536 bytes" in n for n in p.notes)
        own = next(f for f in p.fits if f.build)
        assert own.state_bytes == (EngineConfig().state_checkpoints + 2) * 1536


def test_refusals(hf_folder, tmp_path):
    make = lambda **kw: read_spec(tiny_config(FAMILY, **kw))  # noqa: E731
    with pytest.raises(UnsupportedModelError, match="'layer_types' has 'sliding_attention', which kvexport does not "
                                                    "support in an lfm2 model; supported values: conv, full_attention"):
        make(layer_types=["conv", "sliding_attention", "full_attention", "conv"])
    with pytest.raises(UnsupportedModelError, match="'layer_types' lists no full_attention layer"):
        make(layer_types=["conv"] * 4)
    with pytest.raises(UnsupportedModelError, match="'conv_L_cache' is 1; kvexport supports an integer >= 2"):
        make(conv_L_cache=1)
    with pytest.raises(UnsupportedModelError, match="'rope_parameters.rope_type' of a lfm2 model is 'linear'; "
                                                    "supported values: default"):
        make(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))
    cfg = tiny_config(FAMILY)
    cfg.model_type = "lfm2_moe"  # LFM2's mixture of experts: another model_type, not supported
    with pytest.raises(UnsupportedModelError, match="'model_type' is 'lfm2_moe', which kvexport does not support"):
        read_spec(cfg)
    src = str(hf_folder(FAMILY, **CASES_LFM2[FAMILY]))
    with pytest.raises(UnsupportedModelError, match=r"--layout contiguous is not supported for a lfm2 model "
                                                    r"\(short-conv \(LFM2\) layers"):
        build(src, tmp_path / "x", BuildOptions(block_size=4, max_seq_len=64, validate=False,
                                                layout=io.KVLayout.CONTIGUOUS))
