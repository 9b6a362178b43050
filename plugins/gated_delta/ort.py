"""The reference GatedDeltaRule as an onnxruntime custom op, so hybrid `--attention plugin` graphs
run on CPU before (or without) the native op: validation's cross-check, tests, fallback.

The PyOp plumbing (registration, the rewrite, float16 / bfloat16 through Casts to float32, the
session) is plugins/common/pyop.py's; this module gives GatedDeltaRule's attributes, element types
and node rewrite. `plugin_session()` rewrites every registered op's nodes (PagedAttention's too).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx

from ..common.pyop import add_exact, cast_wide, plugin_session, pyop_dtype, read_exact, register, rewrite_nodes
from .reference import gated_delta
from .spec import NUM_INPUTS, OP_TYPE, GatedDeltaAttrs

__all__ = ["plugin_session", "rewrite_for_reference"]

_ATTR_TYPES = {"num_k_heads": "int", "num_v_heads": "int", "k_head_dim": "int", "v_head_dim": "int",
               "scale": "float", "use_qk_l2norm": "int", "plugin_namespace": "str", "plugin_version": "str"}
_EXACT = ("scale",)  # passed exactly (common.pyop.add_exact: PyOps see floats to 6 digits)


def _register(act: str) -> str:
    """Register (once per process) the reference as a PyOp for this activation type."""
    import torch

    def run(*args, **kw):
        attrs_ = GatedDeltaAttrs.from_onnx_attributes(read_exact(kw, _EXACT))
        t = [torch.from_numpy(np.array(a)) for a in args]
        out, new = gated_delta(*t, attrs=attrs_)
        return out.numpy(), new.numpy()

    return register(f"KvexportGatedDeltaRule_{act}", [act] * 3 + ["float32"] * 3 + ["int64"] * 3,
                    [act, "float32"], _ATTR_TYPES, _EXACT, run)


def _rewrite_node(node: onnx.NodeProto, dtype: Callable[[str], str]) -> tuple[str, list, list]:
    add_exact(node, _EXACT)
    act = dtype(node.input[0])
    before, after = cast_wide(node, {0: act, 1: act, 2: act}, {0: act})
    return _register(pyop_dtype(act)), before, after


def rewrite_for_reference(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose GatedDeltaRule nodes call the registered reference PyOp."""
    return rewrite_nodes(model, OP_TYPE, NUM_INPUTS, _rewrite_node)
