"""olmo_hybrid (OLMo-Hybrid: exporter/families.py, exporter/linear_attention.py OLMO_HYBRID) against transformers
on a tiny random model (tests/testkit/families.py CASES_OLMO_HYBRID: 3 gated DeltaNet : 1 attention layer, GQA in
both, no RoPE as the released checkpoints): the spec read from config.json (separate q/k/v/g/b/a projections,
beta x 2 by linear_allow_neg_eigval, the gated norm's own eps 1e-5, OLMo-2 post-norm attention layers beside
pre-norm linear layers); fp32 parity of the paged `onnx` and `plugin` builds (greedy identical, |Δ logits| within
the fp32 bound), and of the RoPE form; served by the runtime with the recurrent state in its state pool:
batching, chunked prefill, preemption and a 150-token prompt (three 64-token chunks of the chunked rule with
beta up to 2), prefix caching resuming from a state checkpoint with the same tokens as recomputation and
transformers; and the refusals."""

import onnx
import pytest

from kvexport import io
from kvexport.errors import UnsupportedModelError
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import read_spec
from kvexport.exporter.validate import TOLERANCE
from testkit import parity
from testkit.families import CASES_OLMO_HYBRID, tiny_config

FAMILY = "olmo_hybrid"
ROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0))  # the RoPE form (attention layers only)


def _native_or_skip():
    from kvexport.plugins.gated_delta import native

    if native.library_or_why()[0] is None:
        pytest.skip("the native op library has no GatedDeltaRule (scripts/build_cpu_ops.sh)")


@pytest.fixture(scope="module")
def built(hf_folder, tmp_path_factory):
    """(attention, variant) -> (build dir, manifest, transformers model): validated paged builds
    (max_seq_len 256: a long prompt runs several chunks of the chunked rule)."""
    cache = {}

    def get(attention: io.Attention, variant: str = "nope"):
        if (attention, variant) not in cache:
            overrides = {**CASES_OLMO_HYBRID[FAMILY], **(ROPE if variant == "rope" else {})}
            src = hf_folder(FAMILY, **overrides)
            out, m = build(str(src), tmp_path_factory.mktemp("olmo-hybrid") / f"{variant}-{attention.value}",
                           BuildOptions(block_size=4, max_seq_len=256, attention=attention))
            cache[attention, variant] = (out, m, source.load_model(source.resolve(str(src))))
        return cache[attention, variant]

    return get


def test_spec_reads_olmo_hybrid(hf_folder):
    spec = read_spec(source.load_config(source.resolve(str(hf_folder(FAMILY, **CASES_OLMO_HYBRID[FAMILY])))))
    la = spec.linear_attn
    assert spec.family == FAMILY and la.layers == (0, 1, 2) and spec.kv_layers == (3,)
    assert (la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim, la.conv_kernel) == (2, 4, 8, 12, 4)
    assert (la.beta_scale, la.norm_eps, spec.norm_eps) == (2.0, 1e-5, 1e-6)  # the gated norm's eps is its own
    assert not spec.attn_output_gate and spec.qk_norm == "all" and spec.norm_offset == 0.0
    assert [spec.norms_at(i) for i in range(4)] == ["pre", "pre", "pre", "post"]
    assert (spec.position, spec.rope, {spec.rope_kind(i) for i in range(4)}) == ("none", None, {"none"})
    d = spec.to_json()["linear_attn"]
    assert (d["beta_scale"], d["norm_eps"]) == (2.0, 1e-5)
    plain = read_spec(tiny_config(FAMILY, linear_allow_neg_eigval=False, **ROPE))
    assert plain.linear_attn.beta_scale == 1.0 and "beta_scale" not in plain.to_json()["linear_attn"]
    assert plain.position == "rope" and plain.rope.theta == 10000.0 and plain.rotary_dim == 16


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
    names = [t.name for t in m.graphs["prefill"].inputs]
    assert [n for n in names if "cache" in n] == ["key_cache.3", "value_cache.3"]
    assert [n for n in names if "state" in n] == [io.STATE_SLOTS] + io.state_names(3)
    assert m.kv.bytes_per_token == 2 * 2 * 16 * 4  # the attention layer's KV only
    graph = onnx.load(str(out / m.graphs["decode"].file), load_external_data=False).graph
    assert not [t.name for t in graph.initializer if t.name.startswith("rope")]  # NoPE: no RoPE tables
    if attention == "plugin":
        from kvexport.plugins.gated_delta.spec import OP_TYPE

        assert [n.op_type for n in graph.node if n.domain == io.PLUGIN_DOMAIN] == [OP_TYPE] * 3 + [io.PLUGIN_OP]


def test_parity_fp32_rope(built):
    """The RoPE form (rope_theta set): its attention layer rotated after the all-heads q/k norms."""
    out, m, _ = built(io.Attention.ONNX, "rope")
    v = m.validation
    assert m.model.spec["position"] == "rope" and v.passed and v.greedy_identical, v
    assert v.max_abs_diff <= TOLERANCE["fp32"] and v.steps == 16


def test_served_batched_chunked_preempted(built):
    """6 prompts of 10..30 tokens in 8-token chunks on 14 usable 4-token blocks (batching, state carried
    across chunks, preemption by recompute), then a 150-token prompt in one step beside short ones (three
    64-token chunks of the chunked rule, beta up to 2): tokens equal transformers' greedy ones."""
    parity.check_hybrid_served(*built(io.Attention.ONNX))


def test_prefix_cache_resumes_from_a_state_checkpoint(built):
    """The default (`plugin`) build: later prompts resume from a state checkpoint with the tokens of
    recomputation and transformers (testkit.parity.check_hybrid_prefix_resume)."""
    _native_or_skip()
    out, _, model = built(io.Attention.PLUGIN)
    parity.check_hybrid_prefix_resume(out, model)


def test_refusals(hf_folder, tmp_path):
    make = lambda **kw: read_spec(tiny_config(FAMILY, **kw))  # noqa: E731
    with pytest.raises(UnsupportedModelError, match="'hidden_act' is 'gelu'; the gated DeltaNet conv supports silu"):
        make(hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="'layer_types' has 'sliding_attention'"):
        make(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"])
    with pytest.raises(UnsupportedModelError, match="'rope_parameters.rope_type' of a olmo_hybrid model is "
                                                    "'dynamic'; supported values: default, linear, llama3, yarn"):
        make(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    src = str(hf_folder(FAMILY, **CASES_OLMO_HYBRID[FAMILY]))
    with pytest.raises(UnsupportedModelError, match="--layout contiguous"):
        build(src, tmp_path / "x", BuildOptions(block_size=4, max_seq_len=64, validate=False,
                                                layout=io.KVLayout.CONTIGUOUS))
