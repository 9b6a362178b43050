"""onnxruntime's CPU form of per-channel int8 weights, derived from the portable graph when a
session is opened: one build, both targets.

A build's per-channel int8 matmul (exporter/graph.py `_dequantized`, `--weights int8
--weight-block-size channel`) is the standard QDQ form that TensorRT reads as weight-only INT8:

    codes int8 [K, N], scale [N] ─> DequantizeLinear(axis=1) ─> [K, N] ─> MatMul(x, ·)

onnxruntime runs that form by dequantizing the whole weight on every call (slower than fp32).
Its fast int8 path takes int8 *activations* too, which TensorRT's weight-only engines do not, so
the build cannot store it. `int8_dynamic()` rewrites the loaded ModelProto (weights stay
external, codes stay int8) before the InferenceSession is made, per row (PER_ROW, default):

    x [.., K] ─> s = max|x| / 127 per row ─> uint8(round(x / s) + 128)     (7 bits where u8 x s8
                                                                       saturates: ACT_QMAX)
        ─> com.microsoft.MatMulIntegerToFloat(·, codes, 1, scale [N], 128, zero point [N]) [.., N] ─> × s
    (as nodes: `_per_row`)

or per tensor: DynamicQuantizeLinear ─> MatMulInteger ─> Cast ─> Mul(xs * scale), which
onnxruntime fuses to DynamicQuantizeMatMul (bench/quant_linear.py: ~3x fp32 at M >= 64).
A zero point (GPTQ per-channel int8) feeds the integer matmul as its per-column B zero point.
`blocks_to_int8_channel()` turns block-wise int4/int8 weights into that per-channel form (for
large steps under weight_matmul_accuracy "int8", runtime/execution/ort_backends.py); `blocks_to_int8_pair()`
into two int8 codes per weight with activations split the same way, ~15 bits of each on int8 x
int8 GEMMs (large steps under "auto").
NOTE: per tensor, one scale covers every row of the step, so a row's rounding depends on the
other sequences in the batch, and smollm2's perplexity rose +29% (70.6 vs 54.6); per row
+2.4% (55.9; per-channel weights alone, float activations: +1.0%). bench/weight_quality.py.
NOTE: per row, MatMulIntegerToFloat (float scales applied inside the op) rather than MatMulInteger
-> Cast -> Mul -> Mul: 576x1536 at M = 64 / 256 / 512 took 0.25 / 0.94 / 1.73 ms against
0.35 / 1.13 / 2.37 ms (fp32 MatMul 0.76 / 2.73 / 5.44 ms; 2 threads, bench/quant_linear.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

PER_ROW = True  # one activation scale per row (token), not per tensor: see the module NOTE


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _scan(g: onnx.GraphProto) -> tuple[dict[str, onnx.TensorProto], dict[str, int]]:
    """(initializers by name, how many node inputs read each value)."""
    consumers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    return {t.name: t for t in g.initializer}, consumers


def _producers(g: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """The node that makes each value."""
    return {o: n for n in g.node for o in n.output}


def _dequantizes(g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's standard-domain DequantizeLinear nodes."""
    return [n for n in g.node if n.op_type == "DequantizeLinear" and n.domain in ("", "ai.onnx")]


def int8_dynamic(model: onnx.ModelProto, per_row: bool = PER_ROW) -> int:
    """Rewrite, in place, every float32 MatMul whose weight is a per-channel int8
    DequantizeLinear of an initializer (axis=1, scale [N], zero point [N] or none) into the
    dynamic-int8 form above. Returns how many MatMuls were rewritten (0: model unchanged)."""
    g = model.graph
    inits, consumers = _scan(g)
    dq = {}
    for n in _dequantizes(g):
        codes, scale = inits.get(n.input[0]), inits.get(n.input[1])
        zp = inits.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        a = _attrs(n)
        if (codes is None or scale is None or codes.data_type != TensorProto.INT8 or len(codes.dims) != 2
                or a.get("axis") != 1 or a.get("block_size", 0) != 0 or scale.data_type != TensorProto.FLOAT
                or list(scale.dims) != [codes.dims[1]] or (len(n.input) > 2 and n.input[2] and zp is None)):
            continue
        if zp is not None and (zp.data_type != TensorProto.INT8 or list(zp.dims) != [codes.dims[1]]):
            continue
        if consumers.get(n.output[0]) == 1:
            dq[n.output[0]] = n
    nodes, count = [], 0
    for n in g.node:
        if n.output and n.output[0] in dq:
            continue  # dropped: its MatMul reads the codes itself
        if n.op_type != "MatMul" or n.input[1] not in dq:
            nodes.append(n)
            continue
        d = dq[n.input[1]]
        wzp = d.input[2] if len(d.input) > 2 and d.input[2] else _zero_point(g, inits[d.input[0]].dims[1])
        p = n.name or n.output[0]
        nodes += (_per_row if per_row else _per_tensor)(p, n.input[0], d.input[0], d.input[1], wzp, n.output[0])
        count += 1
    if count:
        del g.node[:]
        g.node.extend(nodes)
        if per_row:
            _add_constants(model, _row_constants())
    return count


