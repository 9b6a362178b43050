"""The reference PagedAttention as an onnxruntime custom op, so `--attention plugin` graphs
run on CPU: this is how CI proves a plugin graph means the same as the `onnx` attention
graph and as transformers (the TensorRT plugin itself is checked against the same reference).

Uses onnxruntime-extensions' Python custom ops (PyOp). Its ops live in one fixed domain
(`ai.onnx.contrib`) and have fixed input/output element types, so `plugin_session()` loads
the graph, points each `kvexport::PagedAttention` node at a PyOp registered for the node's
dtypes and input count, and opens the session. The graph file is not modified.

NOTE: a PyOp returns its outputs through Python lists, so the updated pools are copied
each call (O(pool) per layer per step): fine for tests and validation, not for serving.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from kvexport import io
from kvexport.errors import KvExportError

from .reference import paged_attention
from .spec import NUM_INPUTS, PagedAttentionAttrs

_REGISTERED: set[str] = set()
_ATTR_TYPES = {"num_heads": "int", "num_kv_heads": "int", "head_dim": "int", "block_size": "int",
               "scale": "float", "sliding_window": "int", "kv_dtype": "str", "logit_softcap": "float",
               "plugin_namespace": "str", "plugin_version": "str",
               "attention_sinks": "str",  # NOTE: PyOps take no float lists: rewrite_for_reference writes them as text
               "scale_exact": "str", "logit_softcap_exact": "str"}
# NOTE: onnxruntime-extensions hands float attributes to a PyOp printed to 6 significant digits;
# the rewrite adds each one's repr as a string attribute (`<name>_exact`), so the reference
# sees the node's value (head_dim 80's scale 0.11180339... would otherwise be 0.111803)
_EXACT = ("scale", "logit_softcap")


def _extensions():
    try:
        import onnxruntime_extensions as ortx
    except ImportError as e:
        raise KvExportError("running `--attention plugin` graphs in onnxruntime needs the reference "
                            "custom op from onnxruntime-extensions: pip install onnxruntime-extensions "
                            "(or build TensorRT engines: kvexport build --backend tensorrt)") from e
    return ortx


def _op_name(act: str, kv: str, n_inputs: int) -> str:
    return f"KvexportPagedAttention_{act}_{kv}_{n_inputs}"


def _register(act: str, kv: str, n_inputs: int) -> str:
    """Register (once per process) the reference as a PyOp for these element types."""
    import torch

    name = _op_name(act, kv, n_inputs)
    if name in _REGISTERED:
        return name
    ortx = _extensions()
    d = ortx.PyCustomOpDef
    dt = {"float32": d.dt_float, "float16": d.dt_float16, "int8": d.dt_int8, "int64": d.dt_int64,
          "uint8": d.dt_uint8}  # uint8: int4 KV rows
    types = [dt[act]] * 3 + [dt[kv]] * 2 + [d.dt_int64] * 4 + [d.dt_float] * (n_inputs - 9)
    attrs = {k: {"int": d.dt_int64, "float": d.dt_float, "str": d.dt_string}[t] for k, t in _ATTR_TYPES.items()}

    def run(*args, **kw):
        for k in _EXACT:
            exact = kw.pop(f"{k}_exact", "")
            if exact:
                kw[k] = float(exact)
        attrs_ = PagedAttentionAttrs.from_onnx_attributes(kw)
        t = [torch.from_numpy(np.array(a)) for a in args]
        kc, vc = t[3].clone(), t[4].clone()
        out = paged_attention(*t[:3], kc, vc, *t[5:11], attrs=attrs_)
        return out.numpy(), kc.numpy(), vc.numpy()

    ortx.onnx_op(op_type=name, inputs=types, outputs=[dt[act], dt[kv], dt[kv]], attrs=attrs)(run)
    _REGISTERED.add(name)
    return name


def rewrite_for_reference(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose PagedAttention nodes call the registered reference PyOps."""
    ortx = _extensions()
    model = onnx.ModelProto.FromString(model.SerializeToString())
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.value_info)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    types.update({v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info})
    np_name = lambda t: onnx.helper.tensor_dtype_to_np_dtype(t).name  # noqa: E731
    found = False
    nodes = []
    for node in model.graph.node:
        if node.domain != io.PLUGIN_DOMAIN or node.op_type != io.PLUGIN_OP:
            nodes.append(node)
            continue
        found = True
        if len(node.input) != NUM_INPUTS:
            raise KvExportError(f"{node.name}: PagedAttention takes {NUM_INPUTS} inputs, got {len(node.input)}")
        # NOTE: a PyOp needs every declared attribute: nodes without sinks get an empty text
        sinks = next((a for a in node.attribute if a.name == "attention_sinks"), None)
        if sinks is not None:
            node.attribute.remove(sinks)  # float32 values, repr'd exactly (spec.from_onnx_attributes parses them)
        node.attribute.append(onnx.helper.make_attribute(
            "attention_sinks", ",".join(map(repr, sinks.floats)) if sinks is not None else ""))
        for k in _EXACT:
            value = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == k), None)
            node.attribute.append(onnx.helper.make_attribute(f"{k}_exact", repr(float(value)) if value is not None
                                                             else ""))
        act = np_name(types.get(node.input[0], onnx.TensorProto.FLOAT))
        kv = np_name(types[node.input[3]])
        # NOTE: PyOps have no float16: run fp16 tensors through the reference as float32.
        # Lossless: fp16 values are exact in float32, the reference rounds what it stores
        # to the kv_dtype attribute (fp16), and the pools are cast back to fp16.
        before, after = [], []
        if "float16" in (act, kv):
            f32 = onnx.TensorProto.FLOAT
            for j in [j for j in (0, 1, 2) if act == "float16"] + [j for j in (3, 4) if kv == "float16"]:
                name = f"{node.name}/in{j}_f32"
                before.append(onnx.helper.make_node("Cast", [node.input[j]], [name], to=f32, name=name))
                node.input[j] = name
            for j in [0] * (act == "float16") + [1, 2] * (kv == "float16"):
                orig, name = node.output[j], f"{node.name}/out{j}_f32"
                after.append(onnx.helper.make_node("Cast", [name], [orig], to=onnx.TensorProto.FLOAT16, name=orig + "/cast"))
                node.output[j] = name
            act, kv = ("float32" if act == "float16" else act), ("float32" if kv == "float16" else kv)
        node.op_type = _register(act, kv, len(node.input))
        node.domain = ortx.default_opset_domain()
        nodes += before + [node] + after
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if found:
        model.opset_import.append(onnx.helper.make_opsetid(ortx.default_opset_domain(), 1))
    return model


def plugin_session(path: str | Path, threads: int | None = None, options=None):
    """An onnxruntime CPU session for a plugin graph (external weights resolved next to it).
    `options`: onnxruntime SessionOptions to start from (the runtime's); else defaults."""
    import onnxruntime as ort

    ortx = _extensions()
    path = Path(path)
    model = rewrite_for_reference(onnx.load(str(path), load_external_data=False))
    so = options or ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(ortx.get_library_path())
    if threads:
        so.intra_op_num_threads = threads
    # the model is loaded from bytes: external weights resolve against the graph's folder
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
