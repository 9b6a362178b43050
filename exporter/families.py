"""The registry of supported architectures. Each family is one declarative entry: which
transformers `model_type`s and GGUF architectures it covers, how to read the spec's fields,
which options it refuses, and which weight layout its checkpoints use. Adding a family is
adding an entry; nothing else branches on model types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvexport.errors import ConfigError, UnsupportedModelError

from .spec import ModelSpec, RopeSpec


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer, matmul weights stored [in, out]."""

    ln1_w: np.ndarray  # [hidden]
    ln1_b: np.ndarray | None  # [hidden] (layernorm only)
    qkv_w: np.ndarray  # [hidden, (heads + 2 * kv_heads) * head_dim], q | k | v
    qkv_b: np.ndarray | None  # [(heads + 2 * kv_heads) * head_dim]
    o_w: np.ndarray  # [heads * head_dim, hidden]
    o_b: np.ndarray | None  # [hidden]
    ln2_w: np.ndarray  # [hidden]
    ln2_b: np.ndarray | None
    up_w: np.ndarray  # gated: [hidden, 2 * inter] (gate | up); else [hidden, inter]
    up_b: np.ndarray | None
    down_w: np.ndarray  # [inter, hidden]
    down_b: np.ndarray | None


@dataclass(slots=True)
class ModelWeights:
    embed: np.ndarray  # [vocab, hidden]
    pos_embed: np.ndarray | None  # [max_positions, hidden] (learned positions only)
    layers: list[LayerWeights]
    final_norm_w: np.ndarray  # [hidden]
    final_norm_b: np.ndarray | None
    lm_head: np.ndarray  # [vocab, hidden]; the same array as `embed` when tied


Flag = bool | str  # a constant, or the name of a boolean config attribute


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    norm: str  # "rmsnorm" | "layernorm"
    position: str  # "rope" | "learned"
    gated_mlp: bool
    qkv_bias: Flag
    o_bias: Flag
    mlp_bias: Flag
    weights: Callable[[dict[str, Any], ModelSpec], ModelWeights]
    sliding_window_field: str | None = None  # config attribute holding the window
    # config attribute -> values we implement; anything else is refused by name
    required: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    recipe: str = ""  # recipe file shipped for this family


def _np(t) -> np.ndarray:
    return t.detach().to("cpu").float().numpy()


def _opt(sd: dict, key: str) -> np.ndarray | None:
    return _np(sd[key]) if key in sd else None


def _final(sd: dict, spec: ModelSpec, embed: np.ndarray, norm: str, head: str,
           pos_embed: np.ndarray | None, layers: list[LayerWeights]) -> ModelWeights:
    lm_head = embed if spec.tie_embeddings or head not in sd else _np(sd[head])
    return ModelWeights(embed, pos_embed, layers, _np(sd[f"{norm}.weight"]),
                        _opt(sd, f"{norm}.bias"), lm_head)


def split_linear_weights(sd: dict, spec: ModelSpec) -> ModelWeights:
    """Llama-style checkpoints: q/k/v/o and gate/up/down are separate nn.Linear [out, in]."""
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv_w = np.concatenate([_np(sd[a + f"{x}_proj.weight"]) for x in "qkv"], axis=0).T
        qkv_b = (np.concatenate([_np(sd[a + f"{x}_proj.bias"]) for x in "qkv"])
                 if spec.qkv_bias else None)
        up_w = np.concatenate([_np(sd[m + "gate_proj.weight"]), _np(sd[m + "up_proj.weight"])]).T
        up_b = (np.concatenate([_np(sd[m + "gate_proj.bias"]), _np(sd[m + "up_proj.bias"])])
                if spec.mlp_bias else None)
        layers.append(LayerWeights(
            _np(sd[p + "input_layernorm.weight"]), None, np.ascontiguousarray(qkv_w), qkv_b,
            np.ascontiguousarray(_np(sd[a + "o_proj.weight"]).T), _opt(sd, a + "o_proj.bias"),
            _np(sd[p + "post_attention_layernorm.weight"]), None,
            np.ascontiguousarray(up_w), up_b,
            np.ascontiguousarray(_np(sd[m + "down_proj.weight"]).T), _opt(sd, m + "down_proj.bias")))
    return _final(sd, spec, _np(sd["model.embed_tokens.weight"]), "model.norm", "lm_head.weight",
                  None, layers)


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


FAMILIES: dict[str, Family] = {}


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
    weights=fused_linear_weights, sliding_window_field="sliding_window", recipe="phi3.yaml"))
register(Family(
    name="gpt2", model_types=("gpt2",), gguf_archs=("gpt2",), norm="layernorm",
    position="learned", gated_mlp=False, qkv_bias=True, o_bias=True, mlp_bias=True,
    weights=conv1d_weights, recipe="gpt2.yaml",
    required={"scale_attn_by_inverse_layer_idx": (False,), "scale_attn_weights": (True,),
              "add_cross_attention": (False,)}))


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
    kv_heads = _int(config, "num_key_value_heads") or heads
    head_dim = _int(config, "head_dim") or hidden // heads
    inter = (_int(config, "intermediate_size") or _int(config, "n_inner") or 4 * hidden)
    eps = getattr(config, "rms_norm_eps", None) if fam.norm == "rmsnorm" else \
        getattr(config, "layer_norm_epsilon", None)
    act = getattr(config, "hidden_act", None) or getattr(config, "activation_function", None)
    rope = None
    if fam.position == "rope":
        params = dict(getattr(config, "rope_parameters", None) or {})
        if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
            params["rope_theta"] = config.rope_theta
        rope_type = params.get("rope_type", params.get("type", "default"))
        rope = RopeSpec(theta=float(params.get("rope_theta", 10000.0)), rope_type=rope_type,
                        factor=params.get("factor"),
                        partial_rotary_factor=float(params.get("partial_rotary_factor",
                                                    getattr(config, "partial_rotary_factor", 1.0)) or 1.0))
    window = None
    if fam.sliding_window_field:
        window = _int(config, fam.sliding_window_field)
    eos = getattr(config, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return ModelSpec(
        family=fam.name, model_type=config.model_type,
        num_layers=_int(config, "num_hidden_layers") or 0, hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
        vocab_size=_int(config, "vocab_size") or 0,
        max_positions=_int(config, "max_position_embeddings") or 0,
        norm=fam.norm, norm_eps=float(eps if eps is not None else 1e-5), activation=str(act),
        gated_mlp=fam.gated_mlp, qkv_bias=_flag(config, fam.qkv_bias),
        o_bias=_flag(config, fam.o_bias), mlp_bias=_flag(config, fam.mlp_bias),
        position=fam.position, rope=rope, sliding_window=window,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        bos_token_id=getattr(config, "bos_token_id", None), eos_token_ids=eos_ids)
