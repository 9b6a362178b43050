"""runtime/execution/ort_quant.py: the per-channel int8 QDQ matmul (DequantizeLinear axis=1 -> MatMul) is
rewritten for onnxruntime's CPU into dynamic int8 GEMMs that onnxruntime fuses; other weight
forms are left alone."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvexport.exporter import quantize as qz
from kvexport.runtime.execution import ort_quant
from kvexport.runtime.execution.ort_quant import ACT_QMAX, int8_dynamic, u8s8_saturates

K, N = 64, 48


def _linear(w: np.ndarray, block: int, scale_dtype=np.float32, extra_consumer: bool = False) -> onnx.ModelProto:
    """x [M, K] @ DequantizeLinear(int8 codes of w) (per channel: axis=1, else blocks along K)."""
    qm = qz.quantize_rtn(w, 8, block)
    scale = (qm.scale[0] if block == qz.CHANNEL else qm.scale).astype(scale_dtype)
    attrs = dict(axis=1) if block == qz.CHANNEL else dict(axis=0, block_size=block)
    nodes = [helper.make_node("DequantizeLinear", ["wq", "s"], ["wd"], **attrs),
             helper.make_node("MatMul", ["x", "wd"], ["y"], name="mm")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])]
    if extra_consumer:  # the dequantized weight also feeds something else: not rewritten
        nodes.append(helper.make_node("Identity", ["wd"], ["w_out"]))
        outs.append(helper.make_tensor_value_info("w_out", TensorProto.FLOAT, [K, N]))
    g = helper.make_graph(nodes, "lin", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])], outs,
                          [numpy_helper.from_array(qm.q, "wq"), numpy_helper.from_array(scale, "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 9
    return m


@pytest.mark.parametrize("per_row", [False, True])
def test_rewritten_linear_is_close(tmp_path, per_row):
    """Per tensor: fused by onnxruntime into DynamicQuantizeMatMul; per row (the default): one
    int8 scale per token (ACT_QMAX levels each side), so each row's error is bounded by its own range."""
    if not per_row and u8s8_saturates():
        pytest.skip("per tensor quantizes to the full uint8 range, which this CPU's u8 x s8 GEMM saturates")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, N)).astype(np.float32)
    m = _linear(w, qz.CHANNEL)
    assert int8_dynamic(m, per_row=per_row) == 1
    onnx.checker.check_model(m)
    ops = [n.op_type for n in m.graph.node]
    assert ("MatMulIntegerToFloat" if per_row else "MatMulInteger") in ops
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    if not per_row:
        assert [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node] == ["DynamicQuantizeMatMul"]
    x = rng.standard_normal((5, K)).astype(np.float32)
    x[0] *= 100  # a loud row: per tensor it coarsens every row, per row only itself
    ref = x @ qz.quantize_rtn(w, 8, qz.CHANNEL).dequantize()
    got = sess.run(None, {"x": x})[0]
    # x rounded to half a step (per row: max|x_row| / ACT_QMAX; per tensor: range / 255), times sum_k |W|
    step = np.abs(x).max(axis=1, keepdims=True) / ACT_QMAX if per_row else (x.max() - min(x.min(), 0)) / 255
    bound = step / 2 * np.abs(w).sum(axis=0).max() + 1e-3
    assert np.all(np.abs(got - ref) <= bound)
    assert np.abs(got - ref).max() > 0  # the activations really were rounded
    quiet = np.abs(got - ref)[1:].max()
    assert (quiet < 0.5) == per_row, quiet  # the loud row spoils the others only per tensor


@pytest.mark.parametrize("case", ["block32", "fp16 scale", "shared weight"])
def test_other_forms_are_left_alone(case):
    w = np.random.default_rng(1).standard_normal((K, N)).astype(np.float32)
    m = {"block32": lambda: _linear(w, 32), "fp16 scale": lambda: _linear(w, qz.CHANNEL, np.float16),
         "shared weight": lambda: _linear(w, qz.CHANNEL, extra_consumer=True)}[case]()
    before = m.SerializeToString()
    assert int8_dynamic(m) == 0 and m.SerializeToString() == before