def _zero_point(g: onnx.GraphProto, n_out: int) -> str:
    """The name of an all-zero int8 [n_out] initializer (the integer matmuls' B zero point),
    added to `g` once per width."""
    name = f"kvexport.int8_zero_point.{n_out}"
    if not any(t.name == name for t in g.initializer):
        g.initializer.append(helper.make_tensor(name, TensorProto.INT8, [n_out], bytes(n_out), raw=True))
    return name


def _add_constants(model: onnx.ModelProto, constants) -> None:
    """Add the (name, value) initializers `model` lacks, and the com.microsoft opset."""
    have = {t.name for t in model.graph.initializer}
    model.graph.initializer.extend(numpy_helper.from_array(np.asarray(v), n) for n, v in constants if n not in have)
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))


ROW_EPS, ROW_QMAX, ROW_ZERO, ROW_AXES, ROW_ONE = (
    f"kvexport.int8_rows.{n}" for n in ("eps", "qmax", "zero", "axes", "one"))
MS = "com.microsoft"


def u8s8_saturates(cpuinfo: str | None = None, machine: str | None = None) -> bool:
    """Whether onnxruntime's u8 x s8 integer GEMM (MLAS) saturates on this CPU: on x86-64 without
    VNNI (AVX2, AVX-512F) it adds pairs of u8 x s8 products into int16 (vpmaddubsw), saturating
    at 32767 (2 x 255 x 127 = 64770; with u8 <= 127, 2 x 127 x 128 = 32512 fits); VNNI
    (avx512_vnni, avx_vnni) and AMX sum into int32, other architectures do not pair.
    `cpuinfo` / `machine`: /proc/cpuinfo's text and platform.machine() (read when None); x86
    whose flags cannot be read counts as saturating.
    NOTE: measured on an AMD EPYC (AVX2 only), onnxruntime 1.2x: random u8 [0, 255] x s8 codes were
    off by up to 23% of the product's range, u8 [0, 127] exact; smollm2 int4 smoothquant served
    under weight_matmul_accuracy int8 went from perplexity 54.7 (float) to 8166 with 8-bit
    activations, 56.3 with 7-bit ones (512 tokens of King Lear)."""
    import platform

    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return False
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    return flags is None or not {"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags)


# The activations' int8 range in every int8 x int8 rewrite: codes in [-ACT_QMAX, ACT_QMAX] stored as
# uint8 + ACT_QMAX + 1. 127 (8 bits) where u8 x s8 is exact; 63 (7 bits: u8 <= 127, so no pair of
# products passes 32767) where it saturates (u8s8_saturates). A 7-bit row step is twice as coarse:
# smollm2 perplexity figures per CPU are in docs/QUANTIZATION.md.
ACT_QMAX = 63 if u8s8_saturates() else 127


def _row_constants() -> tuple:
    """The constants of `_per_row` / `_pair` for ACT_QMAX (read when a graph is derived)."""
    return ((ROW_EPS, np.float32(1e-12 * ACT_QMAX)), (ROW_QMAX, np.float32(ACT_QMAX)),
            (ROW_ZERO, np.uint8(ACT_QMAX + 1)), (ROW_AXES, np.array([-1], np.int64)), (ROW_ONE, np.float32(1)))

# The external-data location of derived arrays that wait in memory for the session: with a
# `store` (a dict), the rewrites below leave a placeholder initializer that names it and put the
# array in the store (runtime/execution/ort_backends.py `_spill` hands them to onnxruntime), so a derived
# weight exists once in this process, not also as protobuf bytes.
DERIVED_DATA = "kvexport-derived.data"
STORE_BYTES = 1 << 16  # smaller arrays (scales, constants) stay in the graph


def _tensor(array: np.ndarray, name: str, store: dict | None) -> onnx.TensorProto:
    """An initializer holding `array`, or with `store` (arrays of STORE_BYTES or more) a
    placeholder naming DERIVED_DATA, the array kept in `store`."""
    if store is None or array.nbytes < STORE_BYTES:
        return numpy_helper.from_array(array, name)
    t = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
    t.raw_data = b""  # set_external_data wants the field present
    set_external_data(t, DERIVED_DATA, 0, array.nbytes)
    t.ClearField("raw_data")
    store[name] = np.ascontiguousarray(array)
    return t


def _per_tensor(p: str, x: str, codes: str, scale: str, wzp: str, y: str) -> list[onnx.NodeProto]:
    """x ─> DynamicQuantizeLinear (one uint8 scale for the whole tensor) ─> MatMulInteger ─> × xs × scale."""
    xq, xs, xz = f"{p}/xq", f"{p}/xs", f"{p}/xz"
    return [
        helper.make_node("DynamicQuantizeLinear", [x], [xq, xs, xz], name=f"{p}/DynamicQuantizeLinear"),
        helper.make_node("MatMulInteger", [xq, codes, xz, wzp], [f"{p}/acc"], name=f"{p}/MatMulInteger"),  # [.., N] int32
        helper.make_node("Cast", [f"{p}/acc"], [f"{p}/accf"], name=f"{p}/Cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", [xs, scale], [f"{p}/scale"], name=f"{p}/ScaleMul"),  # [N]
        helper.make_node("Mul", [f"{p}/accf", f"{p}/scale"], [y], name=f"{p}/Mul"),
    ]


def _per_row(p: str, x: str, codes: str, scale: str, wzp: str, y: str) -> list[onnx.NodeProto]:
    """One symmetric int8 scale per row (token), stored as uint8 + 128 (onnxruntime's integer
    matmuls take one scalar activation scale and zero point, and u8 x s8 is their fast path):

        x [.., K] ─> r = 127 / max|x| [.., 1] ─> QuantizeLinear(x · r, 1, 128) uint8
            ─> MatMulIntegerToFloat(a_scale 1, b_scale [N], a_zp 128, b_zp [N]) ─> / r

    (127 and 128: ACT_QMAX and ACT_QMAX + 1, 63 and 64 where u8 x s8 saturates.)

    NOTE: QuantizeLinear (scale 1) rounds half to even, adds 128 and casts in one node: 576x1536
    at M = 64 / 256 / 512 in 0.20 / 0.77 / 1.49 ms against 0.23 / 0.88 / 1.68 with Round, Add, Cast.
    """
    mk = helper.make_node
    t = lambda n: f"{p}/{n}"  # noqa: E731
    return [
        mk("Abs", [x], [t("abs")], name=t("Abs")),
        mk("ReduceMax", [t("abs"), ROW_AXES], [t("amax")], name=t("ReduceMax"), keepdims=1),  # [.., 1]
        mk("Max", [t("amax"), ROW_EPS], [t("amax_")], name=t("ScaleMax")),  # all-zero rows: any scale
        mk("Div", [ROW_QMAX, t("amax_")], [t("r")], name=t("ScaleDiv")),  # 1 / the row's step
        mk("Mul", [x, t("r")], [t("xn")], name=t("Mul")),
        mk("QuantizeLinear", [t("xn"), ROW_ONE, ROW_ZERO], [t("xq")], name=t("QuantizeLinear")),
        mk("MatMulIntegerToFloat", [t("xq"), codes, ROW_ONE, scale, ROW_ZERO, wzp], [t("acc")],
           name=t("MatMulIntegerToFloat"), domain=MS),  # [.., N] float: acc x scale
        mk("Div", [t("acc"), t("r")], [y], name=t("RowDiv")),
    ]


def int8_blocks_to_matmulnbits(model: onnx.ModelProto, base_dir: str, accuracy_level: int = 4,
                               store: dict | None = None) -> int:
    """Rewrite, in place, every MatMul whose weight is a block-wise int8 DequantizeLinear of an
    initializer (axis=0, block_size B dividing K, symmetric) into an explicit
    com.microsoft.MatMulNBits(bits=8, block_size=B, accuracy_level) over the same codes, re-laid
    out as it takes them (B [N, K/B, B] uint8 = q + 128, its default zero point; scales [N, K/B]).
    The new initializers are embedded in the model or wait in `store` (DERIVED_DATA); the codes
    are read from `base_dir`.

    What it is for: the accuracy level onnxruntime's QDQ fusion gives every MatMulNBits is one
    session option; an explicit node keeps its own. A session of an int4 build that runs its int4
    matmuls with float activations (level 0) keeps its int8 LM head at level 4 this way: at level 0
    onnxruntime dequantizes 8-bit blocks in full on every call (576x1536 at M=1: 1.35 ms against
    0.06 ms at level 4, bench/quant_linear.py). Returns how many MatMuls were rewritten."""
    g = model.graph
    inits, consumers = _scan(g)
    dq = {}
    for n in _dequantizes(g):
        if len(n.input) > 2:  # a zero point
            continue
        codes, scale, a = inits.get(n.input[0]), inits.get(n.input[1]), _attrs(n)
        if (codes is None or scale is None or codes.data_type != TensorProto.INT8 or len(codes.dims) != 2
                or a.get("axis") != 0 or not a.get("block_size") or codes.dims[0] % a["block_size"]
                or scale.data_type != TensorProto.FLOAT or consumers.get(n.output[0]) != 1):
            continue
        dq[n.output[0]] = (n, a["block_size"])
    nodes, count, made = [], 0, {}
    for n in g.node:
        if n.output and n.output[0] in dq:
            continue
        if n.op_type != "MatMul" or n.input[1] not in dq:
            nodes.append(n)
            continue
        d, block = dq[n.input[1]]
        k, n_out = inits[d.input[0]].dims
        if d.input[0] not in made:  # codes [K, N] -> [N, K/B, B] uint8; scales [K/B, N] -> [N, K/B]
            q = numpy_helper.to_array(inits[d.input[0]], base_dir)
            s = numpy_helper.to_array(inits[d.input[1]], base_dir)
            b_name, s_name = d.input[0] + ".matmulnbits", d.input[1] + ".matmulnbits"
            packed = (q.T.astype(np.int16) + 128).astype(np.uint8).reshape(n_out, k // block, block)
            g.initializer.extend([_tensor(np.ascontiguousarray(packed), b_name, store),
                                  _tensor(np.ascontiguousarray(s.T), s_name, store)])
            made[d.input[0]] = (b_name, s_name)
        b_name, s_name = made[d.input[0]]
        nodes.append(helper.make_node("MatMulNBits", [n.input[0], b_name, s_name], [n.output[0]],
                                      name=(n.name or n.output[0]) + "/MatMulNBits", domain=MS, K=k, N=n_out, bits=8,
                                      block_size=block, accuracy_level=accuracy_level))
        count += 1
    if count:
        del g.node[:]
        g.node.extend(nodes)
        _drop_unread(g)
        if not any(o.domain == MS for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS, 1))
    return count


def blocks_to_int8_channel(model: onnx.ModelProto, base_dir: str, skip: frozenset[str] = frozenset(),
                           store: dict | None = None) -> int:
    """Rewrite, in place, every block-wise DequantizeLinear of int4/int8 codes (axis=0,
    block_size B, zero points or none) whose only reader is a MatMul's weight into per-channel
    int8 codes (axis=1; per column a step (max - min) / 254 and an int8 zero point, covering
    [min(w, 0), max(w, 0)]) holding the same dequantized matrix, rounded once more; the GGUF Q4_1
    block minimums that exporter/graph.py adds as a second product (`linear`: block sums ─>
    Gemm with the offsets) are folded into it and that product dropped. `int8_dynamic` then
    runs it as int8 x int8. Codes named in `skip` stay as they are (the LM head, which keeps
    per-block rounding). The new initializers are embedded in the model or wait in `store`
    (DERIVED_DATA; the codes read from `base_dir`). Returns how many were rewritten.

    What it is for: onnxruntime has no fast kernel for block-wise weights with many rows
    (MatMulNBits is slower than fp32 from M ~ 32 at any accuracy level); its u8 x s8 matmul is
    ~3x fp32 there (bench/quant_linear.py). The requantization's error is at most half a step.
    NOTE: asymmetric because Q4_1 columns are shifted by their minimums: with float activations,
    smollm2's int4 perplexity was 55.12 with a symmetric step (max|w| / 127), 54.78 with this
    (54.57 unrounded); with the per-token int8 activations this feeds, 55.58 and 55.67. Folding
    the minimums matters most: leaving their product in float while the codes' product rounded
    the activations gave 63.6 (the two no longer cancel)."""
    g = model.graph
    count = 0
    for d, w in _block_weights(model, base_dir, skip):
        q, step, z = int8_channel(w)
        name = d.input[0] + ".int8_channel"
        g.initializer.extend([_tensor(q, name, store), _tensor(step.astype(np.float32), name + ".scale", store),
                              _tensor(z.astype(np.int8), name + ".zero_point", store)])
        del d.input[:]
        d.input.extend([name, name + ".scale", name + ".zero_point"])
        del d.attribute[:]
        d.attribute.append(helper.make_attribute("axis", 1))
        count += 1
    if count:
        _prune(g)
    return count


def int8_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`blocks_to_int8_channel`'s rounding of a matrix w [K, N] float32: (codes int8 [K, N], step
    float32 [N], zero point int8-valued float [N]), w ≈ (codes - zero point) * step; per column
    [min(w, 0), max(w, 0)] in 254 steps. exporter/awq.py scores int4 smoothquant scales with it."""
    lo, hi = np.minimum(w.min(axis=0), 0), np.maximum(w.max(axis=0), 0)
    step = np.maximum(hi - lo, np.float32(1e-30)) / np.float32(254)
    z = np.clip(np.rint(-lo / step) - 127, -127, 127)
    q = np.clip(np.rint(w / step) + z, -128, 127).astype(np.int8)
    return q, step, z


def blocks_to_int8_pair(model: onnx.ModelProto, base_dir: str, skip: frozenset[str] = frozenset(),
                        store: dict | None = None) -> int:
    """Rewrite, in place, every block-wise int4/int8 matmul (`_block_weights`; Q4_1 offsets
    folded) into int8 x int8 products that carry about 15 bits of both operands, for large
    steps where onnxruntime's only exact kernel for block-wise weights (MatMulNBits with float
    activations) is slower than fp32:

        W ≈ s (w1 + w2 / 254)    w1 = round(W / s), s = max|W| / 127 per column; w2 the rest
        x ≈ (xq + rq / 254) / r  xq = round(x r), r = 127 / max|x| per row;     rq the rest
        x W ≈ s / r (xq w1 + (xq w2 + rq w1) / 254)     (rq w2 / 254² dropped)

    as nodes (`_pair`): one MatMulIntegerToFloat of w1 with xq's and rq's rows concatenated (so
    onnxruntime packs w1 once), one of w2 with xq. Each operand's rounding is at most 1/508 of
    its own int8 step (|x - x̂| <= max|x| / 64516 per row), against MatMulNBits level 4's one
    int8 step per block of 32. Where u8 x s8 saturates (ACT_QMAX 63) r = 63 / max|x|, and rq, w2
    count 126ths: ~14 bits of each, still far below level 4's rounding. Codes named in `skip` stay
    as they are. New initializers (w1, w2 int8 [K, N]; s [N])
    are embedded in the model, or wait in `store` (see DERIVED_DATA): 2 bytes per weight. Returns
    how many matmuls were rewritten."""
    g = model.graph
    replace = {}
    for d, w in _block_weights(model, base_dir, skip):
        scale = np.maximum(np.abs(w).max(axis=0), np.float32(1e-30)) / np.float32(127)
        w1 = np.clip(np.rint(w / scale), -127, 127)
        rest = np.float32(2 * ACT_QMAX)  # the rests of both operands in steps of 1/(2 ACT_QMAX) of theirs
        w2 = np.clip(np.rint((w - w1 * scale) * (rest / scale)), -ACT_QMAX, ACT_QMAX)  # |rest| <= scale / 2
        name = d.input[0] + ".int8_pair"
        g.initializer.extend([_tensor(w1.astype(np.int8), name + ".w1", store),
                              _tensor(w2.astype(np.int8), name + ".w2", store),
                              _tensor(scale.astype(np.float32), name + ".scale", store)])
        replace[d.output[0]] = (name, _zero_point(g, w.shape[1]))
    if not replace:
        return 0
    nodes = []
    for n in g.node:
        if n.op_type == "MatMul" and n.input[1] in replace:
            name, zp = replace[n.input[1]]
            nodes += _pair(n.name or n.output[0], n.input[0], name, zp, n.output[0])
        else:
            nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    _add_constants(model, ((PAIR_REST, np.float32(2 * ACT_QMAX)), (PAIR_INV_REST, np.float32(1 / (2 * ACT_QMAX))))
                   + _row_constants())
    _prune(g)
    return len(replace)


PAIR_REST, PAIR_INV_REST = "kvexport.int8_pair.rest", "kvexport.int8_pair.inv_rest"  # 2 ACT_QMAX, its inverse


def _pair(p: str, x: str, name: str, wzp: str, y: str) -> list[onnx.NodeProto]:
    """`blocks_to_int8_pair`'s product as nodes; int8 codes stored as uint8 + 128 (as `_per_row`)."""
    mk = helper.make_node
    t = lambda n: f"{p}/{n}"  # noqa: E731
    return [
        mk("Abs", [x], [t("abs")], name=t("Abs")),
        mk("ReduceMax", [t("abs"), ROW_AXES], [t("amax")], name=t("ReduceMax"), keepdims=1),  # [.., 1]
        mk("Max", [t("amax"), ROW_EPS], [t("amax_")], name=t("ScaleMax")),
        mk("Div", [ROW_QMAX, t("amax_")], [t("r")], name=t("ScaleDiv")),
        mk("Mul", [x, t("r")], [t("xn")], name=t("Mul")),
        mk("QuantizeLinear", [t("xn"), ROW_ONE, ROW_ZERO], [t("xq")], name=t("QuantizeLinear")),
        mk("DequantizeLinear", [t("xq"), ROW_ONE, ROW_ZERO], [t("x1")], name=t("DequantizeLinear")),
        mk("Sub", [t("xn"), t("x1")], [t("rest")], name=t("Rest")),  # |rest| <= 1/2
        mk("Mul", [t("rest"), PAIR_REST], [t("restn")], name=t("RestMul")),
        mk("QuantizeLinear", [t("restn"), ROW_ONE, ROW_ZERO], [t("rq")], name=t("RestQuantizeLinear")),
        mk("Concat", [t("xq"), t("rq")], [t("xr")], name=t("Concat"), axis=0),  # x's rows, then the rests'
        mk("MatMulIntegerToFloat", [t("xr"), name + ".w1", ROW_ONE, name + ".scale", ROW_ZERO, wzp], [t("y1")],
           name=t("MatMulIntegerToFloat"), domain=MS),  # one node reads w1: onnxruntime packs it once
        mk("Split", [t("y1")], [t("x_w1"), t("r_w1")], name=t("Split"), axis=0, num_outputs=2),
        mk("MatMulIntegerToFloat", [t("xq"), name + ".w2", ROW_ONE, name + ".scale", ROW_ZERO, wzp], [t("x_w2")],
           name=t("FineMatMulIntegerToFloat"), domain=MS),
        mk("Add", [t("r_w1"), t("x_w2")], [t("fine")], name=t("FineAdd")),
        mk("Mul", [t("fine"), PAIR_INV_REST], [t("fine_")], name=t("FineMul")),
        mk("Add", [t("x_w1"), t("fine_")], [t("acc")], name=t("Add")),
        mk("Div", [t("acc"), t("r")], [y], name=t("RowDiv")),
    ]


