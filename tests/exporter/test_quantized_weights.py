"""int8 / int4 weights (exporter/quantize.py, weight_sources.py, awq.py): the stored codes, the
QDQ graphs (block-wise DequantizeLinear -> MatMul, opset 21) in every layout, the manifest,
GGUF blocks read exactly, AWQ against round-to-nearest, and refused options."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.exporter import quantize as qz
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.validate import MIN_AGREEMENT, TOLERANCE
from kvexport.manifest import Manifest, WeightsEntry, load
from kvexport.runtime.execution.ort_quant import int8_dynamic

OPTS = dict(block_size=4, max_seq_len=64)


def test_int4_packing_is_onnx_int4():
    """pack_int4 writes what onnx itself reads back as INT4 (low nibble first), odd counts too."""
    q = np.random.default_rng(0).integers(-8, 8, size=(5, 7)).astype(np.int8)
    t = helper.make_tensor("q", TensorProto.INT4, list(q.shape), qz.pack_int4(q).tobytes(), raw=True)
    np.testing.assert_array_equal(numpy_helper.to_array(t).astype(np.int8), q)
    np.testing.assert_array_equal(qz.unpack_int4(qz.pack_int4(q), q.shape), q)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [32, 64])
def test_rtn_error_within_half_a_step(bits, block):
    w = np.random.default_rng(1).standard_normal((100, 12)).astype(np.float32)  # K not a multiple of B
    m = qz.quantize_rtn(w, bits, block)
    assert m.scale.shape == (-(-100 // block), 12) and m.q.shape == w.shape
    assert np.abs(m.q).max() <= qz.QMAX[bits]
    step = np.repeat(m.scale, block, axis=0)[:100]
    assert np.all(np.abs(m.dequantize() - w) <= step / 2 + 1e-6)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_map_exactly(kind):
    """Blocks made by the gguf package's own quantizer read back, code for code, as its own
    dequantizer sees them (Q4_1: int4 codes, zero point -8 and the block minimum as offset)."""
    import gguf
    from gguf import quants

    from kvexport.exporter.weight_sources import read_gguf_block

    w = np.random.default_rng(2).standard_normal((6, 96)).astype(np.float32)  # [out, in]
    qt = gguf.GGMLQuantizationType[kind]
    raw = quants.quantize(w, qt)
    m = read_gguf_block(kind, raw, 96)
    assert m.q.shape == (96, 6) and m.block_size == 32 and m.bits == (8 if kind == "Q8_0" else 4)
    np.testing.assert_array_equal(m.dequantize(), quants.dequantize(raw, qt).T)
    assert read_gguf_block("Q6_K", raw, 96) is None  # not block-32: re-quantized instead


@pytest.mark.parametrize("layout,attention", [("contiguous", "onnx"), ("paged", "onnx"), ("paged", "plugin")])
@pytest.mark.parametrize("weights,block", [("int8", 32), ("int8", 0), ("int4", None)])
def test_quantized_build_validates_in_every_layout(hf_folder, tmp_path, layout, attention, weights, block, cpu_op):
    """Round-to-nearest in blocks of 32 along K (DQ axis=0; int4's default blocks); int8 block 0 =
    per output channel (DQ axis=1). Paged builds validate as served (per-channel int8 rewritten
    to dynamic int8 at session load), contiguous ones in their portable QDQ form."""
    src = str(hf_folder("llama", num_key_value_heads=2))
    out, m = build(src, tmp_path / "b", BuildOptions(layout=io.KVLayout(layout), attention=io.Attention(attention),
                                                     weights=weights, weight_block_size=block, quant_method="rtn",
                                                     **OPTS))
    v = m.validation
    key = f"{weights}_weights"
    assert v.passed and v.max_abs_diff <= TOLERANCE[key] and v.token_agreement >= MIN_AGREEMENT[key], v
    assert v.max_abs_diff > TOLERANCE["fp32"]  # the graphs really compute with rounded weights
    g = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False)
    assert {o.version for o in g.opset_import if o.domain == ""} == {io.QDQ_OPSET}
    dq = [n for n in g.graph.node if n.op_type == "DequantizeLinear" and n.input[0].endswith(".weight.q")]
    assert len(dq) == 4 * m.model.num_layers + 1  # q|k|v, o, gate|up, down per layer; the int8 LM head
    channel = block == 0
    attrs = {"axis": 1} if channel else {"axis": 0, "block_size": 32}
    head_attrs = {"axis": 0, "block_size": 32}  # per-channel builds too (quantize.py HEAD_CHANNEL_BUILDS_BLOCK)
    assert all({a.name: a.i for a in n.attribute} == (head_attrs if n.input[0].startswith("lm_head") else attrs)
               for n in dq)
    code_type = {i.name: i.data_type for i in g.graph.initializer}[dq[0].input[0]]
    assert code_type == (TensorProto.INT4 if weights == "int4" else TensorProto.INT8)
    assert m.weights.precision == weights
    q = m.weights.quantization
    assert (q.bits, q.block_size, q.method, q.symmetric) == (qz.BITS[weights], "channel" if channel else 32, "rtn",
                                                             True)
    assert q.matmul_accuracy == "auto"  # weight-only rounding: served ~exactly unless told otherwise
    assert int8_dynamic(g) == (len(dq) - 1 if channel else 0)  # what a CPU session derives from it
    assert "lm_head" in q.kept and q.quantized.matrices == 4 * m.model.num_layers + 1
    types = {i.name: i.data_type for i in g.graph.initializer}
    assert types[qz.QUANTIZED_HEAD + ".q"] == TensorProto.INT8  # the head stays int8 in int4 builds (HEAD_BITS)
    # untied embeddings: int8 too, their own codes, no float table
    assert types[qz.QUANTIZED_EMBED + ".q"] == TensorProto.INT8 and "model.embed_tokens.weight" not in types
    assert q.embeddings.bits == 8 and q.embeddings.block_size == q.lm_head.block_size


@pytest.mark.parametrize("layout,attention", [("contiguous", "onnx"), ("paged", "plugin")])
@pytest.mark.parametrize("weights,block", [("int4", None), ("int8", 0)])  # head blocks of 32 / per channel
def test_tied_embeddings_read_the_int8_head_codes(hf_folder, tmp_path, layout, attention, weights, block, cpu_op,
                                                  monkeypatch):
    """Tied models read the int8 [hidden, vocab] codes under two names (the head's MatMul and the
    embedding Gather on axis 1 each their own, so onnxruntime can fuse the head) that point at the
    same bytes of the weights file; no float table."""
    src = str(hf_folder("llama", num_key_value_heads=2, tie_word_embeddings=True))
    if block == 0:  # a per-channel head, as --backend tensorrt builds make it, validated on onnxruntime
        monkeypatch.setattr(qz, "HEAD_CHANNEL_BUILDS_BLOCK", qz.CHANNEL)
    out, m = build(src, tmp_path / "b", BuildOptions(layout=io.KVLayout(layout), attention=io.Attention(attention),
                                                     weights=weights, weight_block_size=block, quant_method="rtn",
                                                     **OPTS))
    assert m.validation.passed, m.validation
    g = onnx.load(str(out / io.PREFILL_GRAPH), load_external_data=False)
    names = {i.name for i in g.graph.initializer}
    assert "model.embed_tokens.weight" not in names and qz.QUANTIZED_HEAD + ".q" in names
    gathers = [n for n in g.graph.node if n.op_type == "Gather" and n.input[0] == "model.embed_tokens.quantized.q"]
    assert len(gathers) == 1 and gathers[0].attribute[0].i == 1
    where = {i.name: {e.key: e.value for e in i.external_data} for i in g.graph.initializer}
    for part in (".q", ".scale"):
        assert where["model.embed_tokens.quantized" + part] == where[qz.QUANTIZED_HEAD + part]
    spans = sorted({(int(w["offset"]), int(w["length"])) for w in where.values() if w})
    assert all(o1 + n1 <= o2 for (o1, n1), (o2, _) in zip(spans, spans[1:]))  # no other bytes shared or overlapped
    assert (out / io.WEIGHTS_FILE).stat().st_size == sum(spans[-1])  # the file ends at the last tensor
    _, m32 = build(src, tmp_path / "fp32", BuildOptions(layout=io.KVLayout(layout), validate=False, **OPTS))
    assert m.weights.parameters == m32.weights.parameters  # the shared codes count once


def test_int4_weights_file_is_smaller(hf_folder, tmp_path):
    """Linear weights shrink to 4 bits + a float32 scale per 32: on the tiny model (whose
    fp32 embeddings and 4 KiB-aligned tensors dominate) the file still halves."""
    src = str(hf_folder("llama", num_key_value_heads=2))
    _, m32 = build(src, tmp_path / "fp32", BuildOptions(validate=False, **OPTS))
    _, m4 = build(src, tmp_path / "int4", BuildOptions(weights="int4", validate=False, **OPTS))
    assert m4.weights.bytes < 0.55 * m32.weights.bytes
    assert m4.weights.parameters == m32.weights.parameters  # logical elements, not packed bytes


def test_awq_beats_rtn_on_its_own_objective():
    """The alpha grid includes 0 (plain rounding), so the chosen scales never do worse on the
    calibration activations; with a few loud input channels they do clearly better."""
    from kvexport.exporter.awq import best_scale

    rng = np.random.default_rng(3)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    x[:, :4] *= 30  # outlier input channels
    w = rng.standard_normal((64, 48)).astype(np.float32)
    s, alpha, err = best_scale(x, w, 4, 32)
    rtn = qz.quantize_rtn(w, 4, 32).dequantize()
    rtn_err = float(((x @ rtn - x @ w) ** 2).sum() / ((x @ w) ** 2).sum())
    assert alpha > 0 and err < 0.8 * rtn_err


def test_awq_build_folds_scales_and_validates(hf_folder, tmp_path):
    src = str(hf_folder("llama", num_key_value_heads=2))
    _, m = build(src, tmp_path / "awq", BuildOptions(weights="int4", quant_method="awq", calibration_tokens=64,
                                                    **OPTS))
    q = m.weights.quantization
    assert m.validation.passed and q.method == "awq" and q.calibration.tokens == 64
    assert q.scaled_matrices > 0 and q.matmul_accuracy == "auto"


def test_smoothquant_scores_the_int8_activation_rounding():
    """With int8 activations, a few loud input channels coarsen every other channel of their row;
    SmoothQuant's scales move that range into the weights and cut the W8A8 output error."""
    from kvexport.exporter.awq import best_scale, int8_rows

    rng = np.random.default_rng(4)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    x[:, :3] *= 60  # outlier input channels, as LLM activations have
    w = rng.standard_normal((64, 48)).astype(np.float32)
    s, alpha, err = best_scale(x, w, 8, qz.CHANNEL, int8_activations=True)
    plain = qz.quantize_rtn(w, 8, qz.CHANNEL).dequantize()
    plain_err = float(((int8_rows(x) @ plain - x @ w) ** 2).sum() / ((x @ w) ** 2).sum())
    assert alpha > 0 and err < 0.5 * plain_err
    assert s[:3].min() > s[3:].max()  # the loud channels are the ones scaled down in x


def test_smoothquant_build_validates(hf_folder, tmp_path):
    src = str(hf_folder("llama", num_key_value_heads=2))
    _, m = build(src, tmp_path / "sq", BuildOptions(weights="int8", weight_block_size=0, quant_method="smoothquant",
                                                   calibration_tokens=64, **OPTS))
    q = m.weights.quantization
    assert m.validation.passed and q.method == "smoothquant" and "activation" in q.search
    assert q.lm_head.block_size == qz.HEAD_CHANNEL_BUILDS_BLOCK == 32  # kept off the int8-activation path
    assert q.matmul_accuracy == "int8"  # its scales are searched for the int8 activations


def test_int4_smoothquant_scores_the_served_form():
    """int4 blocks served under weight_matmul_accuracy "int8" are re-rounded per channel and meet
    per-token int8 activations: the smoothquant search scores exactly that product, so its
    error is never above plain rounding's (alpha 0 is a candidate), and clearly below it with
    loud input channels."""
    from kvexport.exporter.awq import best_scale, int8_rows
    from kvexport.runtime.execution.ort_quant import int8_channel

    rng = np.random.default_rng(5)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    x[:, :3] *= 60
    w = rng.standard_normal((64, 48)).astype(np.float32)
    s, alpha, err = best_scale(x, w, 4, 32, int8_activations=True)
    q, step, z = int8_channel(qz.quantize_rtn(w, 4, 32).dequantize())
    plain_err = float(((int8_rows(x) @ ((q - z) * step) - x @ w) ** 2).sum() / ((x @ w) ** 2).sum())
    assert alpha > 0 and err < 0.5 * plain_err


def test_int4_smoothquant_build_validates(hf_folder, tmp_path):
    src = str(hf_folder("llama", num_key_value_heads=2))
    _, m = build(src, tmp_path / "sq4", BuildOptions(weights="int4", weight_block_size=32, quant_method="smoothquant",
                                                    calibration_tokens=64, **OPTS))
    q = m.weights.quantization
    assert m.validation.passed and (q.method, q.bits, q.block_size, q.matmul_accuracy) == ("smoothquant", 4, 32, "int8")


@pytest.mark.parametrize("kw,field", [
    (dict(weights="int4", weight_block_size=0, quant_method="smoothquant"), "smoothquant"),
    (dict(weights="int8", weight_block_size=32, quant_method="smoothquant"), "smoothquant"),
    (dict(weights="int3"), "--weights"), (dict(weights="int4", weight_block_size=48), "--weight-block-size"),
    (dict(weights="int4", quant_method="gptq"), "--quant-method"),
    (dict(quant_method="awq"), "--weight-block-size / --quant-method"),
    (dict(weight_matmul_accuracy="int8"), "--weight-matmul-accuracy only apply"),
    (dict(weights="int4", weight_matmul_accuracy="fp8"), "--weight-matmul-accuracy must be one of auto, int8, float"),
    (dict(weights="fp32", dtype=io.DType.FP16), "--weights fp32"),
])
def test_bad_weight_options_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field.replace("/", ".")):
        BuildOptions(**kw)


