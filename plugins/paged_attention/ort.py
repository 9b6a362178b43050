"""The reference PagedAttention as an onnxruntime custom op, so `--attention plugin` graphs
run on CPU: this is how CI proves a plugin graph means the same as the `onnx` attention
graph and as transformers (the TensorRT plugin itself is checked against the same reference).

The PyOp plumbing (registration, the rewrite, casts, the session) is plugins/common/pyop.py's;
this module gives PagedAttention's attributes, element types and node rewrite.
`plugin_session()` opens a plugin graph with every registered op's nodes rewritten.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx

from kvexport import io

from ..common.pyop import add_exact, cast_wide, plugin_session, pyop_dtype, read_exact, register, rewrite_nodes
from .reference import attention_scores, paged_attention
from .spec import NUM_INPUTS, PagedAttentionAttrs

__all__ = ["plugin_session", "rewrite_for_reference"]

_ATTR_TYPES = {"num_heads": "int", "num_kv_heads": "int", "head_dim": "int", "block_size": "int",
               "scale": "float", "sliding_window": "int", "kv_dtype": "str", "logit_softcap": "float",
               "plugin_namespace": "str", "plugin_version": "str",
               "attention_sinks": "str"}  # NOTE: PyOps take no float lists: rewrite_for_reference writes them as text
_EXACT = ("scale", "logit_softcap")  # float attributes passed exactly (common.pyop.add_exact)


def _register(act: str, kv: str, n_inputs: int) -> str:
    """Register (once per process) the reference as a PyOp for these element types (uint8: int4 KV rows)."""
    import torch

    scoring = n_inputs == NUM_INPUTS + 1  # + observation_lens -> + attention_scores (spec.py)

    def run(*args, **kw):
        attrs_ = PagedAttentionAttrs.from_onnx_attributes(read_exact(kw, _EXACT))
        t = [torch.from_numpy(np.array(a)) for a in args]
        kc, vc = t[3].clone(), t[4].clone()
        out = paged_attention(*t[:3], kc, vc, *t[5:11], attrs=attrs_)
        if scoring:
            sc = attention_scores(t[0], kc, t[5], t[6], t[7], t[11], t[9], attrs=attrs_)
            return out.numpy(), kc.numpy(), vc.numpy(), sc.float().numpy()
        return out.numpy(), kc.numpy(), vc.numpy()

    ins = [act] * 3 + [kv] * 2 + ["int64"] * 4 + ["float32"] * 2 + (["int64"] if scoring else [])
    return register(f"KvexportPagedAttention_{act}_{kv}_{n_inputs}", ins,
                    [act, kv, kv] + (["float32"] if scoring else []), _ATTR_TYPES, _EXACT, run)


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
    return rewrite_nodes(model, io.PLUGIN_OP, (NUM_INPUTS, NUM_INPUTS + 1), _rewrite_node)
