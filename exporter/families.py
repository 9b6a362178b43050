"""The registry of supported architectures. Each family is one declarative entry: which
transformers `model_type`s and GGUF architectures it covers, how to read the spec's fields,
which options it refuses, and which weight layout its checkpoints use. Adding a family is
adding an entry; nothing else branches on model types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvexport.errors import ConfigError, UnsupportedModelError

from . import gemma4, linear_attention, mla, short_conv
from .model_weights import LayerWeights, ModelWeights
from .moe import MoEFields, mlp_weights, read_moe
from .spec import MLASpec, ModelSpec, RopeSpec


@dataclass(frozen=True, slots=True)
class LayerNorms:
    """Checkpoint names (under model.layers.{i}.) of a layer's norms; None: no norm there.
    NOTE: the same name means different places in different families: llama's
    post_attention_layernorm is the norm before the MLP, gemma2's and olmo2's normalizes the
    attention output."""

    pre_attn: str | None = "input_layernorm"
    post_attn: str | None = None
    pre_mlp: str | None = "post_attention_layernorm"
    post_mlp: str | None = None

    @property
    def layout(self) -> str:  # spec.LAYER_NORMS
        pre, post = self.pre_attn is not None, self.post_attn is not None
        return "sandwich" if pre and post else ("post" if post else "pre")


PRE_NORMS = LayerNorms()
SANDWICH_NORMS = LayerNorms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                            "post_feedforward_layernorm")
POST_NORMS = LayerNorms(None, "post_attention_layernorm", None, "post_feedforward_layernorm")


Flag = bool | str  # a constant, or the name of a boolean config attribute


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    norm: str  # "rmsnorm" | "layernorm"
    position: str  # "rope" | "learned" (spec "none": rope_theta_optional)
    gated_mlp: bool
    qkv_bias: Flag
    o_bias: Flag
    mlp_bias: Flag
    weights: Callable[[dict[str, Any], ModelSpec], ModelWeights]
    sliding_window_field: str | None = None  # config attribute holding the window
    # config attribute -> values we implement; anything else is refused by name
    required: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    recipe: str = ""  # recipe file shipped for this family
    # ---- 2025 families: each a reusable feature, read from the config by read_spec
    activation_field: str = "hidden_act"  # config attribute naming the MLP activation
    norms: LayerNorms = PRE_NORMS  # where the layer's norms sit, by checkpoint name
    qk_norm: str | None = None  # spec.QK_NORMS: RMSNorm of q and k (self_attn.q_norm / k_norm)
    norm_offset: float = 0.0  # norms scale by (offset + w) (Gemma: 1)
    embed_scale: bool = False  # embeddings scaled by sqrt(hidden) (Gemma)
    windowed_layer_types: bool = False  # the window applies only to layers whose config.layer_types
    # entry is "sliding_attention" (and only if config.use_sliding_window is not False)
    local_rope: bool = False  # "sliding_attention" layers use rope_parameters["sliding_attention"] (gemma3)
    nope_field: str | None = None  # config list, per layer 1 = RoPE, 0 = no RoPE (smollm3's no_rope_layers)
    # RoPE types implemented for it (spec.ROPE_TYPES); longrope only where it is validated
    rope_types: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
    # multi-head latent attention (DeepSeek, exporter/mla.py): the config's MLA fields are read into
    # spec.mla; the value is whether the checkpoint pairs RoPE channels (a Flag: V3's rope_interleave)
    mla: Flag | None = None
    moe: MoEFields | None = None  # mixture of experts: the config fields of its routing (exporter/moe.py)
    attention_sinks: bool = False  # learned per-head sink logits: the checkpoint's self_attn.sinks (gpt_oss)
    # config -> spec fields a family reads beyond the ones above (they win over them; gemma4.read_fields)
    extra_fields: Callable[[Any], dict[str, Any]] | None = None
    # config -> the config read_spec reads (a heterogeneous config's global view: gemma4.global_view)
    config_view: Callable[[Any], Any] | None = None
    # rope_parameters without a rope_theta (or none at all) means no RoPE on any layer (spec position
    # "none"), as transformers then builds no rotary embedding (OLMo-Hybrid's released checkpoints)
    rope_theta_optional: bool = False


def _np(t) -> np.ndarray:
    return t.detach().to("cpu").float().numpy()


def _opt(sd: dict, key: str) -> np.ndarray | None:
    return _np(sd[key]) if key in sd else None


def _final(sd: dict, spec: ModelSpec, embed: np.ndarray, norm: str, head: str,
           pos_embed: np.ndarray | None, layers: list[LayerWeights]) -> ModelWeights:
    lm_head = embed if spec.tie_embeddings or head not in sd else _np(sd[head])
    return ModelWeights(embed, pos_embed, layers, _np(sd[f"{norm}.weight"]),
                        _opt(sd, f"{norm}.bias"), lm_head)


def _norm_w(sd: dict, key: str | None, spec: ModelSpec) -> np.ndarray | None:
    """A norm weight with the spec's offset folded in (float32, as transformers adds it)."""
    if key is None or key not in sd:
        return None
    w = sd[key].detach().to("cpu").float()
    return (w + spec.norm_offset).numpy() if spec.norm_offset else w.numpy()