@pytest.mark.parametrize("kw,form,accuracy", [
    (dict(weights="int8"), (qz.CHANNEL, "smoothquant"), "int8"),  # the fast CPU form
    (dict(weights="int8", weight_block_size=32), (32, "rtn"), "auto"),  # the exact form, one flag away
    (dict(weights="int8", quant_method="rtn"), (32, "rtn"), "auto"),
    (dict(weights="int8", quant_method="awq"), (32, "awq"), "auto"),
    (dict(weights="int8", weight_block_size=0), (qz.CHANNEL, "smoothquant"), "int8"),
    (dict(weights="int8", weight_block_size=0, quant_method="rtn"), (qz.CHANNEL, "rtn"), "auto"),
    (dict(weights="int4"), (32, "rtn"), "auto"),
    (dict(weights="int4", weight_block_size=64), (64, "rtn"), "auto"),
    (dict(weights="int4", quant_method="smoothquant"), (32, "smoothquant"), "int8"),
    (dict(weights="int4", weight_matmul_accuracy="float"), (32, "rtn"), "float"),
])
def test_default_weight_forms(kw, form, accuracy):
    """What --weights int8 / int4 build when --weight-block-size / --quant-method are left out,
    and the serving accuracy each records (exporter/limits.py DEFAULT_WEIGHT_FORM,
    default_matmul_accuracy; --weight-matmul-accuracy overrides it)."""
    from kvexport.exporter.limits import default_matmul_accuracy

    opts = BuildOptions(**kw)
    wq = opts.weight_quantization()
    assert (wq.block_size, wq.method) == form
    assert (opts.weight_matmul_accuracy or default_matmul_accuracy(wq.method)) == accuracy


