"""The normalized model spec: what the graph builder needs to know about a model, read
once from a transformers config, validated, frozen. Families (families.py) say how to
read it; nothing downstream looks at a HF config again."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvexport.errors import ConfigError, KvExportError, UnsupportedModelError

NORMS = ("rmsnorm", "layernorm")
ACTIVATIONS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu")
POSITIONS = ("rope", "learned")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ACTIVATION_FIELD = {"gpt2": "activation_function"}  # family -> config field; default "hidden_act"


@dataclass(frozen=True, slots=True)
class RopeSpec:
    theta: float  # base of the inverse frequencies
    rope_type: str  # one of ROPE_TYPES; all are static (no length-dependent switching)
    factor: float | None  # scaling factor of linear/llama3/yarn, None for default
    partial_rotary_factor: float  # fraction of head_dim that is rotated (1.0 = all)


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
    position: str  # "rope" | "learned"
    rope: RopeSpec | None  # None for learned positions
    sliding_window: int | None  # tokens a query may look back, including itself; None = full
    tie_embeddings: bool  # lm_head shares the embedding matrix
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        # ConfigError: a malformed value; UnsupportedModelError: a valid option kvexport lacks
        def need(cond: bool, field: str, what: str, error: type[KvExportError] = ConfigError) -> None:
            if not cond:
                raise error(f"config field {field!r} of a {self.model_type} model {what}")

        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "max_positions"):
            value = getattr(self, field)
            need(isinstance(value, int) and value > 0, field, f"must be a positive integer, got {value!r}")
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

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        assert self.rope is not None
        return int(self.head_dim * self.rope.partial_rotary_factor)

    def to_json(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d