def split_linear_weights(sd: dict, spec: ModelSpec) -> ModelWeights:
    """Llama-style checkpoints: q/k/v/o and gate/up/down are separate nn.Linear [out, in];
    the norms where the family's LayerNorms says, q/k norms as self_attn.q_norm / k_norm."""
    norms = FAMILIES[spec.family].norms
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        n = lambda name: _norm_w(sd, p + name + ".weight" if name else None, spec)  # noqa: E731
        qkv_w = np.concatenate([_np(sd[a + f"{x}_proj.weight"]) for x in "qkv"], axis=0).T
        qkv_b = (np.concatenate([_np(sd[a + f"{x}_proj.bias"]) for x in "qkv"])
                 if spec.qkv_bias else None)
        up_w, up_b, down_w, down_b, experts = mlp_weights(sd, i, spec, FAMILIES[spec.family].moe)
        layers.append(LayerWeights(
            n(norms.pre_attn), None, np.ascontiguousarray(qkv_w), qkv_b,
            np.ascontiguousarray(_np(sd[a + "o_proj.weight"]).T), _opt(sd, a + "o_proj.bias"),
            n(norms.pre_mlp), None, up_w, up_b, down_w, down_b,
            n(norms.post_attn), n(norms.post_mlp),
            n("self_attn.q_norm" if spec.qk_norm else None), n("self_attn.k_norm" if spec.qk_norm else None),
            moe=experts, attn_sinks=_np(sd[a + "sinks"]) if spec.attn_sinks else None))
    weights = _final(sd, spec, _np(sd["model.embed_tokens.weight"]), "model.norm", "lm_head.weight",
                     None, layers)
    weights.final_norm_w = _norm_w(sd, "model.norm.weight", spec)
    return weights


def fused_linear_weights(sd: dict, spec: ModelSpec) -> ModelWeights:
    """Phi-3-style checkpoints: one qkv_proj and one gate_up_proj (gate first)."""
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(LayerWeights(
            _np(sd[p + "input_layernorm.weight"]), None,
            np.ascontiguousarray(_np(sd[a + "qkv_proj.weight"]).T), _opt(sd, a + "qkv_proj.bias"),
            np.ascontiguousarray(_np(sd[a + "o_proj.weight"]).T), _opt(sd, a + "o_proj.bias"),
            _np(sd[p + "post_attention_layernorm.weight"]), None,
            np.ascontiguousarray(_np(sd[m + "gate_up_proj.weight"]).T), None,
            np.ascontiguousarray(_np(sd[m + "down_proj.weight"]).T), None))
    return _final(sd, spec, _np(sd["model.embed_tokens.weight"]), "model.norm", "lm_head.weight",
                  None, layers)


def conv1d_weights(sd: dict, spec: ModelSpec) -> ModelWeights:
    """GPT-2 checkpoints: Conv1D layers already store weights [in, out]; fused c_attn."""
    layers = []
    for i in range(spec.num_layers):
        p = f"transformer.h.{i}."
        layers.append(LayerWeights(
            _np(sd[p + "ln_1.weight"]), _np(sd[p + "ln_1.bias"]),
            _np(sd[p + "attn.c_attn.weight"]), _np(sd[p + "attn.c_attn.bias"]),
            _np(sd[p + "attn.c_proj.weight"]), _np(sd[p + "attn.c_proj.bias"]),
            _np(sd[p + "ln_2.weight"]), _np(sd[p + "ln_2.bias"]),
            _np(sd[p + "mlp.c_fc.weight"]), _np(sd[p + "mlp.c_fc.bias"]),
            _np(sd[p + "mlp.c_proj.weight"]), _np(sd[p + "mlp.c_proj.bias"])))
    return _final(sd, spec, _np(sd["transformer.wte.weight"]), "transformer.ln_f", "lm_head.weight",
                  _np(sd["transformer.wpe.weight"]), layers)


