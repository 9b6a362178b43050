"""What a family's weights reader returns (exporter/families.py Family.weights) and the graph builder
reads (exporter/graph.py): one decoder layer's weights, the model's. Their own module so the families'
helper modules (exporter/short_conv.py, ...) can build them without importing the registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .moe import ExpertWeights


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer, matmul weights stored [in, out]. Norm weights already include the
    spec's norm_offset (Gemma's 1 + w)."""

    ln1_w: np.ndarray | None  # [hidden] norm before attention (None: the layer has none, olmo2)
    ln1_b: np.ndarray | None  # [hidden] (layernorm only)
    qkv_w: np.ndarray  # [hidden, (heads + 2 * kv_heads) * head_dim], q | k | v
    qkv_b: np.ndarray | None  # [(heads + 2 * kv_heads) * head_dim]
    o_w: np.ndarray  # [heads * head_dim, hidden]
    o_b: np.ndarray | None  # [hidden]
    ln2_w: np.ndarray | None  # [hidden] norm before the MLP (None: the layer has none)
    ln2_b: np.ndarray | None
    # gated: [hidden, 2 * inter] (gate | up); else [hidden, inter]. MoE layers: the shared expert(s), or
    # None (with up_b, down_w, down_b) when the layer has none
    up_w: np.ndarray | None
    up_b: np.ndarray | None
    down_w: np.ndarray | None  # [inter, hidden]
    down_b: np.ndarray | None
    post_attn_w: np.ndarray | None = None  # [hidden] norm of the attention output (post / sandwich norms)
    post_mlp_w: np.ndarray | None = None  # [hidden] norm of the MLP output
    q_norm_w: np.ndarray | None = None  # [head_dim] (qk_norm "head") or [heads * head_dim] ("all")
    k_norm_w: np.ndarray | None = None  # [head_dim] or [kv_heads * head_dim]
    mla: Any = None  # MLA layers (exporter/mla.py MLAWeights); qkv_w / qkv_b are then None
    moe: ExpertWeights | None = None  # a sparse layer's routed experts (exporter/moe.py), stacked
    attn_sinks: np.ndarray | None = None  # [heads] float32 learned sink logits (GPT-OSS self_attn.sinks)
    extra: Any = None  # a family's own layer weights (exporter/gemma4.py LayerExtras); None: none
    # gated DeltaNet hybrids (exporter/linear_attention.py): a linear layer's weights (qkv_w / o_w are
    # then None); an attention layer's output gate [hidden, heads * head_dim] (Qwen3.5's q_proj second half)
    linear: Any = None
    attn_gate_w: np.ndarray | None = None


@dataclass(slots=True)
class ModelWeights:
    embed: np.ndarray  # [vocab, hidden]
    pos_embed: np.ndarray | None  # [max_positions, hidden] (learned positions only)
    layers: list[LayerWeights]
    final_norm_w: np.ndarray  # [hidden]
    final_norm_b: np.ndarray | None
    lm_head: np.ndarray  # [vocab, hidden]; the same array as `embed` when tied
    extra: Any = None  # a family's own model weights (exporter/gemma4.py ModelExtras); None: none
