"""The normalized model spec: what the graph builder needs to know about a model, read
once from a transformers config, validated, frozen. Families (families.py) say how to
read it; nothing downstream looks at a HF config again."""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields, replace

from kvexport import io
from kvexport.errors import ConfigError, KvExportError, UnsupportedModelError

from .linear_attention import LinearAttnSpec
from .moe import MoESpec
from .short_conv import ShortConvSpec

NORMS = ("rmsnorm", "layernorm")
ACTIVATIONS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu")
POSITIONS = ("rope", "learned", "none")  # "none": no position encoding on any layer (NoPE: OLMo-Hybrid)
# "proportional" (Gemma 4's global layers): rotate-half over the whole head with zero frequencies past
# partial_rotary_factor, read as partial_rotary_factor 1.0 (transformers' tables are head_dim / 2 wide)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
ACTIVATION_FIELD = {"gpt2": "activation_function"}  # family -> config field; default "hidden_act"
LAYER_NORMS = ("pre", "post", "sandwich")  # norms before / after / around attention and MLP
QK_NORMS = ("head", "all")  # RMSNorm of q and k per head (qwen3, gemma3) or over all heads (olmo2)
ROPE_KINDS = ("global", "local", "none")  # per layer: the model's RoPE, the local layers' RoPE, no RoPE
# spec field -> the config.json field it is read from, where the names differ (for messages)
_CONFIG_FIELDS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                  "num_kv_heads": "num_key_value_heads", "max_positions": "max_position_embeddings"}


@dataclass(frozen=True, slots=True)
class RopeSpec:
    theta: float  # base of the inverse frequencies
    rope_type: str  # one of ROPE_TYPES; all static except longrope (short / long factor sets)
    factor: float | None  # scaling factor of linear/llama3/yarn, None for default
    partial_rotary_factor: float  # fraction of head_dim that is rotated (1.0 = all)
    # longrope: a step uses the long factors when its sequence holds more tokens than this after
    # the step (docs/ARCHITECTURE.md "longrope"); None for every other type (and left out of the JSON)
    original_max_positions: int | None = None