def deepseek_weights(sd: dict, spec: ModelSpec) -> ModelWeights:
    """DeepSeek-V2/V3 checkpoints: MLA attention (exporter/mla.py read_weights), llama-style
    norms, dense MLPs on the first first_k_dense_replace layers and routed + shared experts
    after (exporter/moe.py mlp_weights)."""
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        up_w, up_b, down_w, down_b, experts = mlp_weights(sd, i, spec, FAMILIES[spec.family].moe)
        layers.append(LayerWeights(
            _np(sd[p + "input_layernorm.weight"]), None, None, None,
            np.ascontiguousarray(_np(sd[p + "self_attn.o_proj.weight"]).T), _opt(sd, p + "self_attn.o_proj.bias"),
            _np(sd[p + "post_attention_layernorm.weight"]), None, up_w, up_b, down_w, down_b,
            mla=mla.read_weights(sd, p + "self_attn.", spec, _np), moe=experts))
    return _final(sd, spec, _np(sd["model.embed_tokens.weight"]), "model.norm", "lm_head.weight", None, layers)


def hybrid_weights(sd: dict, spec: ModelSpec) -> ModelWeights:
    """Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next, OLMo-Hybrid): linear layers' weights
    (exporter/linear_attention.py read_weights, any of its CHECKPOINT_LAYOUTS) with their norms before
    the mixer and the MLP (PRE_NORMS); attention layers' norms where the family's LayerNorms says
    (OLMo-Hybrid: after, as olmo2's), their q_proj [heads x (query | gate) per head] split into the query
    (qkv_w) and the output gate (attn_gate_w) where spec.attn_output_gate (Qwen); the family's norm
    offset ((1 + w) for Qwen), dense or routed MLPs (exporter/moe.py mlp_weights).
    NOTE: the same checkpoint name, post_attention_layernorm, is the linear layers' norm before the MLP
    and OLMo-Hybrid's attention layers' norm of the attention output (LayerNorms' NOTE)."""
    la = spec.linear_attn
    fam = FAMILIES[spec.family]
    h, d = spec.num_heads, spec.head_dim
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        n = lambda name: _norm_w(sd, p + name + ".weight" if name else None, spec)  # noqa: E731
        linear = la is not None and i in la.layers
        norms = PRE_NORMS if linear else fam.norms
        up_w, up_b, down_w, down_b, experts = mlp_weights(sd, i, spec, fam.moe)
        lw = LayerWeights(n(norms.pre_attn), None, None, None, None, None, n(norms.pre_mlp), None,
                          up_w, up_b, down_w, down_b, n(norms.post_attn), n(norms.post_mlp), moe=experts)
        if linear:
            lw.linear = linear_attention.read_weights(sd, p + "linear_attn.", la, _np)
            layers.append(lw)
            continue
        q_w, q_b = _np(sd[a + "q_proj.weight"]), _opt(sd, a + "q_proj.bias")
        if spec.attn_output_gate:
            qg = q_w.reshape(h, 2, d, -1)  # [H, query | gate, D, hidden]
            q_w, gate = qg[:, 0].reshape(h * d, -1), qg[:, 1].reshape(h * d, -1)
            q_b = q_b.reshape(h, 2, d)[:, 0].reshape(-1) if q_b is not None else None
            lw.attn_gate_w = np.ascontiguousarray(gate.T)
        lw.qkv_w = np.ascontiguousarray(np.concatenate([q_w, _np(sd[a + "k_proj.weight"]),
                                                        _np(sd[a + "v_proj.weight"])]).T)
        lw.qkv_b = (np.concatenate([q_b] + [_np(sd[a + f"{x}_proj.bias"]) for x in "kv"]) if spec.qkv_bias else None)
        lw.o_w = np.ascontiguousarray(_np(sd[a + "o_proj.weight"]).T)
        lw.o_b = _opt(sd, a + "o_proj.bias")
        lw.q_norm_w, lw.k_norm_w = n("self_attn.q_norm"), n("self_attn.k_norm")
        layers.append(lw)
    weights = _final(sd, spec, _np(sd["model.embed_tokens.weight"]), "model.norm", "lm_head.weight", None, layers)
    weights.final_norm_w = _norm_w(sd, "model.norm.weight", spec)
    return weights


FAMILIES: dict[str, Family] = {}


