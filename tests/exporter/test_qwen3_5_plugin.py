"""Gated DeltaNet hybrids (qwen3_5_text, qwen3_next) built with `--attention plugin`: one
kvexport::GatedDeltaRule node per linear layer (plugins/gated_delta/) beside the PagedAttention node of
the attention layer, on the same tiny random models as tests/exporter/test_qwen3_5.py. fp32 parity with
transformers (greedy identical, |Δ logits| within the fp32 bound) through the native CPU op, cross-checked
with the reference op; served by the runtime: batching, chunked prefill, preemption and a long prompt
give the same tokens as the `onnx` form and transformers, and prefix caching resumes from a state
checkpoint with the same tokens as recomputation."""

import onnx
import pytest

from kvexport import LLM, SamplingParams, io
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.validate import TOLERANCE
from kvexport.plugins.gated_delta import native
from kvexport.plugins.gated_delta.spec import OP_TYPE
from testkit import parity
from testkit.families import CASES_HYBRID

pytestmark = pytest.mark.skipif(native.library_or_why()[0] is None,
                                reason="the native op library has no GatedDeltaRule (scripts/build_cpu_ops.sh)")


@pytest.fixture(scope="module")
def built(hf_folder, tmp_path_factory):
    """(family, attention) -> (build dir, manifest, transformers model); plugin builds validated."""
    cache = {}

    def get(family, attention=io.Attention.PLUGIN):
        if (family, attention) not in cache:
            src = hf_folder(family, **CASES_HYBRID[family])
            out, m = build(str(src), tmp_path_factory.mktemp("hybrid-plugin") / f"{family}-{attention.value}",
                           BuildOptions(block_size=4, max_seq_len=256, attention=attention,
                                        validate=attention is io.Attention.PLUGIN))
            cache[family, attention] = (out, m, source.load_model(source.resolve(str(src))))
        return cache[family, attention]

    return get


@pytest.mark.parametrize("family", CASES_HYBRID)
def test_parity_fp32_plugin(built, family):
    out, m, _ = built(family)
    assert (m.kv.layout, m.kv.attention) == ("paged", "plugin")
    v = m.validation
    assert v.passed and v.greedy_identical and v.op == "native", v
    assert v.max_abs_diff <= TOLERANCE["fp32"] and v.steps == 16
    assert v.cross_check is not None and v.cross_check.op == "reference" and v.cross_check.passed
    for phase in ("prefill", "decode"):
        graph = onnx.load(str(out / m.graphs[phase].file), load_external_data=False).graph
        nodes = [n for n in graph.node if n.domain == io.PLUGIN_DOMAIN]
        assert [n.op_type for n in nodes] == [OP_TYPE] * 3 + [io.PLUGIN_OP]  # layers 0-2 linear, 3 attention
        assert [n.input[5] for n in nodes[:3]] == [io.recurrent_state(j) for j in range(3)]  # the pools, by slot
        assert "Loop" not in {n.op_type for n in graph.node}  # no standard-ONNX chunked rule left
        assert [n.op_type for n in graph.node if io.recurrent_state(0) in n.input] == [OP_TYPE]  # the node alone reads it
    names = [t.name for t in m.graphs["prefill"].inputs]
    assert [n for n in names if "state" in n] == [io.STATE_SLOTS] + io.state_names(3)


def test_served_like_the_onnx_form(built):
    """6 prompts of 10..30 tokens in 8-token chunks on 14 usable 4-token blocks (batching, state carried
    across chunks, preemption by recompute), then a 150-token prompt in one step beside short ones: the
    plugin build's tokens equal the `onnx` build's and transformers' greedy ones."""
    out, m, model = built("qwen3_5_text")
    onnx_out, _, _ = built("qwen3_5_text", io.Attention.ONNX)
    prompts = parity.random_prompts(6, 128, 10, 31, seed=1)
    per_token = io.kv_bytes_per_token(1, m.kv.num_kv_heads, m.kv.head_dim, io.DType(m.kv.dtype))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs, impls = [], []
    for d in (out, onnx_out):
        llm = LLM(d, kv_cache_memory=15 * 4 * per_token, max_num_batched_tokens=8)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        impls.append(llm.engine.runner.backend.attention_impl)
        assert llm.engine.scheduler.num_preemptions > 0
    assert impls == ["plugin (native CPU op)", "onnx"]
    assert runs[0] == runs[1] == parity.hf_greedy(model, prompts, 12)
    long = parity.random_prompts(1, 128, 150, 151, seed=3) + parity.random_prompts(2, 128, 5, 9, seed=4)
    got = LLM(out, kv_cache_memory="2MiB", max_num_batched_tokens=256,
              enable_prefix_caching=False).generate(long, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in got] == parity.hf_greedy(model, long, 8)


def test_prefix_cache_resumes_from_a_state_checkpoint(built):
    """Later prompts resume from a state checkpoint with the tokens of recomputation and transformers
    (testkit.parity.check_hybrid_prefix_resume)."""
    out, _, model = built("qwen3_5_text")
    parity.check_hybrid_prefix_resume(out, model)