"""`kvexport plan`'s weights: the bytes of a build's weights file per matmul precision, counted
from a model's spec alone (no weights read), as exporter/quantize.py stores them. exporter/plan.py
tabulates `weights_estimate` for every precision and subtracts one from the memory of a fit.

    matmuls   per decoder layer (attention, MLP; MoE: every expert + the shared one; MLA: its
              low-rank linears; a hybrid's gated DeltaNet layers: in_proj and out_proj instead of
              attention, exporter/linear_attention.py): float, or int8 / int4 codes + one scale per
              block of K rows
    tables    embeddings, LM head (untied), learned positions: float, or int8 in blocks
    float32   norms, RoPE tables, MoE routers, MLA's absorbed W_UK / W_UV, a gated DeltaNet layer's conv
              taps, A and dt_bias and gated norm, in every build

NOTE: the counts follow the builders' tensors (quantize.py LINEARS, moe.py experts, mla.py linears),
and tests/exporter/test_plan.py `test_weight_estimates_are_the_bytes_a_build_stores` holds them
against the tensors of real (tiny) builds: a builder that stores a new tensor counts it here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvexport.errors import ConfigError

from .limits import CALIBRATED_METHODS, DEFAULT_WEIGHT_FORM, FALLBACK_WEIGHT_BLOCK, WEIGHT_PRECISIONS
from .quantize import BITS, HEAD_BITS, HEAD_CHANNEL_BUILDS_BLOCK
from .spec import ModelSpec

# bytes of the activation dtype a build of each weight precision has by default (--dtype fp32,
# fp16 for fp16): matmul weights, biases and block scales are stored in it, norms in float32
ACT_BYTES = {"fp32": 4, "fp16": 2, "int8": 4, "int4": 4}


@dataclass(frozen=True, slots=True)
class WeightsEstimate:
    """The weights file of a build of one matmul precision from float weights, in the precision's
    default form (exporter/limits.py DEFAULT_WEIGHT_FORM; MoE / MLA int8: rtn blocks, `_weight_block`;
    exporter/quantize.py stores it): symmetric codes (int4 two per byte) + one scale in the
    activation dtype (float32 at the default --dtype fp32) per block of K rows or per output
    column; LM head and embeddings int8 in blocks; norms, RoPE tables, MoE routers and MLA's W_UK /
    W_UV float32. Not counted: the 4 KiB alignment of each tensor, and what pre-quantized sources
    add (GGUF Q4_1 blocks mapped exactly: a zero point and an offset per block)."""

    precision: str  # one of exporter/limits.py WEIGHT_PRECISIONS
    block_size: int | None  # int8/int4: rows of K per scale, 0 = one scale per output column; None: float
    parameters: int  # model parameters, elements (RoPE tables not counted, as the manifest counts)
    bytes: int  # the whole file, bytes
    matmul_bytes: int  # decoder matmul weights (int8/int4: codes + scales) and biases, bytes
    table_bytes: int  # embeddings, LM head (untied), learned positions, bytes
    float32_bytes: int  # norms, RoPE tables, MoE routers, MLA's W_UK / W_UV (float32 in every build), bytes


def _linear_attn_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """[K, N] of a state layer's matmuls: a gated DeltaNet's in_proj (q | k | v | z | b | a) and out_proj
    (exporter/linear_attention.py), an LFM2 short conv's in_proj (B | C | x) and out_proj (exporter/short_conv.py)."""
    return spec.linear_attn.matmul_shapes(spec.hidden_size)


def _float_matmul_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """[K, N] of the matmuls among `_model_matmul_shapes` that no weight quantization touches: every state
    layer's in_proj / out_proj, and an output-gated attention layer's gate (q_proj's second half)."""
    la = spec.linear_attn
    out = _linear_attn_shapes(spec) * len(la.layers) if la is not None else []
    if spec.attn_output_gate:
        out += [(spec.hidden_size, spec.num_heads * spec.head_dim)] * (spec.num_layers - (len(la.layers) if la else 0))
    return out


def _linear_attn_float32(spec: ModelSpec) -> int:
    """Elements of every state layer's float32 tensors (gated DeltaNet: conv taps [K, conv_dim], A and dt_bias
    [Hv], the gated norm's weight [Dv]; short conv: its taps and bias); 0 without state layers."""
    la = spec.linear_attn
    return la.float32_elements() if la is not None else 0


