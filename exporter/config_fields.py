"""The shape fields of a config.json, checked as read: this module owns their allowed ranges.
`kvexport plan` and `kvexport build` both read a model's config.json through
source.config_json, which calls `check_shape_fields` on the parsed JSON object before
transformers' config classes or any arithmetic see it: a count that is not an integer
(bool, float, string), or outside its range (0 heads, 2**63 layers, a 5,000-digit vocab,
1e30 experts), is refused as ConfigError naming the field and its range; an MLA family's
config without its latent fields is refused by name (transformers would fill in its defaults).

NOTE: the upper bounds are far above any released model (DeepSeek-V3: 61 layers, 128 heads,
256 experts, 163,840 positions; Llama 4: 10M positions; vocabularies up to 262,144) and far
below what overflows an index or a byte count (`plan` multiplies them: layers × heads ×
head_dim × positions stays well inside int64)."""

from __future__ import annotations

from kvexport.errors import ConfigError

# config.json field -> (lowest, highest) allowed integer. Absent or null: left to the family's
# reader (transformers' default, or a derived value such as head_dim = hidden / heads)
SHAPE_FIELDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 1024), "n_layer": (1, 1024),  # gpt2 spells them n_*
    "num_attention_heads": (1, 1024), "n_head": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "hidden_size": (1, 1 << 20), "n_embd": (1, 1 << 20),
    "intermediate_size": (1, 1 << 22), "n_inner": (1, 1 << 22),
    "moe_intermediate_size": (1, 1 << 22),
    "shared_expert_intermediate_size": (0, 1 << 22),  # 0: no shared expert
    "vocab_size": (1, 1 << 24),
    "max_position_embeddings": (2, 1 << 24), "n_positions": (2, 1 << 24),  # 2: a prompt token and one more
    # mixtures of experts (exporter/moe.py MoEFields)
    "num_experts": (1, 4096), "num_local_experts": (1, 4096), "n_routed_experts": (1, 4096),
    "num_experts_per_tok": (1, 4096), "n_shared_experts": (0, 4096),
    # multi-head latent attention (exporter/mla.py)
    "kv_lora_rank": (1, 1 << 16), "q_lora_rank": (1, 1 << 16),
    "qk_nope_head_dim": (1, 4096), "qk_rope_head_dim": (1, 4096), "v_head_dim": (1, 4096),
}  # NOTE: not here: fields a family reads with its own default for 0 (n_group, topk_group) or ignores (sliding_window)
# model_type -> fields its config.json must hold (no default is taken for them)
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    t: ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") for t in ("deepseek_v2", "deepseek_v3")}


MAX_DIGITS = 400  # an integer literal longer than this is kept as HugeInt (int() refuses 4,300+ digits)


class HugeInt:
    """An integer literal of more than MAX_DIGITS digits, as parsed (`json.loads(parse_int=parse_int)`)."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits  # decimal digits, sign excluded


def parse_int(text: str):
    """json's parse_int: the int, or HugeInt for a literal no config field can hold (never int() of it)."""
    digits = len(text.lstrip("-"))
    return int(text) if digits <= MAX_DIGITS else HugeInt(digits)


def _range(lo: int, hi: int) -> str:
    return f"an integer in {lo:,}..{hi:,}"


def check_shape_fields(cfg: dict, where: str) -> None:
    """Refuse (ConfigError) a shape field of the parsed config.json `cfg` that is not an integer in its
    SHAPE_FIELDS range, or an MLA field REQUIRED_FIELDS names that is missing; `where` names the file."""
    model_type = cfg.get("model_type")
    for name in REQUIRED_FIELDS.get(model_type, ()) if isinstance(model_type, str) else ():
        if cfg.get(name) is None:
            lo, hi = SHAPE_FIELDS[name]
            raise ConfigError(f"config field {name!r} of {where} is missing: a {model_type} model (multi-head latent "
                              f"attention) needs it, {_range(lo, hi)}; fix config.json or download the model again")
    for name, (lo, hi) in SHAPE_FIELDS.items():
        value = cfg.get(name)
        if value is None:
            continue
        if isinstance(value, HugeInt):
            got = _shown(value)
        elif isinstance(value, bool) or not isinstance(value, int):
            got = f"{type(value).__name__} {_shown(value)}"
        elif not lo <= value <= hi:
            got = _shown(value)
        else:
            continue
        raise ConfigError(f"config field {name!r} of {where} must be {_range(lo, hi)}, got {got}; fix config.json "
                          f"or download the model again")
    stack: list = [(k, v) for k, v in cfg.items()]  # iterative: the JSON may be nested deep
    while stack:
        path, value = stack.pop()
        if isinstance(value, HugeInt):
            raise ConfigError(f"config field {path!r} of {where} is an integer of {value.digits:,} digits, more than "
                              f"any config field holds; fix config.json or download the model again")
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}", v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))


def _shown(value) -> str:
    """`value` for a message: a huge integer by its digit count, anything else by a clipped repr."""
    if isinstance(value, HugeInt):
        return f"an integer of {value.digits:,} digits"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