def test_zero_points_feed_the_integer_matmul():
    """A per-channel zero point (GPTQ int8, asymmetric) is the integer matmul's B zero point: the
    rewritten graph computes x @ ((q - zp) * scale), without reading the zero point's data."""
    rng = np.random.default_rng(2)
    q = rng.integers(-128, 128, (K, N), dtype=np.int8)
    zp = rng.integers(-20, 20, N, dtype=np.int8)
    scale = rng.uniform(0.01, 0.02, N).astype(np.float32)
    nodes = [helper.make_node("DequantizeLinear", ["wq", "s", "zp"], ["wd"], axis=1),
             helper.make_node("MatMul", ["x", "wd"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "lin", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])],
                          [numpy_helper.from_array(q, "wq"), numpy_helper.from_array(scale, "s"),
                           numpy_helper.from_array(zp, "zp")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 9
    assert int8_dynamic(m) == 1
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((3, K)).astype(np.float32)
    w = (q.astype(np.float32) - zp) * scale
    got, ref = sess.run(None, {"x": x})[0], x @ w
    bound = np.abs(x).max(axis=1, keepdims=True) / ACT_QMAX / 2 * np.abs(w).sum(axis=0).max() + 1e-4
    assert np.all(np.abs(got - ref) <= bound)
    assert np.abs(ref).max() > 10 * bound.max()  # the zero points matter at this scale


def test_int8_blocks_become_explicit_matmulnbits_with_their_own_level(tmp_path):
    """Block-wise int8 DQ -> MatMul becomes one com.microsoft.MatMulNBits over the same codes
    re-laid out, with the accuracy level given (not the session's): at level 0 it computes the
    dequantized weight exactly; codes stored outside the graph are read from base_dir."""
    from kvexport.runtime.execution.ort_quant import int8_blocks_to_matmulnbits

    rng = np.random.default_rng(5)
    w = rng.standard_normal((K, N)).astype(np.float32)
    m = _linear(w, 32)
    onnx.save(m, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="w.data", size_threshold=0)
    m = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    assert int8_blocks_to_matmulnbits(m, str(tmp_path), accuracy_level=0) == 1
    (node,) = m.graph.node
    attrs = {a.name: a.i for a in node.attribute}
    assert (node.op_type, node.domain, attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (
        "MatMulNBits", "com.microsoft", 8, 32, 0)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(tmp_path))
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4")  # the node's own level wins
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((6, K)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ qz.quantize_rtn(w, 8, 32).dequantize(), atol=1e-4)
    assert int8_blocks_to_matmulnbits(_linear(w, qz.CHANNEL), str(tmp_path)) == 0  # per channel: not this form


OFFSET_FORMS = ("gemm", "add", "reduce")


def _offset_linear(tmp_path, rng, head: bool = False, form: str = "gemm") -> tuple[onnx.ModelProto, np.ndarray]:
    """exporter/graph.py's int4 linear with GGUF Q4_1-style block minimums: x @ DQ(codes, scale,
    zero point; blocks of 32 along K) + (x's block sums) @ offset, weights stored outside the
    graph in tmp_path. `form`: the sums as MatMul(x, ones per block), added by a Gemm (paged
    builds) or a MatMul and an Add (contiguous), or as Reshape -> ReduceSum (builds before).
    Returns the model (external data not loaded) and the float weight it means."""
    block = 32
    q = rng.integers(-8, 8, (K, N)).astype(np.int8)
    zp = np.full((K // block, N), -8, np.int8)
    scale = rng.uniform(0.01, 0.03, (K // block, N)).astype(np.float32)
    offset = rng.uniform(-0.2, 0.0, (K // block, N)).astype(np.float32)
    codes = "lm_head.q" if head else "wq"
    nodes = [helper.make_node("DequantizeLinear", [codes, "s", "zp"], ["wd"], axis=0, block_size=block),
             helper.make_node("MatMul", ["x", "wd"], ["y0"], name="mm")]
    if form == "reduce":
        nodes += [helper.make_node("Reshape", ["x", "shape"], ["xb"]),
                  helper.make_node("ReduceSum", ["xb", "axes"], ["sums"], keepdims=0)]
    else:
        nodes.append(helper.make_node("MatMul", ["x", "ones"], ["sums"]))
    if form == "gemm":
        nodes.append(helper.make_node("Gemm", ["sums", "offset", "y0"], ["y"]))
    else:
        nodes += [helper.make_node("MatMul", ["sums", "offset"], ["off"]),
                  helper.make_node("Add", ["y0", "off"], ["y"])]
    inits = [helper.make_tensor(codes, TensorProto.INT4, [K, N], qz.stored_codes(q, 4)[0].tobytes(), raw=True),
             helper.make_tensor("zp", TensorProto.INT4, list(zp.shape), qz.stored_codes(zp, 4)[0].tobytes(), raw=True),
             numpy_helper.from_array(scale, "s"), numpy_helper.from_array(offset, "offset"),
             numpy_helper.from_array(np.kron(np.eye(K // block, dtype=np.float32), np.ones((block, 1), np.float32)),
                                     "ones"),
             numpy_helper.from_array(np.array([0, -1, block], np.int64), "shape"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    g = helper.make_graph(nodes, "lin", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    onnx.save(m, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="w.data", size_threshold=256)  # shape constants stay in the graph
    w = (q.astype(np.float32) + 8) * np.repeat(scale, block, 0) + np.repeat(offset, block, 0)
    return onnx.load(str(tmp_path / "m.onnx"), load_external_data=False), w


def _session(m: onnx.ModelProto, base_dir) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(base_dir))
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")  # fused int4 blocks: float compute
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("form", OFFSET_FORMS)
def test_blocks_become_per_channel_int8_with_the_block_offsets_folded_in(tmp_path, form):
    """An int4 block-wise weight with zero points and Q4_1 offsets becomes one per-channel int8
    DequantizeLinear (asymmetric: a zero point per column) holding the whole matrix; the offset
    product is gone, in each form the exporter writes or wrote. Float activations: the only error
    is the per-column rounding, at most half a step (column range / 254) per weight; then
    int8_dynamic takes it as int8 x int8."""
    from kvexport.runtime.execution.ort_quant import blocks_to_int8_channel

    rng = np.random.default_rng(7)
    m, w = _offset_linear(tmp_path, rng, form=form)
    x = rng.standard_normal((4, K)).astype(np.float32)
    exact = _session(m, tmp_path).run(None, {"x": x})[0]
    np.testing.assert_allclose(exact, x @ w, rtol=1e-4, atol=1e-4)  # the graph is what the docstring says
    assert blocks_to_int8_channel(m, str(tmp_path)) == 1
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("MatMul") == 1 and not {"ReduceSum", "Reshape", "Gemm", "Add"} & set(ops)
    (d,) = [n for n in m.graph.node if n.op_type == "DequantizeLinear"]
    assert {a.name: a.i for a in d.attribute} == {"axis": 1} and len(d.input) == 3
    got = _session(m, tmp_path).run(None, {"x": x})[0]
    step = (np.maximum(w.max(0), 0) - np.minimum(w.min(0), 0)) / 254
    assert np.all(np.abs(got - exact) <= np.abs(x).sum(axis=1, keepdims=True) * step / 2 + 1e-4)
    assert np.abs(got - exact).max() > 0
    assert int8_dynamic(m) == 1
    dyn = _session(m, tmp_path).run(None, {"x": x})[0]
    assert np.abs(dyn - exact).max() < 0.05 * np.abs(exact).max()


@pytest.mark.parametrize("form", OFFSET_FORMS)
def test_skipped_codes_stay_block_wise(tmp_path, form):
    """Codes named in `skip` (the runtime passes the LM head's, ort_quant.logits_weight) keep
    their block-wise form and offsets."""
    from kvexport.runtime.execution.ort_quant import blocks_to_int8_channel, logits_weight

    m, _ = _offset_linear(tmp_path, np.random.default_rng(8), head=True, form=form)
    assert logits_weight(m.graph, "y") == "lm_head.q"  # through the offsets' Add or Gemm
    before = m.SerializeToString()
    assert blocks_to_int8_channel(m, str(tmp_path), skip=frozenset({"lm_head.q"})) == 0
    assert m.SerializeToString() == before
    lin = _linear(np.ones((K, N), np.float32), 32)
    assert logits_weight(lin.graph, "y") == "wq"


@pytest.mark.parametrize("form", OFFSET_FORMS)
def test_blocks_become_int8_pairs_that_keep_about_15_bits(tmp_path, form):
    """blocks_to_int8_pair: an int4 block-wise weight with Q4_1 offsets (folded in) runs as three
    int8 x int8 products. Each operand is rounded to 1/254 of its own int8 step: per row
    |x - x̂| <= max|x_row| / 64516, per column |W - Ŵ| <= max|W_col| / 64516, and the dropped
    product of the two rests is as small, so |y - x W| <= 3 K max|x_row| max|W_col| / 64516.
    Typically far inside that; 100x closer than one int8 rounding (blocks_to_int8_channel with
    per-row int8 activations), also on a loud row and a loud column."""
    from kvexport.runtime.execution.ort_quant import blocks_to_int8_channel, blocks_to_int8_pair

    rng = np.random.default_rng(9)
    m, w = _offset_linear(tmp_path, rng, form=form)
    x = rng.standard_normal((6, K)).astype(np.float32)
    x[0] *= 300  # a massive-activation row
    x[:, 5] *= 20  # an outlier channel
    exact = x.astype(np.float64) @ w.astype(np.float64)
    ch = onnx.ModelProto.FromString(m.SerializeToString())
    assert blocks_to_int8_pair(m, str(tmp_path)) == 1
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("MatMulIntegerToFloat") == 2 and not {"MatMul", "Gemm", "ReduceSum"} & set(ops)
    assert ops.count("DequantizeLinear") == 1  # x's int8 rows back to float (for the rest), not the weight
    onnx.checker.check_model(m)
    got = _session(m, tmp_path).run(None, {"x": x})[0]
    bound = 3 * K * np.abs(x).max(1, keepdims=True) * np.abs(w).max(0) / 64516
    err = np.abs(got - exact)
    assert np.all(err <= bound + 1e-5 * np.abs(exact).max())
    assert blocks_to_int8_channel(ch, str(tmp_path)) == 1 and int8_dynamic(ch) == 1
    one = np.abs(_session(ch, tmp_path).run(None, {"x": x})[0] - exact)
    assert err.max() > 0 and err.max() < one.max() / 100, (err.max(), one.max())
    assert np.all(err.max(1) < one.max(1) / 20)  # row by row, the loud one too


def test_int8_pairs_skip_the_head_and_run_at_any_rank(tmp_path):
    """Codes in `skip` stay block-wise; a [B, T, K] input (any rank) gives [B, T, N]."""
    from kvexport.runtime.execution.ort_quant import blocks_to_int8_pair

    m, _ = _offset_linear(tmp_path, np.random.default_rng(10), head=True)
    before = m.SerializeToString()
    assert blocks_to_int8_pair(m, str(tmp_path), skip=frozenset({"lm_head.q"})) == 0
    assert m.SerializeToString() == before
    m, w = _offset_linear(tmp_path, np.random.default_rng(11))
    m.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", K]))
    m.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", N]))
    for n in m.graph.node:  # the block sums: MatMul(x, ones) is rank-agnostic already
        assert n.op_type != "Reshape"
    assert blocks_to_int8_pair(m, str(tmp_path)) == 1
    x = np.random.default_rng(12).standard_normal((2, 3, K)).astype(np.float32)
    got = _session(m, tmp_path).run(None, {"x": x})[0]
    assert got.shape == (2, 3, N)
    np.testing.assert_allclose(got, x @ w, atol=1e-3 * np.abs(x @ w).max())


AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"


@pytest.mark.parametrize("cpuinfo,machine,saturates", [
    (AVX2, "x86_64", True),  # AVX2 only (AMD EPYC Zen 2/3): vpmaddubsw sums u8 x s8 pairs into int16
    (AVX2.replace("avx2", "avx2 avx512f avx512_vnni"), "x86_64", False),
    (AVX2.replace("avx2", "avx2 avx_vnni"), "x86_64", False), (AVX2.replace("avx2", "avx2 amx_int8"), "x86_64", False),
    ("processor\t: 0\n", "x86_64", True),  # no flags line: the safe range
    ("", "aarch64", False),
])
def test_which_cpus_saturate_u8_x_s8(cpuinfo, machine, saturates):
    assert u8s8_saturates(cpuinfo, machine) is saturates


@pytest.mark.parametrize("qmax", [63, 127])
def test_the_activation_range_is_exact_on_this_cpu(qmax):
    """MatMulIntegerToFloat of u8 activations in the range the rewrites use here (ACT_QMAX, zero
    point ACT_QMAX + 1) against full-range s8 codes equals the integer product: no saturation.
    The 8-bit range does so only where u8 x s8 does not saturate."""
    rng = np.random.default_rng(7)
    M = 8
    xq = rng.integers(1, 2 * qmax + 2, (M, K)).astype(np.uint8)  # [1, 2 qmax + 1]
    xq[0] = 2 * qmax + 1  # the extremes, against the extreme codes
    q = rng.integers(-128, 128, (K, N)).astype(np.int8)
    q[:, 0] = 127
    node = helper.make_node("MatMulIntegerToFloat", ["x", "w", "one", "s", "zp"], ["y"], domain="com.microsoft")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, ["M", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])],
                          [numpy_helper.from_array(q, "w"), numpy_helper.from_array(np.float32(1), "one"),
                           numpy_helper.from_array(np.ones(N, np.float32), "s"),
                           numpy_helper.from_array(np.uint8(qmax + 1), "zp")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 9
    got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": xq})[0]
    ref = (xq.astype(np.int64) - (qmax + 1)) @ q.astype(np.int64)
    if qmax == ACT_QMAX or not u8s8_saturates():
        np.testing.assert_array_equal(got, ref)
    else:
        assert np.abs(got - ref).max() > 0  # what ACT_QMAX avoids (ort_quant.u8s8_saturates)
    assert ort_quant.ACT_QMAX in (63, 127)