def _matmul_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """[K, N] of one decoder layer's matmuls (exporter/quantize.py LINEARS: qkv, o, up, down); an
    output-gated attention's q_proj holds the gate too (spec.attn_output_gate: q rows twice)."""
    qkv = ((2 if spec.attn_output_gate else 1) * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    up = 2 * spec.intermediate_size if spec.gated_mlp else spec.intermediate_size
    mlp = [(spec.hidden_size, up), (spec.intermediate_size, spec.hidden_size)]
    if spec.mla is not None:  # exporter/mla.py: q (low-rank or not), kv_a, o (W_UK | W_UV: _mla_float32)
        return _mla_shapes(spec) + mlp
    return [(spec.hidden_size, qkv), (spec.num_heads * spec.head_dim, spec.hidden_size)] + mlp


def _model_matmul_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """[K, N] of every decoder matmul of the model: per layer its attention and MLP; a MoE layer
    (exporter/moe.py) has each expert's up / down (own matrices) and its shared expert instead."""
    shapes = _matmul_shapes(spec)
    linear = set(spec.linear_attn.layers) if spec.linear_attn is not None else set()
    attention, dense = shapes[:-2], shapes[-2:]
    mixer = lambda i: _linear_attn_shapes(spec) if i in linear else attention  # noqa: E731
    if spec.moe is None:
        return [s for i in range(spec.num_layers) for s in mixer(i) + dense]
    m, h = spec.moe, spec.hidden_size
    sparse = [(h, 2 * m.expert_intermediate_size), (m.expert_intermediate_size, h)] * m.num_experts
    if m.shared_intermediate_size:
        sparse += [(h, 2 * m.shared_intermediate_size), (m.shared_intermediate_size, h)]
    return [s for i in range(spec.num_layers) for s in mixer(i) + (sparse if m.is_sparse(i) else dense)]


def _router_parameters(spec: ModelSpec) -> int:
    """MoE routers (float32 in every build): weight, bias, score correction, shared-expert gate."""
    m = spec.moe
    if m is None:
        return 0
    per = spec.hidden_size * m.num_experts + m.num_experts * (m.router_bias + m.score_correction_bias) \
        + spec.hidden_size * m.shared_gate
    return per * len(m.sparse_layers)


def _mla_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """[K, N] of an MLA layer's 2-D matmuls (exporter/mla.py linears, and o_proj)."""
    m, h, d = spec.mla, spec.num_heads, spec.hidden_size
    qk = h * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    q = [(d, qk)] if m.q_lora_rank is None else [(d, m.q_lora_rank), (m.q_lora_rank, qk)]
    return q + [(d, m.row_width), (h * m.v_head_dim, d)]


def _mla_float32(spec: ModelSpec) -> int:
    """Elements of every MLA layer's absorbed W_UK [H, N, L] and W_UV [H, L, V]: float32 in every
    build, quantized or fp16 (exporter/mla.py linears NOTE); 0 for other attention."""
    m = spec.mla
    return 0 if m is None else spec.num_layers * spec.num_heads * m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim)