def gemma4_weights(sd: dict, spec: ModelSpec) -> ModelWeights:
    """gemma4_text checkpoints: llama-style q/k/v/o (no k/v on layers that share KV, k_proj as the
    values where attention_k_eq_v drops v_proj), sandwich norms with plain weights, the PLE tables
    and per-layer scalars (LayerExtras / ModelExtras)."""
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        n = lambda name: _np(sd[p + name + ".weight"]) if p + name + ".weight" in sd else None  # noqa: E731
        parts = ["q"] if spec.kv_source(i) != i else ["q", "k", "v" if a + "v_proj.weight" in sd else "k"]
        qkv_w = np.concatenate([_np(sd[a + f"{x}_proj.weight"]) for x in parts], axis=0).T
        qkv_b = np.concatenate([_np(sd[a + f"{x}_proj.bias"]) for x in parts]) if spec.qkv_bias else None
        up_w, up_b, down_w, down_b, _ = mlp_weights(sd, i, spec, None)
        extras = gemma4.LayerExtras(
            float(_np(sd[p + "layer_scalar"]).reshape(-1)[0]) if p + "layer_scalar" in sd else 1.0,
            *((np.ascontiguousarray(_np(sd[p + "per_layer_input_gate.weight"]).T),
               np.ascontiguousarray(_np(sd[p + "per_layer_projection.weight"]).T),
               _np(sd[p + "post_per_layer_input_norm.weight"])) if spec.per_layer_input else (None, None, None)))
        layers.append(LayerWeights(
            n("input_layernorm"), None, np.ascontiguousarray(qkv_w), qkv_b,
            np.ascontiguousarray(_np(sd[a + "o_proj.weight"]).T), _np(sd[a + "o_proj.bias"]) if spec.o_bias else None,
            n("pre_feedforward_layernorm"), None, up_w, up_b, down_w, down_b,
            n("post_attention_layernorm"), n("post_feedforward_layernorm"),
            n("self_attn.q_norm"), n("self_attn.k_norm") if spec.kv_source(i) == i else None, extra=extras))
    embed = _np(sd["model.embed_tokens.weight"])
    head = embed if spec.tie_embeddings or "lm_head.weight" not in sd else _np(sd["lm_head.weight"])
    w = ModelWeights(embed, None, layers, _np(sd["model.norm.weight"]), None, head)
    if spec.per_layer_input:
        w.extra = gemma4.ModelExtras(_np(sd["model.embed_tokens_per_layer.weight"]),
                              np.ascontiguousarray(_np(sd["model.per_layer_model_projection.weight"]).T),
                              _np(sd["model.per_layer_projection_norm.weight"]))
    return w


def register(family: Family) -> Family:
    assert family.name not in FAMILIES, family.name
    FAMILIES[family.name] = family
    return family


register(Family(
    name="llama", model_types=("llama",), gguf_archs=("llama",), norm="rmsnorm",
    position="rope", gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias",
    mlp_bias="mlp_bias", weights=split_linear_weights, recipe="llama.yaml"))
register(Family(
    name="mistral", model_types=("mistral",), gguf_archs=("mistral",), norm="rmsnorm",
    position="rope", gated_mlp=True, qkv_bias=False, o_bias=False, mlp_bias=False,
    weights=split_linear_weights, sliding_window_field="sliding_window", recipe="mistral.yaml"))
register(Family(
    name="qwen2", model_types=("qwen2",), gguf_archs=("qwen2",), norm="rmsnorm",
    position="rope", gated_mlp=True, qkv_bias=True, o_bias=False, mlp_bias=False,
    weights=split_linear_weights, required={"use_sliding_window": (False, None)},
    recipe="qwen2.yaml"))
register(Family(
    name="phi3", model_types=("phi3",), gguf_archs=("phi3",), norm="rmsnorm",
    position="rope", gated_mlp=True, qkv_bias=False, o_bias=False, mlp_bias=False,
    weights=fused_linear_weights, sliding_window_field="sliding_window", recipe="phi3.yaml",
    rope_types=("default", "linear", "llama3", "yarn", "longrope")))
register(Family(
    name="gpt2", model_types=("gpt2",), gguf_archs=("gpt2",), norm="layernorm",
    position="learned", gated_mlp=False, qkv_bias=True, o_bias=True, mlp_bias=True,
    weights=conv1d_weights, recipe="gpt2.yaml",
    required={"scale_attn_by_inverse_layer_idx": (False,), "scale_attn_weights": (True,),
              "add_cross_attention": (False,)}))


register(Family(
    name="qwen3", model_types=("qwen3",), gguf_archs=("qwen3",), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    weights=split_linear_weights, sliding_window_field="sliding_window", windowed_layer_types=True,
    qk_norm="head", recipe="qwen3.yaml"))
