"""A small helper for writing ONNX graphs by hand: named nodes, constants, weights kept
as numpy arrays until they are written once as external data shared by several graphs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvexport import io

_ONNX_DTYPES = {
    "float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64,
    "int32": TensorProto.INT32, "int8": TensorProto.INT8, "bool": TensorProto.BOOL,
    "uint8": TensorProto.UINT8,  # int4 KV rows (kvexport/io.py KV_INT4_FORMAT)
}


def onnx_dtype(name: str) -> int:
    return _ONNX_DTYPES[name]


@dataclass
class WeightStore:
    """Named weight arrays shared by the graphs of one build. `write()` puts each array
    once into one external-data file; every graph that uses a weight points at it. Names that
    hold the same array object (`alias`) point at the same bytes."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    locations: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (offset, length)
    # packed arrays (int4 codes, two per byte): name -> (ONNX data type, logical dims)
    packed: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)

    def add(self, name: str, array: np.ndarray, packed_as: tuple[int, tuple[int, ...]] | None = None) -> str:
        if name in self.arrays:
            assert self.arrays[name] is array or np.array_equal(self.arrays[name], array), name
        else:
            self.arrays[name] = np.ascontiguousarray(array)
            if packed_as is not None:
                self.packed[name] = packed_as
        return name

    def alias(self, name: str, of: str) -> str:
        """`name`: a second initializer over `of`'s stored bytes (ONNX external data may share
        them). NOTE: onnxruntime fuses DequantizeLinear -> MatMul into MatMulNBits only when the
        codes initializer feeds nothing else; an alias keeps the file at one copy."""
        self.arrays[name] = self.arrays[of]
        if of in self.packed:
            self.packed[name] = self.packed[of]
        return name

    def write(self, path: str) -> int:
        """Write all arrays to `path`; returns the file size in bytes."""
        offset, written = 0, {}
        with open(path, "wb") as f:
            for name, arr in self.arrays.items():
                if id(arr) in written:  # an alias
                    self.locations[name] = written[id(arr)]
                    continue
                # NOTE: 4 KiB alignment lets onnxruntime mmap large tensors directly.
                pad = (-offset) % 4096
                f.write(b"\0" * pad)
                offset += pad
                data = arr.tobytes()
                f.write(data)
                self.locations[name] = written[id(arr)] = (offset, len(data))
                offset += len(data)
        return offset

    def tensor(self, name: str, data_file: str) -> TensorProto:
        arr = self.arrays[name]
        data_type, dims = self.packed[name] if name in self.packed else (onnx_dtype(str(arr.dtype)), arr.shape)
        t = TensorProto(name=name, data_type=data_type, dims=list(dims))
        offset, length = self.locations[name]
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", data_file), ("offset", str(offset)), ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        return t


class GraphBuilder:
    """Accumulates nodes for one graph. `op()` returns the output name(s) so graphs read
    like the math: `y = b.op("MatMul", x, w)`."""

    def __init__(self, name: str, weights: WeightStore):
        self.name = name
        self.weights = weights
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.constants: list[TensorProto] = []
        self.used_weights: list[str] = []
        self._const_cache: dict[tuple, str] = {}
        self._counter = 0
        self.scope = ""
        self.opset = io.ONNX_OPSET  # raised to io.QDQ_OPSET by graphs with block-wise DequantizeLinear

    def _fresh(self, hint: str) -> str:
        self._counter += 1
        return f"{self.scope}/{hint}_{self._counter}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "",
           name: str | None = None, **attrs) -> str | list[str]:
        node_name = name or self._fresh(op_type)
        outs = [f"{node_name}/out{k}" for k in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=node_name,
                                           domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def rename_output(self, value: str, name: str) -> str:
        """Expose `value` under the contract name `name` (an Identity-free rename)."""
        for node in reversed(self.nodes):
            for k, out in enumerate(node.output):
                if out == value:
                    node.output[k] = name
                    for later in self.nodes:
                        for j, inp in enumerate(later.input):
                            if inp == value:
                                later.input[j] = name
                    return name
        return self.op("Identity", value, name=name + "/identity")

    def const(self, value, dtype: str = "int64") -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._const_cache:
            name = f"const_{len(self._const_cache)}"
            self.constants.append(numpy_helper.from_array(arr, name))
            self._const_cache[key] = name
        return self._const_cache[key]

    def named_const(self, name: str, value: np.ndarray) -> str:
        """A small initializer stored inside the graph under a contract name (e.g. the int8
        KV scales, which `kvexport calibrate` rewrites in place)."""
        self.constants.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        self.weights.add(name, array)
        if name not in self.used_weights:
            self.used_weights.append(name)
        return name

    def input(self, spec: io.TensorSpec) -> str:
        self.inputs.append(helper.make_tensor_value_info(spec.name, onnx_dtype(spec.dtype), list(spec.shape)))
        return spec.name

    def output(self, value: str, spec: io.TensorSpec) -> None:
        self.rename_output(value, spec.name)
        self.outputs.append(helper.make_tensor_value_info(spec.name, onnx_dtype(spec.dtype), list(spec.shape)))

    def to_model(self, data_file: str, doc: str = "") -> onnx.ModelProto:
        initializers = list(self.constants)
        initializers += [self.weights.tensor(n, data_file) for n in self.used_weights]
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializers)
        opsets = [helper.make_opsetid("", self.opset)]
        if any(n.domain == io.PLUGIN_DOMAIN for n in self.nodes):
            opsets.append(helper.make_opsetid(io.PLUGIN_DOMAIN, int(io.PLUGIN_VERSION)))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="kvexport", doc_string=doc)
        model.ir_version = 9  # onnxruntime >= 1.17 and TensorRT 10 read IR 9
        return model


def save_model(model: onnx.ModelProto, path: str) -> None:
    """Write a graph whose weights already point at an external file next to it."""
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    onnx.checker.check_model(path)  # with a path the checker also resolves external data