def _layer_biases(spec: ModelSpec) -> int:
    """Biases of one (attention) layer, elements."""
    qkv = ((2 if spec.attn_output_gate else 1) * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    if spec.mla is not None:  # attention_bias: q_a_proj (q_lora_rank) and kv_a_proj_with_mqa only
        qkv = (spec.mla.q_lora_rank or 0) + spec.mla.row_width
    up = 2 * spec.intermediate_size if spec.gated_mlp else spec.intermediate_size
    return qkv * spec.qkv_bias + spec.hidden_size * spec.o_bias + (up + spec.hidden_size) * spec.mlp_bias


def _norm_parameters(spec: ModelSpec) -> int:
    """Every norm weight (and layernorm bias) of the model, elements."""
    per_norm = spec.hidden_size * (2 if spec.norm == "layernorm" else 1)
    norms = {"pre": 2, "post": 2, "sandwich": 4}[spec.layer_norms]
    qk = {None: 0, "head": 2 * spec.head_dim, "all": (spec.num_heads + spec.num_kv_heads) * spec.head_dim}[spec.qk_norm]
    if spec.mla is not None:  # q_a_layernorm, kv_a_layernorm
        qk = (spec.mla.q_lora_rank or 0) + spec.mla.kv_lora_rank
    attention_layers = spec.num_layers - (len(spec.linear_attn.layers) if spec.linear_attn is not None else 0)
    return spec.num_layers * norms * per_norm + attention_layers * qk + per_norm  # + the final norm


def _rope_bytes(spec: ModelSpec, max_len: int) -> int:
    """cos/sin tables [max_len, rotary_dim / 2] float32 per RoPE kind (longrope: two sets)."""
    if spec.position != "rope":
        return 0
    kinds = {spec.rope_kind(i) for i in range(spec.num_layers)} - {"none"}
    sets = 2 if spec.rope is not None and spec.rope.rope_type == "longrope" else 1
    return len(kinds) * sets * max_len * spec.rotary_dim * 4


def _quantized_bytes(k: int, n: int, bits: int, block: int, act: int) -> int:
    """Codes (int4: two per byte) + one scale per block of `block` rows of K (0: per column)."""
    blocks = -(-k // block) if block else 1
    return -(-k * n * bits // 8) + blocks * n * act


def _weight_block(spec: ModelSpec, precision: str) -> int:
    """Rows of K per scale of an int8/int4 build of `spec`: its default form's, except where that
    form's method is refused (MoE and MLA builds take no calibrated method: weight_sources.py,
    mla.py check_build), which then build `--quant-method rtn` in blocks of FALLBACK_WEIGHT_BLOCK."""
    block, method = DEFAULT_WEIGHT_FORM[precision]
    if method in CALIBRATED_METHODS and (spec.moe is not None or spec.mla is not None):
        return FALLBACK_WEIGHT_BLOCK
    return block


def weights_estimate(spec: ModelSpec, precision: str, max_len: int) -> WeightsEstimate:
    """The weights file of a `precision` build of `spec` serving `max_len` tokens (RoPE tables)."""
    if precision not in WEIGHT_PRECISIONS:
        raise ConfigError(f"--weights must be one of {', '.join(WEIGHT_PRECISIONS)}, got {precision!r}")
    act, shapes = ACT_BYTES[precision], _model_matmul_shapes(spec)
    # NOTE: some matmuls stay in the activation dtype in every build (exporter/quantize.py float_linears
    # quantizes the attention's qkv / o, the MLPs and the experts only)
    float_shapes = _float_matmul_shapes(spec)
    table = spec.vocab_size * spec.hidden_size
    tables = 1 if spec.tie_embeddings else 2
    pos = spec.max_positions * spec.hidden_size if spec.position == "learned" else 0
    matmul = sum(k * n for k, n in shapes)
    biases = _layer_biases(spec) * spec.num_layers
    if spec.linear_attn is not None:  # an LFM2 short conv's in_proj / out_proj biases (conv_bias)
        biases += spec.linear_attn.bias_elements()
    if spec.moe is not None and spec.moe.expert_bias:  # gpt_oss: each expert's up and down biases
        biases += len(spec.moe.sparse_layers) * spec.moe.num_experts * (2 * spec.moe.expert_intermediate_size
                                                                          + spec.hidden_size)
    norms = _norm_parameters(spec) + _router_parameters(spec) + _mla_float32(spec) + _linear_attn_float32(spec)
    if precision in BITS:
        block = _weight_block(spec, precision)
        head_block = block or HEAD_CHANNEL_BUILDS_BLOCK
        matmul_bytes = sum(_quantized_bytes(k, n, BITS[precision], block, act) for k, n in shapes)
        matmul_bytes += sum(k * n * act - _quantized_bytes(k, n, BITS[precision], block, act) for k, n in float_shapes)
        table_bytes = tables * _quantized_bytes(spec.hidden_size, spec.vocab_size, HEAD_BITS, head_block, act)
    else:
        matmul_bytes, table_bytes = matmul * act, tables * table * act
    matmul_bytes += biases * act
    table_bytes += pos * act
    f32 = norms * 4 + _rope_bytes(spec, max_len)
    parameters = matmul + biases + tables * table + pos + norms
    return WeightsEstimate(precision, _weight_block(spec, precision) if precision in BITS else None, parameters,
                           matmul_bytes + table_bytes + f32, matmul_bytes, table_bytes, f32)

