"""onnxruntime's CPU form of per-channel int8 weights, derived from the portable graph when a
session is opened: one build, both targets.

A build's per-channel int8 matmul (exporter/graph.py `_dequantized`, `--weights int8
--weight-block-size channel`) is the standard QDQ form that TensorRT reads as weight-only INT8:

    codes int8 [K, N], scale [N] ─> DequantizeLinear(axis=1) ─> [K, N] ─> MatMul(x, ·)

onnxruntime runs that form by dequantizing the whole weight on every call (slower than fp32).
Its fast int8 path takes int8 *activations* too, which TensorRT's weight-only engines do not, so
the build cannot store it. `int8_dynamic()` rewrites the loaded ModelProto (weights stay
external, codes stay int8) before the InferenceSession is made:

    x [.., K] ─> DynamicQuantizeLinear ─> xq uint8, xs, xz ─> MatMulInteger(xq, codes, xz, 0) [.., N] int32
        ─> Cast float ─> Mul(xs * scale [N]) ─> [.., N]

which onnxruntime fuses to DynamicQuantizeMatMul (bench/quant_linear.py: ~3x fp32 at M >= 64).
NOTE: DynamicQuantizeLinear takes one scale for the whole activation tensor (asymmetric uint8),
so a row's rounding depends on the other rows of the step; perplexity is measured in
bench/weight_quality.py.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

DOMAIN_OPSET = 11  # DynamicQuantizeLinear / MatMulInteger: opset 10-11, unchanged through 21


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def int8_dynamic(model: onnx.ModelProto) -> int:
    """Rewrite, in place, every float32 MatMul whose weight is a per-channel int8
    DequantizeLinear of an initializer (axis=1, scale [N], no or zero zero point) into the
    dynamic-int8 form above. Returns how many MatMuls were rewritten (0: model unchanged)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    dq = {}
    for n in g.node:
        if n.op_type != "DequantizeLinear" or n.domain not in ("", "ai.onnx"):
            continue
        codes, scale = inits.get(n.input[0]), inits.get(n.input[1])
        zp = inits.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        a = _attrs(n)
        if (codes is None or scale is None or codes.data_type != TensorProto.INT8 or len(codes.dims) != 2
                or a.get("axis") != 1 or a.get("block_size", 0) != 0 or scale.data_type != TensorProto.FLOAT
                or list(scale.dims) != [codes.dims[1]] or (len(n.input) > 2 and n.input[2] and zp is None)):
            continue
        if zp is not None and (zp.data_type != TensorProto.INT8 or any(onnx.numpy_helper.to_array(zp))):
            continue
        if consumers.get(n.output[0]) == 1:
            dq[n.output[0]] = n
    nodes, count, zero_points = [], 0, {}
    for n in g.node:
        if n.output and n.output[0] in dq:
            continue  # dropped: its MatMul reads the codes itself
        if n.op_type != "MatMul" or n.input[1] not in dq:
            nodes.append(n)
            continue
        d = dq[n.input[1]]
        n_out = inits[d.input[0]].dims[1]
        if n_out not in zero_points:  # one all-zero [N] int8 per width
            zero_points[n_out] = f"kvexport.int8_zero_point.{n_out}"
            g.initializer.append(helper.make_tensor(zero_points[n_out], TensorProto.INT8, [n_out], bytes(n_out), raw=True))
        p = n.name or n.output[0]
        xq, xs, xz = f"{p}/xq", f"{p}/xs", f"{p}/xz"
        nodes += [
            helper.make_node("DynamicQuantizeLinear", [n.input[0]], [xq, xs, xz], name=f"{p}/DynamicQuantizeLinear"),
            helper.make_node("MatMulInteger", [xq, d.input[0], xz, zero_points[n_out]], [f"{p}/acc"],
                             name=f"{p}/MatMulInteger"),  # [.., N] int32
            helper.make_node("Cast", [f"{p}/acc"], [f"{p}/accf"], name=f"{p}/Cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", [xs, d.input[1]], [f"{p}/scale"], name=f"{p}/ScaleMul"),  # [N]
            helper.make_node("Mul", [f"{p}/accf", f"{p}/scale"], list(n.output), name=f"{p}/Mul"),
        ]
        count += 1
    if count:
        del g.node[:]
        g.node.extend(nodes)
    return count