@dataclass(frozen=True, slots=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3, exporter/mla.py): per token and layer the
    KV cache holds one latent row of kv_lora_rank + qk_rope_head_dim elements."""

    q_lora_rank: int | None  # q_a_proj -> q_a_layernorm -> q_b_proj rank; None: one q_proj
    kv_lora_rank: int  # L: the compressed KV latent, elements
    qk_nope_head_dim: int  # N: per head, the query/key channels without RoPE
    qk_rope_head_dim: int  # R: per head, the RoPE channels (the key's are shared by all heads)
    v_head_dim: int  # V: per head, value channels
    # the checkpoint pairs RoPE channels (2i, 2i+1) (V2; V3's rope_interleave): the reader permutes
    # the weights' RoPE columns to evens | odds for rotate-half RoPE (exporter/mla.py NOTE)
    rope_interleave: bool = True

    @property
    def row_width(self) -> int:
        """Elements of one latent pool row: L + R."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class ModelSpec:
    family: str  # registry name, e.g. "llama"
    model_type: str  # transformers model_type it was read from
    num_layers: int
    hidden_size: int  # model width, elements
    num_heads: int  # query heads
    num_kv_heads: int  # KV heads; < num_heads means GQA (1 = MQA)
    head_dim: int  # elements per head
    intermediate_size: int  # MLP width, elements
    vocab_size: int  # tokens
    max_positions: int  # longest context the model was trained for, tokens
    norm: str  # "rmsnorm" | "layernorm"
    norm_eps: float
    activation: str  # one of ACTIVATIONS
    gated_mlp: bool  # act(gate(x)) * up(x) (llama) vs act(fc(x)) (gpt2)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    position: str  # one of POSITIONS
    rope: RopeSpec | None  # None for learned positions and none
    sliding_window: int | None  # tokens a query may look back, including itself; None = full
    tie_embeddings: bool  # lm_head shares the embedding matrix
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # ---- per-layer attention and layer structure (2025 families); defaults = llama-style.
    # NOTE: to_json() leaves out fields at their default, so the manifests of families that
    # do not use them stay byte-identical to those of builds made before the fields existed
    layer_windows: tuple[int | None, ...] | None = None  # window per layer; None: `sliding_window` for all
    layer_rope: tuple[str, ...] | None = None  # per layer one of ROPE_KINDS; None: "global" for all
    rope_local: RopeSpec | None = None  # RoPE of "local" layers (gemma3's rope_local_base_freq)
    layer_norms: str = "pre"  # one of LAYER_NORMS (a hybrid: its attention layers'; `norms_at`)
    qk_norm: str | None = None  # one of QK_NORMS, None: no q/k norms
    norm_offset: float = 0.0  # norms scale by (offset + w): 1.0 for Gemma; folded into the weights when read
    embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden)); None: 1
    # softmax scale of q·k (Gemma: query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5
    attn_scale: float | None = None
    attn_softcap: float | None = None  # scores = cap * tanh(scores / cap) before the mask; None: off
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap); None: off
    # the end tokens the source names beyond config.json's eos_token_id: generation_config.json's
    # eos_token_id (GGUF: the eos / eot / eom ids of its metadata); the runtime stops on both lists
    # (exporter/end_tokens.py). None: the source names none beyond config.json's (and builds before it)
    generation_eos_token_ids: tuple[int, ...] | None = None
    # multi-head latent attention (DeepSeek-V2/V3); None: per-head K/V. With it, head_dim is
    # qk_rope_head_dim (what RoPE rotates, as transformers' config says) and attn_scale the softmax scale
    mla: MLASpec | None = None
    # mixture of experts (exporter/moe.py): routing and expert shapes; its sparse_layers take the MoE
    # block, the other layers the dense MLP of intermediate_size. None: every layer dense
    moe: MoESpec | None = None
    # learned attention sinks (GPT-OSS): one logit per query head and layer joins the softmax's
    # denominator (plugins/paged_attention/spec.py); the values are weights (LayerWeights.attn_sinks)
    attn_sinks: bool = False
    # ---- Gemma 4 (exporter/gemma4.py); defaults: uniform layers, each with its own KV cache
    # per layer head_dim / KV heads where layers differ (Gemma 4's full-attention layers: global_head_dim,
    # num_global_key_value_heads); None: head_dim / num_kv_heads for every layer
    layer_head_dims: tuple[int, ...] | None = None
    layer_kv_heads: tuple[int, ...] | None = None
    # per layer the layer whose KV cache it attends over: itself, or an earlier layer of the same window
    # and shape (Gemma 4's num_kv_shared_layers); a shared cache is written once, by its own layer, and
    # only that layer has pools (kvexport/io.py "Shared KV"). None: every layer its own
    kv_sources: tuple[int, ...] | None = None
    v_norm: bool = False  # values RMS-normed per head, without a weight, before the cache (Gemma 4)
    per_layer_input: int | None = None  # per-layer input embedding width (Gemma 4's hidden_size_per_layer_input)
    # ---- gated DeltaNet hybrids (Qwen3.5, Qwen3-Next; exporter/linear_attention.py): the linear layers and
    # their state dims (they hold recurrent state, no KV); LFM2's short-conv layers (exporter/short_conv.py: a
    # conv state alone) the same way; None: every layer attention
    linear_attn: LinearAttnSpec | ShortConvSpec | None = None
    attn_output_gate: bool = False  # attention output × sigmoid(x @ gate) before o_proj (q_proj holds the gate)

    def __post_init__(self) -> None:
        # ConfigError: a malformed value; UnsupportedModelError: a valid option kvexport lacks
        def need(cond: bool, field: str, what: str, error: type[KvExportError] = ConfigError) -> None:
            if not cond:
                raise error(f"config field {field!r} of a {self.model_type} model {what}")

        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "max_positions"):
            value = getattr(self, field)
            need(isinstance(value, int) and value > 0, _CONFIG_FIELDS.get(field, field),
                 f"must be a positive integer, got {value!r}")
        need(self.num_heads % self.num_kv_heads == 0, "num_key_value_heads",
             f"must divide num_attention_heads ({self.num_heads}), got {self.num_kv_heads}")
        need(self.norm in NORMS, "norm", f"must be one of {NORMS}, got {self.norm!r}")
        need(self.activation in ACTIVATIONS, ACTIVATION_FIELD.get(self.family, "hidden_act"),
             f"is {self.activation!r}; supported values: {', '.join(ACTIVATIONS)}", UnsupportedModelError)
        need(self.position in POSITIONS, "position", f"must be one of {POSITIONS}")
        need(self.norm_eps > 0, "norm eps", f"must be > 0, got {self.norm_eps}")
        if self.position == "rope":
            need(self.rope is not None, "rope_parameters", "is missing")
            assert self.rope is not None
            need(self.rope.rope_type in ROPE_TYPES, "rope_parameters.rope_type",
                 f"is {self.rope.rope_type!r}; supported values: {', '.join(ROPE_TYPES)}",
                 UnsupportedModelError)
            rot = self.head_dim * self.rope.partial_rotary_factor
            need(0 < rot <= self.head_dim and int(rot) % 2 == 0, "partial_rotary_factor",
                 f"must rotate an even number of dims, got {self.rope.partial_rotary_factor}")
        if self.sliding_window is not None:
            need(self.sliding_window > 0, "sliding_window", f"must be > 0, got {self.sliding_window}")
        for field, per_layer in (("layer_types", self.layer_windows), ("layer_types", self.layer_rope)):
            if per_layer is not None:
                need(len(per_layer) == self.num_layers, field,
                     f"must list {self.num_layers} layers (num_hidden_layers), got {len(per_layer)}")
        for w in self.layer_windows or ():
            need(w is None or (isinstance(w, int) and w > 0), "sliding_window", f"must be > 0, got {w}")
        for kind in self.layer_rope or ():
            need(kind in ROPE_KINDS, "layer_types", f"RoPE kinds must be one of {ROPE_KINDS}, got {kind!r}")
            need(kind != "local" or self.rope_local is not None, "rope_local_base_freq", "is missing")
        if self.rope is not None and self.rope.rope_type == "longrope":
            omax = self.rope.original_max_positions
            need(isinstance(omax, int) and omax > 0, "original_max_position_embeddings",
                 f"must be a positive integer for longrope, got {omax!r}")
        if self.rope_local is not None:
            need(self.rope_local.rope_type in ROPE_TYPES, "rope_parameters.sliding_attention.rope_type",
                 f"is {self.rope_local.rope_type!r}; supported values: {', '.join(ROPE_TYPES)}", UnsupportedModelError)
            need(kind == "none" or self.position == "rope", "position", "has no RoPE for a RoPE layer")
        need(self.layer_norms in LAYER_NORMS, "layer norms", f"must be one of {LAYER_NORMS}, got {self.layer_norms!r}")
        need(self.qk_norm in QK_NORMS + (None,), "q/k norm", f"must be one of {QK_NORMS} or None, got {self.qk_norm!r}")
        if self.mla is not None:
            m = self.mla
            for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                value = getattr(m, field)
                need(isinstance(value, int) and value > 0, field, f"must be a positive integer, got {value!r}")
            need(m.q_lora_rank is None or (isinstance(m.q_lora_rank, int) and m.q_lora_rank > 0), "q_lora_rank",
                 f"must be a positive integer or null (no q_a_proj), got {m.q_lora_rank!r}")
            need(m.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"must be even, got {m.qk_rope_head_dim}")
            need(self.head_dim == m.qk_rope_head_dim, "head_dim",
                 f"must equal qk_rope_head_dim ({m.qk_rope_head_dim}) in an MLA model, got {self.head_dim}")
        if self.moe is not None:  # exporter/moe.py read_moe checked the config's fields by name
            need(all(0 <= i < self.num_layers for i in self.moe.sparse_layers), "mlp_only_layers",
                 f"leaves MoE layers {self.moe.sparse_layers} outside the {self.num_layers} layers")
        _check_layers(self, need)
        if self.linear_attn is not None:
            need(all(0 <= i < self.num_layers for i in self.linear_attn.layers), "layer_types",
                 f"puts linear-attention layers {self.linear_attn.layers} outside the {self.num_layers} layers")
        for field, value in (("attn_logit_softcapping", self.attn_softcap),
                             ("final_logit_softcapping", self.final_softcap),
                             ("query_pre_attn_scalar", self.attn_scale), ("embed scale", self.embed_scale)):
            need(value is None or value > 0, field, f"must be > 0 or null, got {value!r}")

    def layer_view(self, i: int) -> "ModelSpec":
        """The spec as layer i's attention sees it: its head_dim and KV heads as the model's
        (the spec itself when the layers are uniform)."""
        if self.layer_head_dims is None and self.layer_kv_heads is None:
            return self
        return replace(self, head_dim=self.layer_kv_shape(i)[1], num_kv_heads=self.layer_kv_shape(i)[0],
                       layer_head_dims=None, layer_kv_heads=None)

    def layer_kv_shape(self, i: int) -> tuple[int, int]:
        """(KV heads, head_dim) of layer i."""
        return (self.layer_kv_heads[i] if self.layer_kv_heads is not None else self.num_kv_heads,
                self.layer_head_dims[i] if self.layer_head_dims is not None else self.head_dim)

    def norms_at(self, i: int) -> str:
        """Where layer i's norms sit (one of LAYER_NORMS): a gated DeltaNet (or LFM2 short-conv) layer's before
        its mixer and its MLP, every other layer's `layer_norms`.
        NOTE: pre for the linear layers of every hybrid transformers has (Qwen3.5, Qwen3-Next, OLMo-Hybrid),
        whatever its attention layers do (OLMo-Hybrid's: post, as olmo2's)."""
        if self.linear_attn is not None and i in self.linear_attn.layers:
            return "pre"
        return self.layer_norms

    def kv_source(self, i: int) -> int:
        """The layer whose KV cache layer i reads (i itself unless it shares an earlier layer's)."""
        return self.kv_sources[i] if self.kv_sources is not None else i

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that hold a KV cache (pools), ascending: every layer but those sharing another's."""
        linear = set(self.linear_attn.layers) if self.linear_attn is not None else set()
        return tuple(i for i in range(self.num_layers) if self.kv_source(i) == i and i not in linear)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        assert self.rope is not None
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def scale(self) -> float:
        """Softmax scale of q·k, the same for every layer."""
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def window(self, layer: int) -> int | None:
        """Tokens a query of `layer` may look back, itself included; None = full attention."""
        return self.layer_windows[layer] if self.layer_windows is not None else self.sliding_window

    def rope_kind(self, layer: int) -> str:
        """Which RoPE `layer` applies: one of ROPE_KINDS ("none" for learned positions too)."""
        if self.position != "rope":
            return "none"
        return self.layer_rope[layer] if self.layer_rope is not None else "global"

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has the same one (one KV cache group, freed behind it),
        else None (paged builds then give the windowed layers a local group: kvexport/io.py)."""
        windows = {self.window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    def to_json(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.generation_eos_token_ids is not None:
            d["generation_eos_token_ids"] = list(self.generation_eos_token_ids)
        for f in _OPTIONAL:  # see the NOTE on the fields
            if getattr(self, f.name) == f.default:
                del d[f.name]
        for name in ("layer_windows", "layer_rope") + _LAYER_TUPLES:
            if name in d:
                d[name] = list(d[name])
        if "moe" in d:
            d["moe"] = self.moe.to_json()
        if "linear_attn" in d:
            d["linear_attn"] = self.linear_attn.to_json()
        for name in ("rope", "rope_local"):
            if isinstance(d.get(name), dict) and d[name]["original_max_positions"] is None:
                del d[name]["original_max_positions"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ModelSpec":
        """The spec `to_json()` wrote (a build manifest's ``model``), validated again; fields
        left out take their defaults. ConfigError names a field this kvexport does not know."""
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(d) - known):
            raise ConfigError(f"model spec field {unknown[0]!r} is not one this kvexport knows (written by another "
                              f"version?): rebuild with `kvexport build --force`")
        kw = dict(d)
        for name in ("rope", "rope_local"):
            if isinstance(kw.get(name), dict):
                kw[name] = RopeSpec(**kw[name])
        if isinstance(kw.get("mla"), dict):
            kw["mla"] = MLASpec(**kw["mla"])
        if isinstance(kw.get("moe"), dict):
            kw["moe"] = MoESpec.from_json(kw["moe"])
        if isinstance(kw.get("linear_attn"), dict):  # told apart by the short conv's "mixer" (io.SHORT_CONV)
            cls_ = ShortConvSpec if kw["linear_attn"].get("mixer") == io.SHORT_CONV else LinearAttnSpec
            kw["linear_attn"] = cls_.from_json(kw["linear_attn"])
        for name in ("eos_token_ids", "generation_eos_token_ids", "layer_windows", "layer_rope") + _LAYER_TUPLES:
            if kw.get(name) is not None:
                kw[name] = tuple(kw[name])
        return cls(**kw)


_OPTIONAL = [f for f in fields(ModelSpec) if f.default is not MISSING]
_LAYER_TUPLES = ("layer_head_dims", "layer_kv_heads", "kv_sources")


def _check_layers(spec: ModelSpec, need) -> None:
    """The per-layer shapes and KV sharing (Gemma 4): one entry per layer; a layer reads its own
    cache or that of an earlier layer which reads its own, with the same window and KV shape
    (the sharing layers then attend exactly as their source's KV was written)."""
    n = spec.num_layers
    for field, per_layer in (("per_layer_config.head_dim", spec.layer_head_dims),
                             ("per_layer_config.num_key_value_heads", spec.layer_kv_heads),
                             ("num_kv_shared_layers", spec.kv_sources)):
        if per_layer is not None:
            need(len(per_layer) == n, field, f"must give {n} layers (num_hidden_layers), got {len(per_layer)}")
    for i in range(n):
        kvh, d = spec.layer_kv_shape(i)
        need(isinstance(d, int) and d > 0, "per_layer_config.head_dim", f"must be a positive integer, got {d!r}")
        need(isinstance(kvh, int) and kvh > 0 and spec.num_heads % kvh == 0, "per_layer_config.num_key_value_heads",
             f"must divide num_attention_heads ({spec.num_heads}), got {kvh!r} (layer {i})")
        src = spec.kv_source(i)
        if src != i:
            need(isinstance(src, int) and 0 <= src < i and spec.kv_source(src) == src, "num_kv_shared_layers",
                 f"makes layer {i} read layer {src}'s KV cache, which is not an earlier layer with its own")
            need(spec.window(src) == spec.window(i) and spec.layer_kv_shape(src) == (kvh, d)
                 and spec.rope_kind(src) == spec.rope_kind(i), "layer_types",
                 f"makes layer {i} share layer {src}'s KV cache across different windows, RoPE or KV shapes")
    if spec.layer_head_dims is not None or spec.layer_kv_heads is not None:  # the graph builds per window / RoPE kind
        for what, key in (("window", spec.window), ("RoPE", spec.rope_kind)):
            shapes: dict = {}
            for i in range(n):
                need(shapes.setdefault(key(i), spec.layer_kv_shape(i)) == spec.layer_kv_shape(i), "per_layer_config",
                     f"gives layers of the same {what} different KV heads / head_dim (layer {i}); kvexport needs "
                     f"one shape per layer type")
    if spec.per_layer_input is not None:
        need(isinstance(spec.per_layer_input, int) and spec.per_layer_input > 0, "hidden_size_per_layer_input",
             f"must be a positive integer or 0, got {spec.per_layer_input!r}")