def _block_weights(model: onnx.ModelProto, base_dir: str, skip: frozenset[str]):
    """Yield (DequantizeLinear, its matrix [K, N] float32) for every block-wise DequantizeLinear
    of int4/int8 codes (axis=0, block_size B, zero points or none) whose only reader is a
    MatMul's weight, codes not in `skip`. The GGUF Q4_1 block offsets' product on that MatMul
    (`_offset_add`) is folded into the matrix and bypassed in the graph as it is yielded."""
    g = model.graph
    inits, _ = _scan(g)
    producer = _producers(g)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    for d in _dequantizes(g):
        codes, scale, a = inits.get(d.input[0]), inits.get(d.input[1]), _attrs(d)
        zp = inits.get(d.input[2]) if len(d.input) > 2 and d.input[2] else None
        block = a.get("block_size", 0)
        users = readers.get(d.output[0], [])
        if (codes is None or scale is None or d.input[0] in skip or len(codes.dims) != 2 or a.get("axis") != 0
                or not block or codes.dims[0] % block or scale.data_type != TensorProto.FLOAT
                or codes.data_type not in (TensorProto.INT4, TensorProto.UINT4, TensorProto.INT8, TensorProto.UINT8)
                or (len(d.input) > 2 and d.input[2] and zp is None)
                or len(users) != 1 or users[0].op_type != "MatMul" or users[0].input[1] != d.output[0]):
            continue
        w = numpy_helper.to_array(codes, base_dir).astype(np.float32)
        if zp is not None:
            w -= np.repeat(numpy_helper.to_array(zp, base_dir).astype(np.float32), block, axis=0)
        w *= np.repeat(numpy_helper.to_array(scale, base_dir), block, axis=0)
        mm = users[0]
        add, offset = _offset_add(mm, readers, producer, inits, block, w.shape)
        if offset is not None:
            w += np.repeat(numpy_helper.to_array(offset, base_dir).astype(np.float32), block, axis=0)
            bypass(add, mm.output[0])  # y + (block sums x offsets) ─> y: the offsets are in w now
        yield d, w


