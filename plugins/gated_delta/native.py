"""The native CPU `kvexport::GatedDeltaRule` (cpu/gated_delta_ort.cc): it is compiled into the same
onnxruntime custom-op library as PagedAttention and registered in the same `kvexport` domain, so
building and finding it is plugins/paged_attention/native.py's (scripts/build_cpu_ops.sh); this
module says whether a library has it and gives the one-node model that tests and measurements run.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import onnx

from ..paged_attention.native import library  # noqa: F401  (the one library: every op)
from .spec import INPUTS, OP_TYPE, OUTPUTS, GatedDeltaAttrs


def has_gated_delta(path: Path) -> bool:
    """Whether the op library at `path` has GatedDeltaRule (libraries built before it do not): it
    exports kvexport_gated_delta_version() (cpu/gated_delta_ort.cc)."""
    try:
        return ctypes.CDLL(str(path)).kvexport_gated_delta_version() >= 1
    except (OSError, AttributeError):
        return False


def library_or_why() -> tuple[Path | None, str]:
    """(the op library, "") when the installed one has GatedDeltaRule, else (None, why not)."""
    lib = library()
    if lib is None:
        return None, "the CPU op library is not built (scripts/build_cpu_ops.sh)"
    if not has_gated_delta(lib):
        return None, f"{lib} predates kvexport::GatedDeltaRule: rebuild it (scripts/build_cpu_ops.sh)"
    return lib, ""


def one_node_model(attrs: GatedDeltaAttrs) -> onnx.ModelProto:
    """An ONNX model of one GatedDeltaRule node (inputs/outputs named as in spec.py), float32, to
    run or measure the op on its own."""
    from onnx import TensorProto, helper

    from kvexport import io

    hk, hv, dk, dv = attrs.num_k_heads, attrs.num_v_heads, attrs.k_head_dim, attrs.v_head_dim
    f, i = TensorProto.FLOAT, TensorProto.INT64
    shapes = [["num_tokens", hk, dk], ["num_tokens", hk, dk], ["num_tokens", hv, dv], ["num_tokens", hv],
              ["num_tokens", hv], ["num_state_slots", hv, dk, dv], ["num_seqs"], ["num_seqs"], ["num_seqs_plus_1"]]
    ins = [helper.make_tensor_value_info(n, f if k <= 5 else i, d) for k, (n, d) in enumerate(zip(INPUTS, shapes))]
    outs = [helper.make_tensor_value_info(OUTPUTS[0], f, ["num_tokens", hv, dv]),
            helper.make_tensor_value_info(OUTPUTS[1], f, ["num_seqs", hv, dk, dv])]
    node = helper.make_node(OP_TYPE, list(INPUTS), list(OUTPUTS), domain=io.PLUGIN_DOMAIN, name="gated_delta",
                            **attrs.onnx_attributes())
    return helper.make_model(helper.make_graph([node], "gated_delta", ins, outs),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(io.PLUGIN_DOMAIN, 1)])


def session(attrs: GatedDeltaAttrs, threads: int = 1):
    """An onnxruntime session of `one_node_model` with the native library registered."""
    import onnxruntime as ort

    from kvexport.errors import KvExportError

    lib, why = library_or_why()
    if lib is None:
        raise KvExportError(why)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(one_node_model(attrs).SerializeToString(), so, providers=["CPUExecutionProvider"])
