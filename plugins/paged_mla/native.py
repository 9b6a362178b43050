"""The native CPU `kvexport::PagedMLA` (cpu/paged_mla_ort.cc): it is compiled into the same
onnxruntime custom-op library as PagedAttention and registered in the same `kvexport` domain,
so building and finding it is plugins/paged_attention/native.py's (scripts/build_cpu_ops.sh);
this module says what the op takes and gives the one-node models and bindings that tests and
measurements run it with.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import onnx

from kvexport import io

from ..paged_attention.native import library  # noqa: F401  (the one library: both ops)
from .spec import INPUTS, OP_TYPE, OUTPUTS, SCORE_INPUT, SCORE_OUTPUT, PagedMLAAttrs

POOL_DTYPES = ("float32", "float16", "bfloat16", "int8")  # pools the native op takes
_BF16 = onnx.TensorProto.BFLOAT16


def supports(act_dtype: str, kv_dtype: str) -> bool:
    """Whether the native op runs an MLA plugin graph with these activation / pool dtypes."""
    return act_dtype == "float32" and kv_dtype in POOL_DTYPES


def has_mla(path: Path) -> bool:
    """Whether the op library at `path` has PagedMLA (libraries built before it do not): it
    exports kvexport_paged_mla_version() (cpu/paged_mla_ort.cc)."""
    try:
        return ctypes.CDLL(str(path)).kvexport_paged_mla_version() >= 1
    except (OSError, AttributeError):
        return False


def library_for(manifest) -> tuple[Path | None, str]:
    """(the op library for this MLA build's plugin graphs, "") or (None, why not)."""
    if manifest.kv.attention != io.Attention.PLUGIN.value:
        return None, f"the build's attention is {manifest.kv.attention!r}, not plugin"
    lib = library()
    if lib is None:
        return None, "the CPU op is not built (scripts/build_cpu_ops.sh)"
    if not has_mla(lib):
        return None, f"{lib} predates kvexport::PagedMLA: rebuild it (scripts/build_cpu_ops.sh)"
    act, kv = io.DType(manifest.dtype).numpy_name, io.DType(manifest.kv.dtype).numpy_name
    if not supports(act, kv):
        return None, f"the CPU MLA op takes float32 activations with {'/'.join(POOL_DTYPES)} pools, not {act}/{kv}"
    return lib, ""


def one_node_model(attrs: PagedMLAAttrs, act_dtype: str = "float32", kv_dtype: str | None = None, *,
                   scores: bool = False) -> onnx.ModelProto:
    """An ONNX model of one PagedMLA node (inputs/outputs named as in spec.py), to run or measure
    the op on its own (reference harness or native op). `scores`: with the optional observation_lens
    input and attention_scores output (spec.py "Attention scores")."""
    from onnx import TensorProto, helper

    tp = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
          "int8": TensorProto.INT8}
    act, pool = tp[act_dtype], tp[kv_dtype or attrs.kv_dtype]
    w = attrs.row_width
    types = [act, act, pool] + [TensorProto.INT64] * 4 + [TensorProto.FLOAT]
    shapes = [["num_tokens", attrs.num_heads, w], ["num_tokens", w], [1, "num_blocks", attrs.block_size, w],
              ["num_seqs", "max_blocks"], ["num_seqs"], ["num_seqs_plus_1"], ["num_tokens"], [w]]
    ins = [helper.make_tensor_value_info(n, t, d) for n, t, d in zip(INPUTS, types, shapes)]
    outs = [helper.make_tensor_value_info(OUTPUTS[0], act, ["num_tokens", attrs.num_heads, attrs.kv_lora_rank]),
            helper.make_tensor_value_info(OUTPUTS[1], pool, shapes[2])]
    in_names, out_names = list(INPUTS), list(OUTPUTS)
    if scores:
        ins.append(helper.make_tensor_value_info(SCORE_INPUT, TensorProto.INT64, ["num_seqs"]))
        outs.append(helper.make_tensor_value_info(SCORE_OUTPUT, TensorProto.FLOAT, ["num_seqs", 1, "score_len"]))
        in_names.append(SCORE_INPUT)
        out_names.append(SCORE_OUTPUT)
    node = helper.make_node(OP_TYPE, in_names, out_names, domain=io.PLUGIN_DOMAIN, name="paged_mla",
                            **attrs.onnx_attributes())
    return helper.make_model(helper.make_graph([node], "paged_mla", ins, outs),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(io.PLUGIN_DOMAIN, 1)])


def ort_value(arr: np.ndarray, kv_dtype: str):
    """An OrtValue over `arr` (sharing its memory); bfloat16 pools are held as uint16 bits."""
    import onnxruntime as ort

    if kv_dtype == "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr, _BF16)
    return ort.OrtValue.ortvalue_from_numpy(arr)


def in_place_binding(sess, feeds: dict, kv_dtype: str):
    """An IOBinding of a one-node session (`one_node_model`) with the pool bound as both its input
    and its aliased output, as the runtime runs the op: after `sess.run_with_iobinding(b)` the
    numpy pool in `feeds` (bfloat16: its uint16 bits) holds the updated pool."""
    b = sess.io_binding()
    pool = ort_value(feeds["latent_cache"], kv_dtype)
    for n, arr in feeds.items():
        b.bind_ortvalue_input(n, pool) if n == "latent_cache" else b.bind_cpu_input(n, arr)
    b.bind_output("output")
    b.bind_ortvalue_output("latent_cache_out", pool)
    return b