def _offset_add(mm: onnx.NodeProto, readers: dict, producer: dict, inits: dict, block: int,
                shape: tuple[int, ...]) -> tuple[onnx.NodeProto | None, onnx.TensorProto | None]:
    """The node that adds exporter/graph.py's block-offset product to `mm`'s output (a Gemm
    with it as C, or an Add of a MatMul) and that product's offset initializer [K/B, N];
    (None, None) when `mm` has none. The block sums come from a MatMul of `mm`'s input and a
    constant, or (builds before that) a ReduceSum of its Reshape."""
    users = readers.get(mm.output[0], [])
    if len(users) != 1:
        return None, None
    add = product = users[0]
    if add.op_type == "Add":
        product = producer.get(add.input[1] if add.input[0] == mm.output[0] else add.input[0])
    elif not (add.op_type == "Gemm" and add.input[2:] == [mm.output[0]] and not add.attribute):
        return None, None
    if product is None or product.op_type not in ("MatMul", "Gemm") or product.input[1] not in inits:
        return None, None
    offset = inits[product.input[1]]
    sums = producer.get(product.input[0])
    if sums is not None and sums.op_type == "ReduceSum":
        sums = producer.get(sums.input[0])  # its Reshape [.., K/B, B]
    elif sums is not None and not (sums.op_type == "MatMul" and sums.input[1] in inits):
        return None, None
    if list(offset.dims) != [shape[0] // block, shape[1]] or sums is None or sums.input[0] != mm.input[0]:
        return None, None
    return add, offset


def bypass(n: onnx.NodeProto, value: str) -> None:
    """Turn `n`, in place, into an Identity of `value` (its output names stay)."""
    n.op_type, n.domain = "Identity", ""
    del n.input[:], n.attribute[:]
    n.input.append(value)


def _prune(g: onnx.GraphProto) -> None:
    """Drop the nodes no graph output depends on, then the initializers nothing reads."""
    producer = _producers(g)
    live, todo = set(), [o.name for o in g.output]
    while todo:
        n = producer.get(todo.pop())
        if n is not None and id(n) not in live:
            live.add(id(n))
            todo.extend(i for i in n.input if i)
    keep = [n for n in g.node if id(n) in live]
    del g.node[:]
    g.node.extend(keep)
    _drop_unread(g)


def _drop_unread(g: onnx.GraphProto) -> None:
    """Drop the initializers no node reads."""
    used = {i for n in g.node for i in n.input}
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)


def logits_weight(g: onnx.GraphProto, logits: str) -> str | None:
    """The initializer the LM head's weight is dequantized from: the MatMul that `logits` comes
    from (through Cast / Identity / a bias Add / the block offsets' Gemm, whose C it is), its
    weight's DequantizeLinear's codes."""
    producer = _producers(g)
    n = producer.get(logits)
    while n is not None and (n.op_type in ("Cast", "Identity", "Add") or n.op_type == "Gemm" and len(n.input) == 3):
        n = producer.get(n.input[2] if n.op_type == "Gemm" else n.input[0])
    if n is None or n.op_type != "MatMul":
        return None
    d = producer.get(n.input[1])
    return d.input[0] if d is not None and d.op_type == "DequantizeLinear" else None