def test_weights_fp16_means_dtype_fp16():
    assert BuildOptions(weights="fp16").dtype is io.DType.FP16


def test_manifest_of_earlier_builds_still_loads(hf_folder, tmp_path):
    """Manifests written before weights.precision/quantization/sha256 existed load with None."""
    out, _ = build(str(hf_folder("llama", num_key_value_heads=2)), tmp_path / "b", BuildOptions(validate=False, **OPTS))
    d = json.loads((out / io.MANIFEST_NAME).read_text())
    for k in ("precision", "quantization", "sha256"):
        d["weights"].pop(k, None)
    m = Manifest.from_json(d)
    assert m.weights == WeightsEntry(d["weights"]["file"], d["weights"]["bytes"], d["weights"]["parameters"])
    assert load(out).weights.precision == "fp32"


def test_quantization_record_is_typed_and_earlier_records_load(hf_folder, tmp_path):
    """weights.quantization is a typed entry (manifest_weights.py): records written before a field
    existed (no matmul_accuracy / serving / lm_head / embeddings) load, save back byte for byte
    and are served at the default accuracy; a mistyped, unknown or invalid field is refused by name."""
    from kvexport.cli import inspect
    from kvexport.errors import ManifestError
    from kvexport.manifest import WeightQuantizationEntry
    from kvexport.runtime.execution.ort_backends import ort_backend

    out, m = build(str(hf_folder("llama", num_key_value_heads=2)), tmp_path / "b",
                   BuildOptions(weights="int4", quant_method="rtn", weight_matmul_accuracy="int8", validate=False,
                                **OPTS))
    assert isinstance(m.weights.quantization, WeightQuantizationEntry)
    assert m.weights.quantization.matmul_accuracy == "int8"
    d = json.loads((out / io.MANIFEST_NAME).read_text())
    for k in ("matmul_accuracy", "serving", "lm_head", "embeddings"):
        d["weights"]["quantization"].pop(k)
    old = Manifest.from_json(d)
    assert json.dumps(old.to_json()) == json.dumps(d)  # same fields, same order
    q = old.weights.quantization
    assert (q.matmul_accuracy, q.lm_head, q.head_block_size) == (None, None, 32)
    assert ort_backend(out, old, 8).accuracy == "auto"  # what builds before the record were served with
    assert "weight_matmul_accuracy auto (the default for builds before it was recorded" in inspect.serving(old)
    for path, value, what in (("bits", "8", "must be an int"), ("rounding", "x", "is not a field"),
                              ("matmul_accuracy", "fp8", "matmul_accuracy must be one of auto, int8, float"),
                              ("quantized", {"matrices": 1}, "'weights.quantization.quantized.origins' is missing")):
        bad = json.loads(json.dumps(d))
        bad["weights"]["quantization"][path] = value
        with pytest.raises(ManifestError, match="weights.quantization") as e:
            Manifest.from_json(bad)
        assert what in str(e.value), e.value


