"""The reference PagedMLA as an onnxruntime custom op, so MLA `--attention plugin` graphs run on
CPU before (or without) the native op: validation, tests, fallback — as
plugins/paged_attention/ort.py does for PagedAttention.

Uses onnxruntime-extensions' Python custom ops (PyOp), which live in one fixed domain
(`ai.onnx.contrib`) with fixed element types: `rewrite_for_reference()` points each
`kvexport::PagedMLA` node at a PyOp registered for the node's dtypes (float16 / bfloat16
tensors pass through Casts to float32: lossless, the reference rounds what it stores to the
kv_dtype attribute and the pool is cast back). `plugin_session()` rewrites PagedAttention
nodes too (paged_attention.ort), so one call opens any plugin graph.

NOTE: a PyOp returns its outputs through Python lists, so the updated pool is copied each call
(O(pool) per layer per step): fine for tests and validation, not for serving.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from kvexport import io
from kvexport.errors import KvExportError

from ..paged_attention.ort import _extensions
from ..paged_attention.ort import rewrite_for_reference as rewrite_paged_attention
from .reference import paged_mla
from .spec import NUM_INPUTS, OP_TYPE, PagedMLAAttrs

_REGISTERED: set[str] = set()
_ATTR_TYPES = {"num_heads": "int", "kv_lora_rank": "int", "qk_rope_head_dim": "int", "block_size": "int",
               "scale": "float", "kv_dtype": "str", "plugin_namespace": "str", "plugin_version": "str",
               "scale_exact": "str"}
# NOTE: onnxruntime-extensions hands float attributes to a PyOp printed to 6 significant digits;
# the rewrite adds the scale's repr as a string attribute, so the reference sees the node's value.
_WIDE = {"float16", "bfloat16"}  # run as float32 through the PyOp


def _register(act: str, kv: str) -> str:
    """Register (once per process) the reference as a PyOp for these element types."""
    import torch

    name = f"KvexportPagedMLA_{act}_{kv}"
    if name in _REGISTERED:
        return name
    ortx = _extensions()
    d = ortx.PyCustomOpDef
    dt = {"float32": d.dt_float, "int8": d.dt_int8}
    types = [dt[act]] * 2 + [dt[kv]] + [d.dt_int64] * 4 + [d.dt_float]
    attrs = {k: {"int": d.dt_int64, "float": d.dt_float, "str": d.dt_string}[t] for k, t in _ATTR_TYPES.items()}

    def run(*args, **kw):
        exact = kw.pop("scale_exact", "")
        attrs_ = PagedMLAAttrs.from_onnx_attributes({**kw, "scale": float(exact) if exact else kw["scale"]})
        t = [torch.from_numpy(np.array(a)) for a in args]
        cache = t[2].clone()
        out = paged_mla(t[0], t[1], cache, *t[3:8], attrs=attrs_)
        return out.numpy(), cache.numpy()

    ortx.onnx_op(op_type=name, inputs=types, outputs=[dt[act], dt[kv]], attrs=attrs)(run)
    _REGISTERED.add(name)
    return name


def rewrite_for_reference(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose PagedMLA nodes call the registered reference PyOps."""
    ortx = _extensions()
    model = onnx.ModelProto.FromString(model.SerializeToString())
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.value_info)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    types.update({v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info})
    np_name = lambda t: onnx.helper.tensor_dtype_to_np_dtype(t).name  # noqa: E731
    elem_name = lambda t: "bfloat16" if t == onnx.TensorProto.BFLOAT16 else np_name(t)  # noqa: E731
    found = False
    nodes = []
    for node in model.graph.node:
        if node.domain != io.PLUGIN_DOMAIN or node.op_type != OP_TYPE:
            nodes.append(node)
            continue
        found = True
        if len(node.input) != NUM_INPUTS:
            raise KvExportError(f"{node.name}: {OP_TYPE} takes {NUM_INPUTS} inputs, got {len(node.input)}")
        act = elem_name(types.get(node.input[0], onnx.TensorProto.FLOAT))
        kv = elem_name(types[node.input[2]])
        before, after = [], []
        f32 = onnx.TensorProto.FLOAT
        for j in [j for j in (0, 1) if act in _WIDE] + [2] * (kv in _WIDE):
            name = f"{node.name}/in{j}_f32"
            before.append(onnx.helper.make_node("Cast", [node.input[j]], [name], to=f32, name=name))
            node.input[j] = name
        for j, dtype in [(0, act)] * (act in _WIDE) + [(1, kv)] * (kv in _WIDE):
            orig, name = node.output[j], f"{node.name}/out{j}_f32"
            to = onnx.TensorProto.FLOAT16 if dtype == "float16" else onnx.TensorProto.BFLOAT16
            after.append(onnx.helper.make_node("Cast", [name], [orig], to=to, name=orig + "/cast"))
            node.output[j] = name
        scale = next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "scale")
        node.attribute.append(onnx.helper.make_attribute("scale_exact", repr(float(scale))))
        node.op_type = _register("float32" if act in _WIDE else act, "float32" if kv in _WIDE else kv)
        node.domain = ortx.default_opset_domain()
        nodes += before + [node] + after
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if found and not any(o.domain == ortx.default_opset_domain() for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(ortx.default_opset_domain(), 1))
    return model


def plugin_session(path: str | Path, threads: int | None = None, options=None):
    """An onnxruntime CPU session for a plugin graph with PagedMLA and/or PagedAttention nodes,
    all run by their references (external weights resolved next to the graph). `options`:
    onnxruntime SessionOptions to start from (the runtime's); else defaults."""
    import onnxruntime as ort

    ortx = _extensions()
    path = Path(path)
    model = rewrite_for_reference(rewrite_paged_attention(onnx.load(str(path), load_external_data=False)))
    so = options or ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(ortx.get_library_path())
    if threads:
        so.intra_op_num_threads = threads
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
