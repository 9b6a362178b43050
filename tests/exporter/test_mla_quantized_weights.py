"""int8 / int4 weights on multi-head latent attention builds (DeepSeek-V3 / V2: exporter/mla.py
`linears`, exporter/quantize.py `float_linears`), on tests/exporter/test_deepseek_mla.py's tiny
models (V3: q_lora_rank, grouped sigmoid routing, a shared expert; V2: one q_proj, softmax
group_limited_greedy; the first layer dense in both): round-to-nearest builds validate against
transformers within the int4 / int8 weight bounds (exporter/validate.py); the graphs hold codes
for every plain 2-D matmul (q / q_a / q_b, kv_a, o, dense MLP, shared and routed experts) and
float32 W_UK / W_UV; onnxruntime fuses every one of them into MatMulNBits; `kvexport plan`
counts the build's bytes exactly; what stays unsupported is refused by name."""

import collections

import onnx
import pytest
import torch
from onnx import TensorProto

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.validate import MIN_AGREEMENT, TOLERANCE




from testkit.builds import stored_tensors  # noqa: E402
from testkit.families import tiny_config  # noqa: E402  (deepseek: 2 layers: dense, then 8 experts + 1 shared)
EXPERTS = 8
OPTS = dict(block_size=4, max_seq_len=64, validate_steps=8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """folder(family) -> test_deepseek_mla.py's tiny random model, saved (cached)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def make(family: str):
        if family not in cache:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_config(family))
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.dim() >= 2:
                        p.mul_(4.0)
                    if name.endswith("e_score_correction_bias"):
                        p.copy_(torch.rand_like(p) * 0.5)
            d = tmp_path_factory.mktemp(family)
            model.save_pretrained(d, safe_serialization=True)
            cache[family] = d
        return cache[family]

    return make


def _expected(family: str) -> set[str]:
    """Graph names of the matrices a quantized build of the tiny model stores as codes."""
    attn = ("attn.q_a", "attn.q_b") if family == "deepseek_v3" else ("attn.q",)
    names = {f"model.layers.{i}.{x}.weight" for i in (0, 1) for x in attn + ("attn.kv_a", "attn.o", "mlp.up",
                                                                                 "mlp.down")}
    names |= {f"model.layers.1.mlp.experts.{e}.{w}.weight" for e in range(EXPERTS) for w in ("up", "down")}
    return names | {"lm_head.quantized.weight"}


CASES = [("deepseek_v3", "int4", "plugin"), ("deepseek_v3", "int8", "onnx"),
         ("deepseek_v2", "int4", "onnx"), ("deepseek_v2", "int8", "plugin")]


@pytest.fixture(scope="module")
def built(folder, tmp_path_factory):
    cache = {}

    def get(family, weights, attention):
        key = (family, weights, attention)
        if key not in cache:
            cache[key] = build(str(folder(family)), tmp_path_factory.mktemp("q") / family,
                               BuildOptions(attention=io.Attention(attention), weights=weights, quant_method="rtn",
                                            **OPTS))
        return cache[key]

    return get


@pytest.mark.parametrize("family,weights,attention", CASES, ids=["-".join(c) for c in CASES])
def test_quantized_mla_build_validates_and_stores_codes(built, family, weights, attention):
    """The build's validation (4 prompts, 8 greedy steps, teacher-forced logits) passes the
    weights' bound; the decode graph holds int4/int8 codes for every MLA projection, o_proj, the
    dense MLP, the shared expert and all 8 experts (V3: 28 + the LM head, V2: 26 + 1), and W_UK /
    W_UV as float32 initializers; the manifest counts and names them and says what stayed float.
    Measured (2 cores): v3 int4 plugin max |Δ| 1.27, 55.6% greedy agreement; v3 int8 onnx 1.31,
    91.7%; v2 int4 onnx 0.81, 66.7%; v2 int8 plugin 0.17, 94.4% (fp32 builds: identical tokens)."""
    out, m = built(family, weights, attention)
    v, key = m.validation, f"{weights}_weights"
    report = (f"{family} --weights {weights} --attention {attention}: max |Δ| {v.max_abs_diff:.3f} (bound "
              f"{TOLERANCE[key]}), greedy agreement {v.token_agreement:.1%} (min {MIN_AGREEMENT[key]:.0%})")
    assert v.passed and v.tolerance == TOLERANCE[key] and v.steps == 8, report
    assert v.max_abs_diff > 0, report  # the codes are really used
    g = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False).graph
    inits = {t.name: t for t in g.initializer}
    codes = {n.removesuffix(".q") for n in inits if n.endswith(".weight.q")}
    assert codes == _expected(family), report
    bits = {TensorProto.INT4 if weights == "int4" else TensorProto.INT8}
    assert {inits[n + ".q"].data_type for n in codes - {"lm_head.quantized.weight"}} == bits
    dq = [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0].endswith(".weight.q")]
    assert {n.input[0].removesuffix(".q") for n in dq} == codes, report  # each feeds a DequantizeLinear
    for i in (0, 1):  # the absorbed halves of kv_b_proj: float32 [H, N, L] / [H, L, V]
        assert list(inits[f"model.layers.{i}.attn.w_uk"].dims) == [4, 16, 32]
        assert list(inits[f"model.layers.{i}.attn.w_uv"].dims) == [4, 32, 12]
        assert {inits[f"model.layers.{i}.attn.{w}"].data_type for w in ("w_uk", "w_uv")} == {TensorProto.FLOAT}
        assert f"model.layers.{i}.attn.w_uk.q" not in inits
    assert inits["model.layers.1.mlp.router.weight"].data_type == TensorProto.FLOAT
    q = m.weights.quantization
    assert (q.precision, q.method, q.block_size, q.quantized.matrices) == (weights, "rtn", 32, len(codes))
    attn = "attn.q_a,attn.q_b" if family == "deepseek_v3" else "attn.q"
    assert q.quantized.names.startswith(f"model.layers.*.{{{attn},attn.kv_a,attn.o,mlp.up,mlp.down,"
                                        f"mlp.experts.*.up,mlp.experts.*.down}}, lm_head.quantized.weight")
    assert {"MLA W_UK / W_UV (kv_b_proj)", "MoE routers"} <= set(q.kept)


def test_every_quantized_mla_matmul_fuses_to_matmulnbits_in_the_runtime_session(built, tmp_path):
    """The runtime's onnxruntime session (its optimizer settings) turns each DequantizeLinear ->
    MatMul of the V3 int4 build into MatMulNBits: the 28 decoder matrices + the LM head; the only
    DequantizeLinear left reads the embedding rows."""
    import onnxruntime as ort

    from kvexport.runtime.execution.ort_backends import ort_backend

    out, m = built("deepseek_v3", "int4", "plugin")
    backend = ort_backend(out, m, 4)
    so = backend.session_options()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(out / io.PREFILL_GRAPH), so, providers=["CPUExecutionProvider"],
                         disabled_optimizers=backend.disabled_optimizers())
    g = onnx.load(so.optimized_model_filepath, load_external_data=False).graph
    counts = collections.Counter(n.op_type for n in g.node)
    made = {o: n.op_type for n in g.node for o in n.output}
    assert counts["MatMulNBits"] == m.weights.quantization.quantized.matrices == 29, counts
    assert {made.get(n.input[0]) for n in g.node if n.op_type == "DequantizeLinear"} == {"Gather"}


def test_plan_counts_the_mla_matrices(built, folder, tmp_path):
    """`kvexport plan` of the int4 and int8 builds: their parameters exactly and the bytes of every
    stored tensor (codes of the 2-D matmuls, float32 W_UK / W_UV and routers; int8 in rtn's blocks
    of 32, what a MoE / MLA model builds); and of an fp16 build, whose W_UK / W_UV stay float32 too."""
    from kvexport.exporter.plan import plan
    from kvexport.manifest import load

    fp16, _ = build(str(folder("deepseek_v2")), tmp_path / "fp16",
                    BuildOptions(weights="fp16", validate=False, **OPTS))
    for out in (built("deepseek_v3", "int4", "plugin")[0], built("deepseek_v2", "int8", "plugin")[0], fp16):
        m = load(out)
        stored = stored_tensors(out)
        e = next(e for e in plan(str(out)).weights if e.precision == m.weights.precision)
        assert (e.parameters, e.bytes) == (m.weights.parameters, sum(stored.values())), (m.weights.precision, e)
        assert e.block_size == (32 if m.weights.quantization else None)


def test_refusals_name_what_stays_unsupported(folder, tmp_path):
    """Plain `--weights int8` (smoothquant by default) and awq are refused for MLA, naming
    `--quant-method rtn`; quantized weights do not lift the layout refusal (test_deepseek_mla.py has
    the rest)."""
    src = str(folder("deepseek_v3"))
    for opts, match in (
            (BuildOptions(weights="int8", validate=False),
             r"--quant-method smoothquant is not implemented for multi-head latent attention \(deepseek_v3\).*"
             r"--quant-method rtn.*--weights int8 without --quant-method means smoothquant"),
            (BuildOptions(weights="int4", quant_method="awq", validate=False),
             r"--quant-method awq is not implemented for multi-head latent attention.*--weights int4 --quant-method "
             r"rtn"),
            (BuildOptions(layout=io.KVLayout.CONTIGUOUS, weights="int4", quant_method="rtn", validate=False),
             "--layout contiguous is not implemented for multi-head latent attention")):
        with pytest.raises(ConfigError, match=match):
            build(src, tmp_path / "x", opts)
