"""One linear layer (default 576 x 1536, smollm2's MLP up) in each weight form kvexport can emit,
timed with onnxruntime on this CPU for several row counts M: which form is fastest where.

    .venv/bin/python bench/quant_linear.py [--k 576 --n 1536 --threads 2]

Forms: fp32 MatMul; block-wise DequantizeLinear (opset 21, int4/int8, block 32) -> MatMul, which
onnxruntime fuses to MatMulNBits, with the default and `session.qdq_matmulnbits_accuracy_level=4`;
per-channel int8 with dynamic int8 activations (DynamicQuantizeLinear + MatMulInteger, fused to
DynamicQuantizeMatMul). Prints ms per call (median of repeats)."""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kvexport.exporter import quantize as qz
from kvexport.runtime.execution.ort_quant import int8_dynamic


def _model(nodes, inits, k, n, opset):
    g = helper.make_graph(nodes, "lin", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return m


def forms(w: np.ndarray):
    k, n = w.shape
    yield "fp32", _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [numpy_helper.from_array(w, "w")], k, n, 18), {}
    for bits in (4, 8):
        qm = qz.quantize_rtn(w, bits, 32)
        codes, dt = qz.stored_codes(qm.q, bits)
        wq = helper.make_tensor("wq", dt, list(qm.q.shape), codes.tobytes(), raw=True)
        nodes = [helper.make_node("DequantizeLinear", ["wq", "s"], ["wd"], axis=0, block_size=32),
                 helper.make_node("MatMul", ["x", "wd"], ["y"])]
        m = _model(nodes, [wq, numpy_helper.from_array(qm.scale, "s")], k, n, 21)
        for acc in (0, 4):
            yield f"int{bits} block32 DQ->MatMul acc{acc}", m, {"session.qdq_matmulnbits_accuracy_level": str(acc)}
    # per output channel (--weight-block-size channel): the portable form, and what the runtime
    # derives from it at session load (runtime/execution/ort_quant.py)
    qm = qz.quantize_rtn(w, 8, qz.CHANNEL)
    nodes = [helper.make_node("DequantizeLinear", ["wq", "s"], ["wd"], axis=1),
             helper.make_node("MatMul", ["x", "wd"], ["y"])]
    inits = [numpy_helper.from_array(qm.q, "wq"), numpy_helper.from_array(qm.scale[0], "s")]
    m = _model(nodes, inits, k, n, 21)
    yield "int8 channel DQ(axis=1)->MatMul (portable)", m, {}
    for per_row in (False, True):
        d = onnx.ModelProto.FromString(m.SerializeToString())
        assert int8_dynamic(d, per_row=per_row) == 1
        yield f"int8 channel, dynamic per {'row' if per_row else 'tensor'} (ort_quant)", d, {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,64,256")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((a.k, a.n)) * 0.05).astype(np.float32)
    rows = [int(r) for r in a.rows.split(",")]
    print(f"{'form':44s}" + "".join(f"  M={r:<5d}" for r in rows) + "  max|err| M=4")
    for name, model, cfg in forms(w):
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = a.threads, 1
        so.log_severity_level = 3
        for key, v in cfg.items():
            so.add_session_config_entry(key, v)
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        cells = []
        for r in rows:
            x = rng.standard_normal((r, a.k)).astype(np.float32)
            for _ in range(3):
                sess.run(None, {"x": x})
            reps = max(5, int(2000 / r))
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(reps // 5):
                    sess.run(None, {"x": x})
                ts.append((time.perf_counter() - t) / (reps // 5))
            cells.append(f"  {np.median(ts) * 1e3:7.3f}")
        x = rng.standard_normal((4, a.k)).astype(np.float32)
        err = np.abs(sess.run(None, {"x": x})[0] - x @ w).max()
        print(f"{name:44s}" + "".join(cells) + f"  {err:.3f}")


if __name__ == "__main__":
    main()