def test_weight_matmul_accuracy_sets_the_session_level(hf_folder, tmp_path):
    """EngineConfig.weight_matmul_accuracy picks onnxruntime's MatMulNBits accuracy level
    (int8 activations = 4, float = 0); a bad value names the setting and its choices."""
    from kvexport.runtime.config import EngineConfig
    from kvexport.runtime.execution.ort_backends import ort_backend

    out, m = build(str(hf_folder("llama", num_key_value_heads=2)), tmp_path / "b",
                   BuildOptions(attention=io.Attention.ONNX, weights="int4", validate=False, **OPTS))
    for accuracy, level in (("int8", "4"), ("float", "0")):
        so = ort_backend(out, m, 4, accuracy=accuracy).session_options()
        assert so.get_session_config_entry("session.qdq_matmulnbits_accuracy_level") == level
    with pytest.raises(ConfigError, match="weight_matmul_accuracy must be one of auto, int8, float"):
        EngineConfig(weight_matmul_accuracy="fp8")


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_every_quantized_matmul_fuses_to_matmulnbits_in_the_runtime_session(hf_folder, tmp_path, weights):
    """The runtime's sessions fuse every DequantizeLinear -> MatMul into MatMulNBits, including
    o_proj and down_proj, which are followed by the residual Add: with onnxruntime's
    MatMulAddFusion on, those became a Gemm fed by a DequantizeLinear of the whole weight on
    every call (60 of smollm2's 121 int8 matmuls)."""
    import collections

    import onnxruntime as ort

    from kvexport.runtime.execution.ort_backends import ort_backend

    out, m = build(str(hf_folder("qwen2")), tmp_path / "b",
                   BuildOptions(attention=io.Attention.PLUGIN, weights=weights, weight_block_size=32,
                                quant_method="rtn", validate=False, **OPTS))
    backend = ort_backend(out, m, 4)  # the native op (its attention output has a static rank)
    counts = {}
    for disabled in ([], backend.disabled_optimizers()):
        so = backend.session_options()
        so.optimized_model_filepath = str(tmp_path / f"opt{len(disabled)}.onnx")
        ort.InferenceSession(str(out / io.PREFILL_GRAPH), so, providers=["CPUExecutionProvider"],
                             disabled_optimizers=disabled)
        g = onnx.load(so.optimized_model_filepath, load_external_data=False).graph
        counts[len(disabled)] = collections.Counter(n.op_type for n in g.node)
        made = {o: n.op_type for n in g.node for o in n.output}
        dq_inputs = {made.get(n.input[0]) for n in g.node if n.op_type == "DequantizeLinear"}
    layers = m.kv.num_layers
    assert counts[1]["MatMulNBits"] == 4 * layers + 1  # qkv, o, gate|up, down per layer + the LM head
    assert counts[1]["Gemm"] == 0 and dq_inputs == {"Gather"}  # left: the embedding rows' (a Gather of int8 codes)
    assert counts[0]["MatMulNBits"] < counts[1]["MatMulNBits"]  # what the NOTE in ort_backends.py is about


