"""An op's reference as an onnxruntime custom op (onnxruntime-extensions' Python custom ops,
PyOps), so `--attention plugin` graphs run on CPU without the native op: validation, tests,
the fallback. Each op's ort.py gives its node rewrite; this module owns the rest.

PyOps live in one fixed domain (`ai.onnx.contrib`) and have fixed input/output element types,
so `rewrite_nodes()` points each `kvexport::<op>` node at a PyOp registered for the node's
dtypes (`register()`), float16 / bfloat16 tensors pass through Casts to float32
(`cast_wide()`), and `plugin_session()` opens the rewritten graph with every registered op's
rewrite (kvexport.plugins.REGISTRY). The graph file is not modified.

NOTE: a PyOp returns its outputs through Python lists, so the updated pools are copied each
call (O(pool) per layer per step): fine for tests and validation, not for serving.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

import onnx

from kvexport import io
from kvexport.errors import KvExportError

_REGISTERED: set[str] = set()  # PyOp names registered in this process
_WIDE = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}  # PyOps have neither


def extensions():
    """The onnxruntime_extensions module, or a KvExportError saying how to get it."""
    try:
        import onnxruntime_extensions as ortx
    except ImportError as e:
        raise KvExportError("running `--attention plugin` graphs in onnxruntime needs the reference "
                            "custom op from onnxruntime-extensions: pip install onnxruntime-extensions "
                            "(or build TensorRT engines: kvexport build --backend tensorrt)") from e
    return ortx


def pyop_attrs(d, attr_types: dict[str, str], exact: tuple[str, ...]) -> dict:
    """The PyOp attribute declarations (d: ortx.PyCustomOpDef) of `attr_types` (name -> "int" |
    "float" | "str"), plus the string `<name>_exact` of each float attribute in `exact` (add_exact)."""
    types = {**attr_types, **{f"{k}_exact": "str" for k in exact}}
    return {k: {"int": d.dt_int64, "float": d.dt_float, "str": d.dt_string}[t] for k, t in types.items()}


def register(name: str, inputs: list[str], outputs: list[str], attr_types: dict[str, str],
             exact: tuple[str, ...], run: Callable) -> str:
    """Register (once per process) `run` as the PyOp `name` with these element types ("float32",
    "int8", "uint8", "int64" per input / output) and attributes (pyop_attrs); returns `name`."""
    if name in _REGISTERED:
        return name
    ortx = extensions()
    d = ortx.PyCustomOpDef
    dt = {"float32": d.dt_float, "int8": d.dt_int8, "int64": d.dt_int64, "uint8": d.dt_uint8}
    ortx.onnx_op(op_type=name, inputs=[dt[t] for t in inputs], outputs=[dt[t] for t in outputs],
                 attrs=pyop_attrs(d, attr_types, exact))(run)
    _REGISTERED.add(name)
    return name


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


def rewrite_nodes(model: onnx.ModelProto, op_type: str, num_inputs: int | tuple[int, ...],
                  rewrite: Callable[[onnx.NodeProto, Callable[[str], str]], tuple[str, list, list]]
                  ) -> onnx.ModelProto:
    """A copy of `model` whose `kvexport::<op_type>` nodes call PyOps: rewrite(node, dtype) edits
    the node and returns (its PyOp type, nodes before it, nodes after); dtype(tensor name) is its
    element type ("float32", "bfloat16", "int8", ...; "float32" when the graph does not say)."""
    ortx = extensions()
    model = onnx.ModelProto.FromString(model.SerializeToString())
    if not any(n.domain == io.PLUGIN_DOMAIN and n.op_type == op_type for n in model.graph.node):
        return model  # nothing to rewrite: no shape inference (plugin_session tries every registered op)
    codes = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.value_info)}
    codes.update({t.name: t.data_type for t in model.graph.initializer})
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    codes.update({v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info})

    def dtype(tensor: str) -> str:  # "float32" when not known
        t = codes.get(tensor, onnx.TensorProto.FLOAT)
        return "bfloat16" if t == onnx.TensorProto.BFLOAT16 else onnx.helper.tensor_dtype_to_np_dtype(t).name

    nodes = []
    for node in model.graph.node:
        if node.domain != io.PLUGIN_DOMAIN or node.op_type != op_type:
            nodes.append(node)
            continue
        allowed = (num_inputs,) if isinstance(num_inputs, int) else tuple(num_inputs)  # optional inputs: several
        if len(node.input) not in allowed:
            raise KvExportError(f"{node.name}: {op_type} takes {' or '.join(map(str, allowed))} inputs, got "
                                f"{len(node.input)}")
        node.op_type, before, after = rewrite(node, dtype)
        node.domain = ortx.default_opset_domain()
        nodes += before + [node] + after
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if not any(o.domain == ortx.default_opset_domain() for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(ortx.default_opset_domain(), 1))
    return model


def open_session(model: onnx.ModelProto, path: Path, threads: int | None, options):
    """An onnxruntime CPU session for a rewritten plugin graph loaded from `path` (its external
    weights resolved next to it), with the PyOps' library registered."""
    import onnxruntime as ort

    so = options or ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(extensions().get_library_path())
    if threads:
        so.intra_op_num_threads = threads
    # the model is loaded from bytes: external weights resolve against the graph's folder
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def rewrite_all(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose nodes of every registered op call their reference PyOps (each op's
    ort.rewrite_for_reference, in registry order)."""
    from kvexport.plugins import REGISTRY

    for plugin in REGISTRY:
        model = importlib.import_module(f"{plugin.package}.ort").rewrite_for_reference(model)
    return model


def plugin_session(path: str | Path, threads: int | None = None, options=None):
    """An onnxruntime CPU session for a plugin graph, every registered op's nodes run by their
    references (external weights resolved next to the graph). `options`: onnxruntime
    SessionOptions to start from (the runtime's); else defaults."""
    path = Path(path)
    return open_session(rewrite_all(onnx.load(str(path), load_external_data=False)), path, threads, options)
