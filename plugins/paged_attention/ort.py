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
from typing import Callable

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
               "attention_sinks": "str"}  # NOTE: PyOps take no float lists: rewrite_for_reference writes them as text
_EXACT = ("scale", "logit_softcap")  # float attributes passed exactly (add_exact)
_WIDE = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}  # PyOps have neither


def _extensions():
    try:
        import onnxruntime_extensions as ortx
    except ImportError as e:
        raise KvExportError("running `--attention plugin` graphs in onnxruntime needs the reference "
                            "custom op from onnxruntime-extensions: pip install onnxruntime-extensions "
                            "(or build TensorRT engines: kvexport build --backend tensorrt)") from e
    return ortx


# ---- the PyOp plumbing, shared with plugins/paged_mla/ort.py -----------------------------------
def pyop_attrs(d, attr_types: dict[str, str], exact: tuple[str, ...]) -> dict:
    """The PyOp attribute declarations (d: ortx.PyCustomOpDef) of `attr_types` (name -> "int" |
    "float" | "str"), plus the string `<name>_exact` of each float attribute in `exact` (add_exact)."""
    types = {**attr_types, **{f"{k}_exact": "str" for k in exact}}
    return {k: {"int": d.dt_int64, "float": d.dt_float, "str": d.dt_string}[t] for k, t in types.items()}


def add_exact(node: onnx.NodeProto, exact: tuple[str, ...]) -> None:
    """Adds each float attribute in `exact` again as the string `<name>_exact`: its repr, or empty
    when the node lacks it (a PyOp needs every declared attribute).

    NOTE: onnxruntime-extensions hands float attributes to a PyOp printed to 6 significant digits;
    read_exact gives the reference the node's value (head_dim 80's scale 0.11180339... would
    otherwise be 0.111803)."""
    for k in exact:
        value = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == k), None)
        node.attribute.append(onnx.helper.make_attribute(f"{k}_exact", repr(float(value)) if value is not None
                                                         else ""))


def read_exact(kw: dict, exact: tuple[str, ...]) -> dict:
    """A PyOp's attributes with each `<name>_exact` (add_exact) read back over its 6-digit float."""
    kw = dict(kw)
    for k in exact:
        text = kw.pop(f"{k}_exact", "")
        if text:
            kw[k] = float(text)
    return kw


def pyop_dtype(dtype: str) -> str:
    """The element type a PyOp sees for a tensor of `dtype` (cast_wide)."""
    return "float32" if dtype in _WIDE else dtype


def cast_wide(node: onnx.NodeProto, inputs: dict[int, str], outputs: dict[int, str]) -> tuple[list, list]:
    """(Casts before, Casts after) that run `node` in float32: each of `inputs` (index -> dtype)
    that is float16 / bfloat16 cast to float32, each such output cast back to its dtype.

    NOTE: lossless: fp16 / bf16 values are exact in float32, the references round what they
    store to the kv_dtype attribute, and the pools are cast back."""
    before, after = [], []
    for j, dtype in inputs.items():
        if dtype in _WIDE:
            name = f"{node.name}/in{j}_f32"
            before.append(onnx.helper.make_node("Cast", [node.input[j]], [name], to=onnx.TensorProto.FLOAT,
                                                name=name))
            node.input[j] = name
    for j, dtype in outputs.items():
        if dtype in _WIDE:
            orig, name = node.output[j], f"{node.name}/out{j}_f32"
            after.append(onnx.helper.make_node("Cast", [name], [orig], to=_WIDE[dtype], name=orig + "/cast"))
            node.output[j] = name
    return before, after