def _one_step(out, m, accuracy: str, ids: list[int], tables: list[int]):
    """One prefill step of `ids` on a fresh backend with `accuracy`: (logits, the backend, the
    session it ran in)."""
    from kvexport.runtime.execution.model_runner import chunk, pack
    from kvexport.runtime.execution.ort_backends import ort_backend

    be = ort_backend(out, m, len(tables) + 2, accuracy=accuracy)
    ran = []
    run = be._run
    be._run = lambda sess, inp: ran.append(sess) or run(sess, inp)
    logits = be.execute(pack([chunk("a", ids, 0, tables, m.kv.block_size)], m.kv.block_size, be.full_block_tables))
    return logits, be, ran[0]


@pytest.mark.parametrize("weights,attention", [("int4", "plugin"), ("int4", "onnx"), ("int8", "onnx")])
def test_auto_accuracy_runs_large_steps_as_int8_pairs(hf_folder, tmp_path, weights, attention, cpu_op, monkeypatch):
    """accuracy "auto" (the default), fp32 block-wise builds: steps of LARGE_STEP_TOKENS["pair"]
    tokens or more run in a second session whose block-wise matmuls (all but the LM head's) are
    int8 pairs (ort_quant.blocks_to_int8_pair: ~15 bits of activations and weights), smaller
    steps at level 4. So a large step's logits are those of an all-float session up to the
    head's int8 activations, closer than under "int8" (per-channel int8 x per-token int8); an
    fp16 int4 build keeps the float form (the pairs take float32)."""
    import collections

    from kvexport.runtime.execution import ort_backends, ort_quant
    from kvexport.runtime.execution.ort_backends import LARGE_STEP_TOKENS, ort_backend

    monkeypatch.setattr(ort_quant, "STORE_BYTES", 256)  # this model's matrices are small: derived ones wait in a store
    released = []
    monkeypatch.setattr(ort_backends, "_release", lambda a, real=ort_backends._release: released.append(a.nbytes)
                        or real(a))
    src = str(hf_folder("llama", num_key_value_heads=2))
    out, m = build(src, tmp_path / "b", BuildOptions(weights=weights, weight_block_size=32, quant_method="rtn",
                                                     attention=io.Attention(attention), validate=False, **OPTS))
    assert m.weights.quantization.matmul_accuracy == "auto"  # what these builds serve by default
    tokens = LARGE_STEP_TOKENS["pair"] + 3
    tables = list(range(1, tokens // m.kv.block_size + 2))
    ids = np.random.default_rng(0).integers(0, m.model.vocab_size, tokens).tolist()

    def logits(accuracy, n):
        return _one_step(out, m, accuracy, ids[:n], tables)

    auto, be, sess = logits("auto", tokens)
    assert be.large_form == "pair" and len(released) >= 2 * 4 * m.kv.num_layers and min(released) > 0
    with pytest.MonkeyPatch.context() as mp:  # the derived arrays are freed once the session is made
        mp.setattr(ort_backends, "_release", lambda a: None)
        kept, _, _ = logits("auto", tokens)
    np.testing.assert_array_equal(auto, kept)  # onnxruntime does not read them after
    assert sess is be.large_sessions[io.Phase.PREFILL.value] and sess is not be.sessions[io.Phase.PREFILL.value]
    g = be._cpu_model(out / io.PREFILL_GRAPH, be.plans[-1]).graph
    assert collections.Counter(n.op_type for n in g.node)["MatMulIntegerToFloat"] == 2 * 4 * m.kv.num_layers
    small, be, sess = logits(None, LARGE_STEP_TOKENS["pair"] - 1)  # None: the build's, auto
    assert sess is be.sessions[io.Phase.PREFILL.value]
    exact, be, _ = logits("float", tokens)
    assert not be.large_sessions
    int8, _, _ = logits("int8", tokens)
    assert np.abs(auto - exact).max() < 0.5 * np.abs(int8 - exact).max()
    assert (auto.argmax(-1) == exact.argmax(-1)).all()
    if weights == "int4":
        _, m16 = build(src, tmp_path / "b16", BuildOptions(weights="int4", quant_method="rtn", dtype=io.DType.FP16,
                                                           validate=False, **OPTS))
        assert ort_backend(tmp_path / "b16", m16, 8).large_form == "float"


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_int8_accuracy_runs_large_steps_as_per_channel_int8(hf_folder, tmp_path, weights, monkeypatch):
    """accuracy "int8", block-wise builds: steps of LARGE_STEP_TOKENS["int8"] tokens or more run
    in a session whose block-wise matmuls are per-channel int8 x per-token int8
    (MatMulIntegerToFloat), all but the LM head, which stays a block-wise MatMulNBits; smaller
    steps run at level 4. Both round the activations, so both stay near the float logits."""
    import collections

    from kvexport.runtime.execution import ort_backends
    from kvexport.runtime.execution.ort_backends import LARGE_STEP_TOKENS, _spill, ort_backend

    out, m = build(str(hf_folder("llama", num_key_value_heads=2)), tmp_path / "b",
                   BuildOptions(weights=weights, weight_block_size=32, quant_method="rtn", attention=io.Attention.ONNX,
                                validate=False, **OPTS))
    be = ort_backend(out, m, 8, accuracy="int8")
    assert be.large_form == "int8" and be.large_sessions
    derived = be._cpu_model(out / io.PREFILL_GRAPH, be.plans[-1])
    g = onnx.ModelProto.FromString(derived.SerializeToString()).graph
    monkeypatch.setattr(ort_backends, "SPILL_BYTES", 256)  # this model's matrices are small
    graph, spilled = _spill(derived)  # the derived codes leave the graph bytes for the session
    assert len(spilled) >= 4 * m.kv.num_layers and len(graph) < sum(a.nbytes for a in spilled.values())
    inits = {t.name for t in g.initializer}
    blocks = [n.input[0] for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
              and any(a.name == "block_size" for a in n.attribute)]
    assert collections.Counter(n.op_type for n in g.node)["MatMulIntegerToFloat"] == 4 * m.kv.num_layers
    assert blocks == ["lm_head.quantized.weight.q"]
    ids = np.random.default_rng(3).integers(0, m.model.vocab_size, 12).tolist()

    def logits(accuracy, n):
        got, b, sess = _one_step(out, m, accuracy, ids[:n], [1, 2, 3, 4])
        return got, sess is b.large_sessions.get(io.Phase.PREFILL.value)

    for n in (LARGE_STEP_TOKENS["int8"] - 1, LARGE_STEP_TOKENS["int8"], 12):
        fast, large = logits("int8", n)
        exact, _ = logits("float", n)
        assert large == (n >= LARGE_STEP_TOKENS["int8"])
        assert np.abs(fast - exact).max() < 0.05 * np.abs(exact).max()
        assert (fast.argmax(-1) == exact.argmax(-1)).all()


def test_int8_accuracy_opens_no_second_session_for_fp16_builds(hf_folder, tmp_path):
    """The per-channel rewrite takes float32 activations and scales only, so an fp16 int4 build
    under accuracy "int8" would get a second session identical to the first: it opens none."""
    from kvexport.runtime.execution.ort_backends import ort_backend

    out, m = build(str(hf_folder("llama", num_key_value_heads=2)), tmp_path / "b",
                   BuildOptions(weights="int4", dtype=io.DType.FP16, attention=io.Attention.ONNX, validate=False,
                                **OPTS))
    be = ort_backend(out, m, 8, accuracy="int8")
    assert be.large_form is None and not be.large_sessions