register(Family(
    name="olmo2", model_types=("olmo2",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    weights=split_linear_weights, norms=POST_NORMS, qk_norm="all", recipe="olmo2.yaml"))
register(Family(
    name="gemma2", model_types=("gemma2",), gguf_archs=("gemma2",), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    weights=split_linear_weights, sliding_window_field="sliding_window", windowed_layer_types=True,
    activation_field="hidden_activation", norms=SANDWICH_NORMS, norm_offset=1.0, embed_scale=True,
    recipe="gemma2.yaml"))
register(Family(
    name="gemma3_text", model_types=("gemma3_text",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    weights=split_linear_weights, sliding_window_field="sliding_window", windowed_layer_types=True,
    activation_field="hidden_activation", norms=SANDWICH_NORMS, norm_offset=1.0, embed_scale=True,
    qk_norm="head", local_rope=True, required={"use_bidirectional_attention": (False, None)},
    recipe="gemma3_text.yaml"))
# Gemma 4 (exporter/gemma4.py): Gemma 3's layers with plain-weight norms, KV shared by the last
# num_kv_shared_layers layers, per-layer input embeddings, global layers with their own head_dim / KV
# heads and "proportional" RoPE, attention scale 1, values RMS-normed; no GGUF (transformers reads none)
register(Family(
    name="gemma4_text", model_types=("gemma4_text",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    weights=gemma4_weights, sliding_window_field="sliding_window", windowed_layer_types=True,
    activation_field="hidden_activation", norms=SANDWICH_NORMS, embed_scale=True, qk_norm="head", local_rope=True,
    rope_types=("default", "linear", "proportional"), required={"use_bidirectional_attention": (None,)},
    extra_fields=gemma4.read_fields, config_view=gemma4.global_view, recipe="gemma4_text.yaml"))
register(Family(
    name="smollm3", model_types=("smollm3",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
    weights=split_linear_weights, sliding_window_field="sliding_window", windowed_layer_types=True,
    nope_field="no_rope_layers", recipe="smollm3.yaml"))

# DeepSeek: multi-head latent attention (exporter/mla.py); RoPE in interleaved pairs (V2 always, V3
# unless rope_interleave is false); dense MLPs on layers < first_k_dense_replace, then routed experts
# plus n_shared_experts: V3 sigmoid scores + e_score_correction_bias, top-2-sum group selection, V2
# softmax with topk_method greedy | group_limited_greedy (exporter/moe.py)
register(Family(
    name="deepseek_v3", model_types=("deepseek_v3",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    weights=deepseek_weights, mla="rope_interleave", rope_types=("default", "linear", "yarn"),
    moe=MoEFields(experts="n_routed_experts", scoring="sigmoid", norm_topk_prob="norm_topk_prob",
                  norm_topk_eps=1e-20, layers="deepseek", scaling="routed_scaling_factor", groups="top2",
                  score_correction_bias=True, shared_experts="n_shared_experts"),
    recipe="deepseek_v3.yaml"))
register(Family(
    name="deepseek_v2", model_types=("deepseek_v2",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
    weights=deepseek_weights, mla=True, rope_types=("default", "linear", "yarn"),
    # NOTE: transformers' DeepseekV2 router never normalizes the top-k weights (the original remote
    # code does when norm_topk_prob is set): refused rather than guessed
    required={"norm_topk_prob": (False, None)},
    moe=MoEFields(experts="n_routed_experts", scoring="softmax", norm_topk_prob=False, layers="deepseek",
                  scaling="routed_scaling_factor", groups="topk_method", shared_experts="n_shared_experts"),
    recipe="deepseek_v2.yaml"))

# ---- mixtures of experts (exporter/moe.py): the attention of their dense relatives, MoE MLPs
# GGUF: qwen2moe / qwen3moe (stacked ffn_{gate,up,down}_exps, qwen2moe's *_shexp shared expert), read by
# transformers' GGUF loader with the expert widths it does not map filled in (source.py GGUF_CONFIG_FILL).
# Not readable by transformers 5's loader, so none: mixtral (llama.cpp writes it as "llama" + expert_count:
# refused by source.check_gguf), gpt-oss (no tensor mapping for its fused experts), deepseek2 (no config mapping)
register(Family(
    name="qwen3_moe", model_types=("qwen3_moe",), gguf_archs=("qwen3moe",), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    weights=split_linear_weights, sliding_window_field="sliding_window", qk_norm="head",
    moe=MoEFields(experts="num_experts", norm_topk_prob="norm_topk_prob", layers="qwen"), recipe="qwen3_moe.yaml"))
register(Family(
    name="mixtral", model_types=("mixtral",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias=False, o_bias=False, mlp_bias=False,
    weights=split_linear_weights, sliding_window_field="sliding_window",
    moe=MoEFields(experts="num_local_experts", intermediate="intermediate_size", norm_topk_prob=True),
    recipe="mixtral.yaml"))
register(Family(
    name="qwen2_moe", model_types=("qwen2_moe",), gguf_archs=("qwen2moe",), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="qkv_bias", o_bias=False, mlp_bias=False,
    weights=split_linear_weights, sliding_window_field="sliding_window", windowed_layer_types=True,
    moe=MoEFields(experts="num_experts", norm_topk_prob="norm_topk_prob", layers="qwen",
                  shared_size="shared_expert_intermediate_size", shared_gate=True, shared="shared_expert"),
    recipe="qwen2_moe.yaml"))
# GPT-OSS: learned attention sinks on every layer, sliding_window on the layers config.layer_types
# marks sliding_attention (alternating, two KV cache groups as Gemma 2), yarn RoPE (transformers' own
# tables), q/k/v/o biases; every MLP routed: router with bias, top-k then softmax over the k, interleaved
# gate_up with the clamped SwiGLU (swiglu_limit, swiglu_alpha) and expert biases (exporter/moe.py)
register(Family(
    name="gpt_oss", model_types=("gpt_oss",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    weights=split_linear_weights, sliding_window_field="sliding_window", windowed_layer_types=True,
    rope_types=("default", "yarn"), attention_sinks=True,
    moe=MoEFields(experts="num_local_experts", intermediate="intermediate_size", scoring="topk_softmax",
                  router_bias=True, expert_bias=True, expert_activation="gpt_oss", router="router",
                  expert_layout="gate_up_interleaved"),
    recipe="gpt_oss.yaml"))

# ---- gated DeltaNet + gated attention hybrids (exporter/linear_attention.py): per config.layer_types,
# linear_attention layers (short conv, gated delta rule, gated RMSNorm; recurrent state as graph I/O)
# and full_attention layers (q/k norms, partial RoPE, the output gated by sigmoid of q_proj's second
# half); (1 + w) norms. qwen3_5_text: dense MLPs; qwen3_next: Qwen2-MoE-style experts (shared expert
# with a sigmoid gate) and grouped in_proj_qkvz / in_proj_ba. Paged layout only; no GGUF here.
# NOTE: partial rotary: Qwen3.5's interleaved multimodal RoPE (mrope_section) equals plain RoPE for
# text, whose three position rows are the same
register(Family(
    name="qwen3_5_text", model_types=("qwen3_5_text",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    weights=hybrid_weights, qk_norm="head", norm_offset=1.0, extra_fields=linear_attention.QWEN.read_fields,
    rope_types=("default",), recipe="qwen3_5_text.yaml"))
register(Family(
    name="qwen3_next", model_types=("qwen3_next",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    weights=hybrid_weights, qk_norm="head", norm_offset=1.0, extra_fields=linear_attention.QWEN.read_fields,
    rope_types=("default",),
    moe=MoEFields(experts="num_experts", norm_topk_prob="norm_topk_prob", layers="qwen",
                  shared_size="shared_expert_intermediate_size", shared_gate=True, shared="shared_expert"),
    recipe="qwen3_next.yaml"))

# qwen3_5_moe (its text part, model_type qwen3_5_moe_text): Qwen3.5's hybrid layers, experts on every layer
# (exporter/moe.py: softmax router, top-k always renormalized, stacked gate_up_proj / down_proj, a shared
# expert with a sigmoid gate), as qwen3_next's experts read
register(Family(
    name="qwen3_5_moe", model_types=("qwen3_5_moe_text",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    weights=hybrid_weights, qk_norm="head", norm_offset=1.0, extra_fields=linear_attention.QWEN.read_fields,
    rope_types=("default",),
    moe=MoEFields(experts="num_experts", norm_topk_prob=True, shared_size="shared_expert_intermediate_size",
                  shared_gate=True, shared="shared_expert"),
    recipe="qwen3_5_moe.yaml"))

# OLMo-Hybrid (olmo_hybrid): gated DeltaNet layers as Qwen3.5's, but with separate q/k/v/g(ate)/b/a projections,
# beta × 2 (linear_allow_neg_eigval: eigenvalues in [-1, 1]), the gated norm's eps fixed at 1e-5 and plain-weight
# norms before the mixer and the MLP; beside them OLMo-2 attention layers (norms after attention and MLP, none
# before; q/k RMSNorm over all heads; no output gate); RoPE on the attention layers, or none at all where
# rope_parameters has no rope_theta (the released checkpoints)
register(Family(
    name="olmo_hybrid", model_types=("olmo_hybrid",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    weights=hybrid_weights, norms=POST_NORMS, qk_norm="all", extra_fields=linear_attention.OLMO_HYBRID.read_fields,
    rope_theta_optional=True, recipe="olmo_hybrid.yaml"))

# LFM2 (lfm2; exporter/short_conv.py): short-conv layers (in_proj -> B, C, x; B * x through a causal depthwise
# conv whose last K-1 inputs are the sequence's state; C * conv; out_proj) interleaved per layer_types with GQA
# attention layers (per-head q/k RMSNorm, RoPE, out_proj); operator_norm / ffn_norm before the mixer and the SwiGLU
# feed_forward (its width by transformers' Lfm2MLP rule), the final embedding_norm; norms' eps from norm_eps. lfm2_moe
# is another model_type (refused by family_for)
register(Family(
    name="lfm2", model_types=("lfm2",), gguf_archs=(), norm="rmsnorm", position="rope",
    gated_mlp=True, qkv_bias=False, o_bias=False, mlp_bias=False, weights=short_conv.lfm2_weights,
    norms=LayerNorms("operator_norm", None, "ffn_norm", None), qk_norm="head", rope_types=("default",),
    extra_fields=short_conv.read_fields, recipe="lfm2.yaml"))

# transformers layer_types entries kvexport implements (anything else is refused by name)
LAYER_TYPES = ("full_attention", "sliding_attention")


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES.values() for t in f.model_types)


def supported_gguf_archs() -> list[str]:
    return sorted(a for f in FAMILIES.values() for a in f.gguf_archs)


def family_for(model_type: str | None) -> Family:
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    raise UnsupportedModelError(
        f"config field 'model_type' is {model_type!r}, which kvexport does not support; "
        f"supported values: {', '.join(supported_model_types())}")


def _flag(config, flag: Flag) -> bool:
    return bool(getattr(config, flag, False)) if isinstance(flag, str) else flag


def _int(config, name: str) -> int | None:
    value = getattr(config, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config field {name!r} must be an integer, got {value!r}")
    return value


def read_spec(config) -> ModelSpec:
    """transformers PretrainedConfig -> validated ModelSpec, or a clear error."""
    fam = family_for(getattr(config, "model_type", None))
    config = fam.config_view(config) if fam.config_view is not None else config
    for name, allowed in fam.required.items():
        value = getattr(config, name, None)
        if value not in allowed:
            raise UnsupportedModelError(
                f"config field {name!r} is {value!r} for a {fam.name} model; kvexport supports "
                f"only {', '.join(repr(a) for a in allowed)}")
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    if not hidden or not heads:
        raise ConfigError("config fields 'hidden_size' and 'num_attention_heads' are required")
    # NOTE: `is None`, not `or`: an explicit 0 is a broken config (ModelSpec refuses it by name),
    # never silently the default (transformers then divides by it)
    kv_heads = _int(config, "num_key_value_heads")
    kv_heads = heads if kv_heads is None or fam.mla is not None else kv_heads  # MLA: every head's K/V from the latent
    head_dim = _int(config, "head_dim")
    head_dim = hidden // heads if head_dim is None else head_dim
    inter = (_int(config, "intermediate_size") or _int(config, "n_inner") or 4 * hidden)
    eps = getattr(config, "rms_norm_eps", None) if fam.norm == "rmsnorm" else \
        getattr(config, "layer_norm_epsilon", None)
    act = getattr(config, fam.activation_field, None) or getattr(config, "activation_function", None)
    layer_types = _layer_types(config, fam)
    rope = rope_local = layer_rope = None
    position = fam.position
    if fam.rope_theta_optional and (getattr(config, "rope_parameters", None) or {}).get("rope_theta") is None:
        position = "none"  # NoPE: transformers' rotary_emb is None, every layer unrotated
    if position == "rope":
        params = dict(getattr(config, "rope_parameters", None) or {})
        if fam.local_rope:  # gemma3: {"full_attention": {...}, "sliding_attention": {...}}
            rope_local = _rope(dict(params.get("sliding_attention") or {}), config)
            params = dict(params.get("full_attention") or {})
            layer_rope = tuple("local" if t == "sliding_attention" else "global" for t in layer_types)
        rope = _rope(params, config)
        if fam.nope_field:
            use = getattr(config, fam.nope_field, None)
            if not isinstance(use, (list, tuple)) or len(use) != len(layer_types):
                raise ConfigError(f"config field {fam.nope_field!r} must list 0 or 1 for each of the "
                                  f"{len(layer_types)} layers, got {use!r}")
            layer_rope = tuple(k if u else "none" for k, u in zip(layer_rope or ("global",) * len(use), use))
    window = layer_windows = None
    if fam.sliding_window_field:
        window = _int(config, fam.sliding_window_field)
    if fam.windowed_layer_types:
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        layer_windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        if not any(layer_windows):
            window = layer_windows = None
        elif all(w == window for w in layer_windows):
            layer_windows = None  # every layer windowed alike: the plain sliding_window says it
    for where, r in (("rope_parameters", rope), ("rope_parameters.sliding_attention", rope_local)):
        if r is not None and r.rope_type not in fam.rope_types:
            raise UnsupportedModelError(
                f"config field '{where}.rope_type' of a {fam.name} model is {r.rope_type!r}; supported values: "
                f"{', '.join(fam.rope_types)}")
    if layer_rope is not None and all(k == "global" for k in layer_rope):
        layer_rope = None
    eos = getattr(config, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    fields = dict(
        family=fam.name, model_type=config.model_type,
        num_layers=_int(config, "num_hidden_layers") or 0, hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
        vocab_size=_int(config, "vocab_size") or 0,
        max_positions=_int(config, "max_position_embeddings") or 0,
        norm=fam.norm, norm_eps=float(eps if eps is not None else 1e-5), activation=str(act),
        gated_mlp=fam.gated_mlp, qkv_bias=_flag(config, fam.qkv_bias),
        o_bias=_flag(config, fam.o_bias), mlp_bias=_flag(config, fam.mlp_bias),
        position=position, rope=rope, sliding_window=window,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        bos_token_id=getattr(config, "bos_token_id", None), eos_token_ids=eos_ids,
        layer_windows=layer_windows, layer_rope=layer_rope, rope_local=rope_local,
        layer_norms=fam.norms.layout, qk_norm=fam.qk_norm, norm_offset=fam.norm_offset,
        embed_scale=float(hidden) ** 0.5 if fam.embed_scale else None,
        attn_scale=_scale(config) if fam.mla is None else _mla_scale(config),
        attn_softcap=_float(config, "attn_logit_softcapping"),
        final_softcap=_float(config, "final_logit_softcapping"), mla=_mla(config, fam),
        moe=read_moe(config, fam.moe, _int(config, "num_hidden_layers") or 0) if fam.moe is not None else None,
        attn_sinks=fam.attention_sinks)
    fields.update(fam.extra_fields(config) if fam.extra_fields is not None else {})
    return ModelSpec(**fields)


def _mla(config, fam: Family) -> MLASpec | None:
    """The MLA fields of a DeepSeek config (exporter/spec.py MLASpec), or None for other families.
    q_lora_rank null means one q_proj; every other field must be a positive integer."""
    if fam.mla is None:
        return None
    fields = {}
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = _int(config, name)
        if value is None:
            raise ConfigError(f"config field {name!r} of a {fam.name} model is missing (multi-head latent attention)")
        fields[name] = value
    return MLASpec(q_lora_rank=_int(config, "q_lora_rank"), rope_interleave=_flag(config, fam.mla), **fields)


def _mla_scale(config) -> float:
    """DeepSeek's softmax scale: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2
    for a scaled RoPE whose parameters set mscale_all_dim (transformers' yarn_apply_mscale)."""
    import math

    head = (_int(config, "qk_nope_head_dim") or 0) + (_int(config, "qk_rope_head_dim") or 0)
    scale = head ** -0.5 if head > 0 else 1.0
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def _rope(params: dict, config) -> RopeSpec:
    if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
        params["rope_theta"] = config.rope_theta
    rope_type = params.get("rope_type", params.get("type", "default"))
    omax = None
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
    if rope_type == "proportional":  # NOTE: rotates the whole head, zero frequencies past the fraction (spec.py)
        partial = 1.0
    if rope_type == "longrope":  # the factors themselves are read from transformers' rotary embedding
        omax = params.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
    return RopeSpec(theta=float(params.get("rope_theta", 10000.0)), rope_type=rope_type, factor=params.get("factor"),
                    partial_rotary_factor=partial, original_max_positions=omax)


def _layer_types(config, fam: Family) -> tuple[str, ...]:
    """config.layer_types (what transformers itself derives from the family's pattern fields),
    or full attention everywhere; a layer type kvexport lacks is refused by name."""
    n = _int(config, "num_hidden_layers") or 0
    types = getattr(config, "layer_types", None) if (fam.windowed_layer_types or fam.local_rope) else None
    if types is None:
        return ("full_attention",) * n
    if not isinstance(types, (list, tuple)) or len(types) != n:
        raise ConfigError(f"config field 'layer_types' must list one type for each of the {n} layers, got {types!r}")
    for t in types:
        if t not in LAYER_TYPES:
            raise UnsupportedModelError(f"config field 'layer_types' has {t!r}, which kvexport does not support; "
                                        f"supported values: {', '.join(LAYER_TYPES)}")
    return tuple(types)


def _float(config, name: str) -> float | None:
    value = getattr(config, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config field {name!r} must be a number or null, got {value!r}")
    return float(value)


def _scale(config) -> float | None:
    """Gemma's query_pre_attn_scalar s: scores scale by s ** -0.5 instead of head_dim ** -0.5."""
    s = _float(config, "query_pre_attn_scalar")
    if s is not None and s <= 0:
        raise ConfigError(f"config field 'query_pre_attn_scalar' must be > 0, got {s!r}")
    return None if s is None else s ** -0.5
