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
from typing import Callable

import numpy as np
import onnx

from ..paged_attention.ort import (
    _extensions,
    add_exact,
    cast_wide,
    open_session,
    pyop_attrs,
    pyop_dtype,
    read_exact,
    rewrite_nodes,
)
from ..paged_attention.ort import rewrite_for_reference as rewrite_paged_attention
from .reference import paged_mla
from .spec import NUM_INPUTS, OP_TYPE, PagedMLAAttrs

_REGISTERED: set[str] = set()
_ATTR_TYPES = {"num_heads": "int", "kv_lora_rank": "int", "qk_rope_head_dim": "int", "block_size": "int",
               "scale": "float", "kv_dtype": "str", "plugin_namespace": "str", "plugin_version": "str"}
_EXACT = ("scale",)  # passed exactly (paged_attention.ort add_exact: PyOps see floats to 6 digits)


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

    def run(*args, **kw):
        attrs_ = PagedMLAAttrs.from_onnx_attributes(read_exact(kw, _EXACT))
        t = [torch.from_numpy(np.array(a)) for a in args]
        cache = t[2].clone()
        out = paged_mla(t[0], t[1], cache, *t[3:8], attrs=attrs_)
        return out.numpy(), cache.numpy()

    ortx.onnx_op(op_type=name, inputs=types, outputs=[dt[act], dt[kv]], attrs=pyop_attrs(d, _ATTR_TYPES, _EXACT))(run)
    _REGISTERED.add(name)
    return name


def _rewrite_node(node: onnx.NodeProto, dtype: Callable[[str], str]) -> tuple[str, list, list]:
    add_exact(node, _EXACT)
    act, kv = dtype(node.input[0]), dtype(node.input[2])
    before, after = cast_wide(node, {0: act, 1: act, 2: kv}, {0: act, 1: kv})
    return _register(pyop_dtype(act), pyop_dtype(kv)), before, after


def rewrite_for_reference(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose PagedMLA nodes call the registered reference PyOps."""
    return rewrite_nodes(model, OP_TYPE, NUM_INPUTS, _rewrite_node)


def plugin_session(path: str | Path, threads: int | None = None, options=None):
    """An onnxruntime CPU session for a plugin graph with PagedMLA and/or PagedAttention nodes,
    all run by their references (external weights resolved next to the graph). `options`:
    onnxruntime SessionOptions to start from (the runtime's); else defaults."""
    path = Path(path)
    model = rewrite_for_reference(rewrite_paged_attention(onnx.load(str(path), load_external_data=False)))
    return open_session(model, path, threads, options)
