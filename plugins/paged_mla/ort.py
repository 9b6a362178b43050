"""The reference PagedMLA as an onnxruntime custom op, so MLA `--attention plugin` graphs run on
CPU before (or without) the native op: validation, tests, fallback.

The PyOp plumbing (registration, the rewrite, float16 / bfloat16 through Casts to float32, the
session) is plugins/common/pyop.py's; this module gives PagedMLA's attributes, element types and
node rewrite. `plugin_session()` rewrites every registered op's nodes (PagedAttention's too), so
one call opens any plugin graph.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx

from ..common.pyop import add_exact, cast_wide, plugin_session, pyop_dtype, read_exact, register, rewrite_nodes
from ..paged_attention.ort import rewrite_for_reference as rewrite_paged_attention
from .reference import attention_scores, paged_mla
from .spec import NUM_INPUTS, OP_TYPE, PagedMLAAttrs

__all__ = ["plugin_session", "rewrite_for_reference", "rewrite_paged_attention"]

_ATTR_TYPES = {"num_heads": "int", "kv_lora_rank": "int", "qk_rope_head_dim": "int", "block_size": "int",
               "scale": "float", "kv_dtype": "str", "plugin_namespace": "str", "plugin_version": "str"}
_EXACT = ("scale",)  # passed exactly (common.pyop.add_exact: PyOps see floats to 6 digits)


def _register(act: str, kv: str, n_inputs: int = NUM_INPUTS) -> str:
    """Register (once per process) the reference as a PyOp for these element types; with
    observation_lens (n_inputs 9) it also returns attention_scores (spec.py "Attention scores")."""
    import torch

    scoring = n_inputs == NUM_INPUTS + 1

    def run(*args, **kw):
        attrs_ = PagedMLAAttrs.from_onnx_attributes(read_exact(kw, _EXACT))
        t = [torch.from_numpy(np.array(a)) for a in args]
        cache = t[2].clone()
        out = paged_mla(t[0], t[1], cache, *t[3:8], attrs=attrs_)
        if scoring:
            sc = attention_scores(t[0], cache, t[3], t[4], t[5], t[8], t[7], attrs=attrs_)
            return out.numpy(), cache.numpy(), sc.float().numpy()
        return out.numpy(), cache.numpy()

    name = f"KvexportPagedMLA_{act}_{kv}" + ("_scores" if scoring else "")
    return register(name, [act] * 2 + [kv] + ["int64"] * 4 + ["float32"] + (["int64"] if scoring else []),
                    [act, kv] + (["float32"] if scoring else []), _ATTR_TYPES, _EXACT, run)


def _rewrite_node(node: onnx.NodeProto, dtype: Callable[[str], str]) -> tuple[str, list, list]:
    add_exact(node, _EXACT)
    act, kv = dtype(node.input[0]), dtype(node.input[2])
    before, after = cast_wide(node, {0: act, 1: act, 2: kv}, {0: act, 1: kv})
    return _register(pyop_dtype(act), pyop_dtype(kv), len(node.input)), before, after


def rewrite_for_reference(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose PagedMLA nodes call the registered reference PyOps."""
    return rewrite_nodes(model, OP_TYPE, (NUM_INPUTS, NUM_INPUTS + 1), _rewrite_node)