def rewrite_nodes(model: onnx.ModelProto, op_type: str, num_inputs: int,
                  rewrite: Callable[[onnx.NodeProto, Callable[[str], str]], tuple[str, list, list]]
                  ) -> onnx.ModelProto:
    """A copy of `model` whose `kvexport::<op_type>` nodes call PyOps: rewrite(node, dtype) edits
    the node and returns (its PyOp type, nodes before it, nodes after); dtype(tensor name) is its
    element type ("float32", "bfloat16", "int8", ...; "float32" when the graph does not say)."""
    ortx = _extensions()
    model = onnx.ModelProto.FromString(model.SerializeToString())
    codes = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.value_info)}
    codes.update({t.name: t.data_type for t in model.graph.initializer})
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    codes.update({v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info})

    def dtype(tensor: str) -> str:  # "float32" when not known
        t = codes.get(tensor, onnx.TensorProto.FLOAT)
        return "bfloat16" if t == onnx.TensorProto.BFLOAT16 else onnx.helper.tensor_dtype_to_np_dtype(t).name

    found = False
    nodes = []
    for node in model.graph.node:
        if node.domain != io.PLUGIN_DOMAIN or node.op_type != op_type:
            nodes.append(node)
            continue
        found = True
        if len(node.input) != num_inputs:
            raise KvExportError(f"{node.name}: {op_type} takes {num_inputs} inputs, got {len(node.input)}")
        node.op_type, before, after = rewrite(node, dtype)
        node.domain = ortx.default_opset_domain()
        nodes += before + [node] + after
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if found and not any(o.domain == ortx.default_opset_domain() for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(ortx.default_opset_domain(), 1))
    return model


def open_session(model: onnx.ModelProto, path: Path, threads: int | None, options):
    """An onnxruntime CPU session for a rewritten plugin graph loaded from `path` (its external
    weights resolved next to it), with the PyOps' library registered."""
    import onnxruntime as ort

    so = options or ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(_extensions().get_library_path())
    if threads:
        so.intra_op_num_threads = threads
    # the model is loaded from bytes: external weights resolve against the graph's folder
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


# ---- PagedAttention ---------------------------------------------------------------------------
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
    dt = {"float32": d.dt_float, "int8": d.dt_int8, "int64": d.dt_int64, "uint8": d.dt_uint8}  # uint8: int4 KV rows
    types = [dt[act]] * 3 + [dt[kv]] * 2 + [d.dt_int64] * 4 + [d.dt_float] * (n_inputs - 9)

    def run(*args, **kw):
        attrs_ = PagedAttentionAttrs.from_onnx_attributes(read_exact(kw, _EXACT))
        t = [torch.from_numpy(np.array(a)) for a in args]
        kc, vc = t[3].clone(), t[4].clone()
        out = paged_attention(*t[:3], kc, vc, *t[5:11], attrs=attrs_)
        return out.numpy(), kc.numpy(), vc.numpy()

    ortx.onnx_op(op_type=name, inputs=types, outputs=[dt[act], dt[kv], dt[kv]],
                 attrs=pyop_attrs(d, _ATTR_TYPES, _EXACT))(run)
    _REGISTERED.add(name)
    return name


def _rewrite_node(node: onnx.NodeProto, dtype: Callable[[str], str]) -> tuple[str, list, list]:
    # NOTE: a PyOp needs every declared attribute: nodes without sinks get an empty text
    sinks = next((a for a in node.attribute if a.name == "attention_sinks"), None)
    if sinks is not None:
        node.attribute.remove(sinks)  # float32 values, repr'd exactly (spec.from_onnx_attributes parses them)
    node.attribute.append(onnx.helper.make_attribute(
        "attention_sinks", ",".join(map(repr, sinks.floats)) if sinks is not None else ""))
    add_exact(node, _EXACT)
    act, kv = dtype(node.input[0]), dtype(node.input[3])
    before, after = cast_wide(node, {0: act, 1: act, 2: act, 3: kv, 4: kv}, {0: act, 1: kv, 2: kv})
    return _register(pyop_dtype(act), pyop_dtype(kv), len(node.input)), before, after


def rewrite_for_reference(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose PagedAttention nodes call the registered reference PyOps."""
    return rewrite_nodes(model, io.PLUGIN_OP, NUM_INPUTS, _rewrite_node)


def plugin_session(path: str | Path, threads: int | None = None, options=None):
    """An onnxruntime CPU session for a plugin graph (external weights resolved next to it).
    `options`: onnxruntime SessionOptions to start from (the runtime's); else defaults."""
    path = Path(path)
    return open_session(rewrite_for_reference(onnx.load(str(path), load_external_data=False)), path, threads,
                        options)
