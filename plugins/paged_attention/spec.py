"""The `kvexport::PagedAttention` op: inputs, outputs, attributes, aliasing, tolerances.

One spec, shared by every implementation (numpy reference, Triton kernels, the TensorRT
plugin, the onnxruntime custom-op harness) and by the exporter's `--attention plugin`
graphs. The ONNX node and the TensorRT plugin share the name constants in `kvexport.io`.

Semantics (the reference in `reference.py` is the executable definition):

    for each sequence s with q_len = qsl[s+1] - qsl[s] new tokens and ctx = seq_lens[s] - q_len
    tokens already in the pool:
      1. store: token t of this step goes to slot_mapping[t] (= block * block_size + offset) of
         the pool, quantized when kv_dtype is int8 or int4; slot < 0 means "do not store" (padding);
      2. attend: new token i (position p = ctx + i) of sequence s reads the keys at positions
         j = 0..p of s (and only p - j < sliding_window when sliding_window > 0), key j at
         block_tables[s, j // block_size], offset j % block_size — read back from the pool,
         so this step's keys are seen exactly as stored (rounded to kv_dtype);
         s = scale * q · k; when logit_softcap > 0, s = logit_softcap * tanh(s / logit_softcap)
         (Gemma 2/3: on the scaled scores, before the mask and softmax, as transformers'
         eager attention does); out = softmax(s) · v, query head h reading KV head h // (H / kvH).

         with attention_sinks (GPT-OSS: one learned logit a_h per query head h), the sink joins
         the softmax's denominator and carries no value, as transformers' gpt_oss eager attention:
           out = sum_j exp(s_j - m) v_j / (exp(a_h - m) + sum_j exp(s_j - m)),  m = max(a_h, max_j s_j)
         (a_h is not scaled or soft-capped; masked keys take no part).

    sliding_window, logit_softcap, scale and attention_sinks are per node, so per layer: a model
    whose layers differ (Gemma 2/3: local windowed layers and global ones) has nodes that differ.
    NOTE (sinks are an attribute, not a 12th input): tensorrt.plugin has no optional inputs, and
    graphs exported before sinks existed (no attribute) must keep their meaning: absent or empty
    = no sinks. The values are float32 (an ONNX `floats` attribute), rounded so when the attrs are
    built; the Triton kernels take them as a constexpr tuple (one compiled kernel per layer).

Inputs (in order)::

    0 query           [num_tokens, num_heads, head_dim]       float32 | float16 | bfloat16
    1 key             [num_tokens, num_kv_heads, head_dim]    same as query (already rotated)
    2 value           [num_tokens, num_kv_heads, head_dim]    same as query
    3 key_cache       [num_kv_heads, num_blocks, block_size, head_dim]   kv dtype (io.paged_pool_shape)
    4 value_cache     [num_kv_heads, num_blocks, block_size, head_dim]   kv dtype
                      (int4: uint8 [.., block_size, io.kv_row_width(head_dim, "int4")], see INT4 KV)
    5 block_tables    [num_seqs, max_blocks] int64   (padded with io.PAD_BLOCK_ID)
    6 seq_lens        [num_seqs] int64               KV length after this step
    7 query_start_loc [num_seqs + 1] int64           cumulative new-token offsets
    8 slot_mapping    [num_tokens] int64
    9 k_scale         [num_kv_heads, head_dim] float32  int8: x ≈ code * scale (static, per channel);
   10 v_scale         [num_kv_heads, head_dim] float32  float and int4 pools: present but ignored (ones)
                      ([num_kv_heads]: per-head scales of builds made before per-channel ones;
                      still accepted, broadcast along head_dim)

    NOTE: always 11 inputs: `tensorrt.plugin` has no optional inputs, so float-pool graphs
    carry two ignored scale vectors rather than a second plugin signature.

Outputs::

    0 output          [num_tokens, num_heads, head_dim]       query dtype
    1 key_cache       aliased to input 3 (updated in place)
    2 value_cache     aliased to input 4 (updated in place)

Attention scores (optional; importance eviction, runtime/core/importance.py): a node of a build
that declares scoring (manifest kv.attention_scores) has a 12th input and a 4th output::

   11 observation_lens [num_seqs] int64    each sequence's last min(observation_lens[s], q_len) new
                                           tokens are observation queries (0: none)
    3 attention_scores [num_seqs, num_kv_heads, max_blocks * block_size] float32
        scores[s, h, j] = sum over the observation queries i of s and the query heads h' of KV head h
                          of softmax_j(s_{h', i, j}), the probabilities `attend` uses (soft-cap,
                          window and sinks included); 0 at positions nothing attends to

    NOTE (why an input, and not "the last w tokens" as an attribute): the runtime asks only the step
    in which a prompt completes (chunked prefill: its last chunk), so which sequences observe changes
    per step. The op computes the probabilities in a second pass over the observed rows' keys, after
    the attention: the online softmax never holds all p_j of a row, and keeping them for every row
    would cost O(rows x keys) memory for the few rows observed. Implemented by the reference
    (`reference.attention_scores`, float64), the native CPU op, the `onnx` attention form
    (exporter/attention.py) and the Triton kernels (launch.attention_scores_triton: a second kernel,
    kernels.scores_kernel, launched only for a step that observes, after the attention kernel; its dots
    in float32 whatever the activation dtype, so it meets SCORE_TOLERANCE per summed row on the GPU too).
    The TensorRT plugin does not score yet, so builds for `--backend tensorrt` do not declare scores
    (exporter/build.py scores_declared: their nodes keep 11 inputs and 3 outputs, the one
    tensorrt.plugin signature) and the runtime refuses importance eviction on them, saying so.
    NOTE (what TensorRT needs, not done): tensorrt.plugin has no optional inputs and an AOT plugin is one
    kernel launch, so scoring there is a second registration (its own plugin_version, 12 inputs and 4
    outputs) whose one kernel runs the attention tiles and, in S x kvH more programs, the scores — reading
    this step's keys from the key input as the fused store does (no ordering between programs) and
    zero-filling its own rows (TensorRT does not zero outputs); and the TensorRT backend returning the
    scores to the scheduler.

INT8 KV: static symmetric scales per KV head *and channel* (from `kvexport calibrate`: the
calibration text's absmax of each key / value channel, / 127); stored value
code = saturate_int8(round_half_even(x / scale)), x / scale computed in float32 with IEEE
rounding — exactly onnxruntime's QuantizeLinear with a zero point of 0 — and read back as
code * scale, so the `onnx` attention (Div + QuantizeLinear / DequantizeLinear + Mul, see
exporter/attention.py `to_kv`) and the plugin agree bit for bit on what the pool holds.
NOTE (why per channel): keys of models with q/k biases (Qwen2) carry a few channels tens of
times larger than the rest, at fixed channels for every token (the KIVI observation); one
scale per head spends the int8 range on them and rounds every other channel of the head to
a handful of levels. A scale per channel costs nothing at run time (the key scales fold into
the query, the value scales into the output) and keeps the pool a plain int8 tensor. The op
takes any [kvH, D] scales; `kvexport calibrate` gives keys one scale per RoPE channel pair and
values one per head, broadcast over the channels (exporter/calibrate.py says why).

INT4 KV (dynamic: nothing calibrated, k_scale / v_scale ignored): the pools are uint8 and each
(token, KV head) row holds head_dim 4-bit codes, two per byte, then one float16 scale per
group of io.KV_INT4_GROUP (32) channels (llama.cpp's q4_0 form) — io.KV_INT4_FORMAT spells out
the bytes:

    row = [ codes + 8: head_dim / 2 bytes | scale_g float16 LE, g = 0 .. head_dim / 32 - 1 ]
    e_g     = max_i x_i if max_i x_i >= -min_i x_i else min_i x_i   (the group's extreme)
    scale_g = -f16(max(|e_g| / 8, 2^-14)) if e_g >= 0 else +f16(...)  (e_g maps to code -8)
    code_i  = clamp(round_half_even(f32(x_i / scale_g)), -8, 7)       (nibble = code + 8)
    x_i    ≈ code_i * scale_g                      (exact: <= 15 significant bits)

f16 is IEEE round-to-nearest-even to float16, saturating at 65504; every other step is one
IEEE float32 operation, so the reference, the native CPU op, the `onnx` attention (standard
ops: BitShift / BitwiseAnd for the nibbles, the float16 bits by exact arithmetic) and the
Triton kernels store the same bytes. The op quantizes the keys and values it is given:
int4 graphs rotate q, k and v by a fixed orthogonal Hadamard matrix after RoPE (qᵀk is
unchanged; the output is rotated back), which spreads outlier channels over the group before
they set its range (exporter/attention.py `hadamard`; docs/QUANTIZATION.md has the measurements
that chose this scheme). Before the rotation they give it k' = (k - μ) / s and q' = q * s, a
calibrated per-channel key transform that leaves softmax attention exact (exporter/kv_int4.py
key_transform): the op sees ordinary keys and queries, nothing of it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from kvexport import io
from kvexport.errors import ConfigError

OP_TYPE = io.PLUGIN_OP  # "PagedAttention"
NAMESPACE = io.PLUGIN_DOMAIN  # "kvexport"; also the ONNX domain of the node
VERSION = io.PLUGIN_VERSION  # "1"
PLUGIN_ID = f"{NAMESPACE}::{OP_TYPE}"  # tensorrt.plugin id

INPUTS = ("query", "key", "value", "key_cache", "value_cache", "block_tables", "seq_lens",
          "query_start_loc", "slot_mapping", "k_scale", "v_scale")
OUTPUTS = ("output", "key_cache_out", "value_cache_out")
SCORE_INPUT = io.OBSERVATION_LENS  # optional input 11 ("Attention scores" above)
SCORE_OUTPUT = "attention_scores"  # optional output 3; the graph names it io.attention_scores(layer)
SCORE_TOLERANCE = 1e-5  # max |native op - reference| of attention_scores (float32 sums of probabilities)
ALIASES = {1: 3, 2: 4}  # output index -> the input index it aliases (in-place pool update)
NUM_INPUTS = 11  # scales included for every kv dtype (see the NOTE above)
# The TensorRT form of the scores ("Attention scores", NOTE on TensorRT): a node of its own after the
# attention node — no optional inputs in tensorrt.plugin, and one kernel per AOT plugin — taking the
# updated key pool (the attention node's key_cache_out: the data dependence orders it after the store)
# and the node's attributes, returning attention_scores [num_seqs, num_kv_heads, max_blocks * block_size]
# float32 (every element written: no zeroing needed). Registered by trt.py; no exporter emits it yet.
SCORES_OP_TYPE = "PagedAttentionScores"
SCORES_PLUGIN_ID = f"{NAMESPACE}::{SCORES_OP_TYPE}"
SCORES_INPUTS = ("query", "key_cache", "block_tables", "seq_lens", "query_start_loc", "k_scale", SCORE_INPUT)

KV_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
ACT_DTYPES = ("float32", "float16", "bfloat16")

# max |implementation - reference| over outputs, by query dtype; the reference computes in
# float64. Kernels accumulate in float32; fp16/bf16 inputs round the output once more.
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


@dataclass(frozen=True, slots=True)
class PagedAttentionAttrs:
    """Attributes of one PagedAttention node (one layer)."""

    num_heads: int  # query heads
    num_kv_heads: int  # KV heads; num_heads % num_kv_heads == 0 (MHA: equal, MQA: 1)
    head_dim: int  # elements per head
    block_size: int  # tokens per KV block
    scale: float  # softmax scale applied to q · k (usually head_dim ** -0.5)
    sliding_window: int = 0  # keys visible to a query, itself included; 0 = unlimited
    kv_dtype: str = "float32"  # element type of the pool: one of KV_DTYPES
    logit_softcap: float = 0.0  # s = cap * tanh(s / cap) on scaled scores before softmax; 0 = off
    attention_sinks: tuple[float, ...] = ()  # num_heads learned sink logits (float32 values); () = none

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"PagedAttention: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"PagedAttention: num_heads {self.num_heads} is not a multiple of "
                              f"num_kv_heads {self.num_kv_heads}")
        if self.sliding_window < 0:
            raise ConfigError(f"PagedAttention: sliding_window must be >= 0, got {self.sliding_window}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"PagedAttention: kv_dtype {self.kv_dtype!r} is not one of {KV_DTYPES}")
        if self.kv_dtype == "int4" and self.head_dim % io.KV_INT4_GROUP:
            raise ConfigError(f"PagedAttention: kv_dtype int4 needs head_dim a multiple of {io.KV_INT4_GROUP} "
                              f"(groups of channels share a scale), got {self.head_dim}: use --kv-dtype int8 or fp32")
        if not self.logit_softcap >= 0:
            raise ConfigError(f"PagedAttention: logit_softcap must be >= 0, got {self.logit_softcap}")
        if not self.scale > 0:
            raise ConfigError(f"PagedAttention: scale must be > 0, got {self.scale}")
        sinks = tuple(float(x) for x in np.asarray(self.attention_sinks, dtype=np.float32).reshape(-1))
        if sinks and len(sinks) != self.num_heads:
            raise ConfigError(f"PagedAttention: attention_sinks must list one value per query head "
                              f"({self.num_heads}), got {len(sinks)}")
        if not all(math.isfinite(x) for x in sinks):
            raise ConfigError(f"PagedAttention: attention_sinks must be finite, got {sinks}")
        object.__setattr__(self, "attention_sinks", sinks)  # float32 values, as the ONNX attribute holds them

    @property
    def group_size(self) -> int:  # query heads per KV head
        return self.num_heads // self.num_kv_heads

    @property
    def quantized(self) -> bool:
        """int8: static per-channel scales (k_scale / v_scale inputs)."""
        return self.kv_dtype == "int8"

    @property
    def int4(self) -> bool:
        """int4: codes and per-token group scales in the pool rows (the scale inputs ignored)."""
        return self.kv_dtype == "int4"

    @property
    def row_width(self) -> int:
        """Elements of one pool row (one token of one KV head): io.kv_row_width."""
        return io.kv_row_width(self.head_dim, self.kv_dtype)

    def onnx_attributes(self) -> dict:
        """Attributes of the ONNX node (TensorRT's ONNX parser passes them to the plugin as
        fields; plugin_namespace / plugin_version select the registered plugin)."""
        d = asdict(self)
        if self.attention_sinks:
            d["attention_sinks"] = list(self.attention_sinks)
        else:  # NOTE: left out, so graphs without sinks are the ones exported before sinks existed
            del d["attention_sinks"]
        d["plugin_namespace"] = NAMESPACE
        d["plugin_version"] = VERSION
        return d

    @classmethod
    def from_onnx_attributes(cls, attrs: dict) -> "PagedAttentionAttrs":
        known = {k: v for k, v in attrs.items() if k in cls.__dataclass_fields__}
        for k in ("kv_dtype",):
            if isinstance(known.get(k), bytes):
                known[k] = known[k].decode()
        sinks = known.get("attention_sinks")
        if isinstance(sinks, bytes):
            sinks = sinks.decode()
        if isinstance(sinks, str):  # the reference harness (ort.py) passes them as text
            sinks = [float(x) for x in sinks.split(",") if x.strip()]
        if sinks is not None:
            known["attention_sinks"] = tuple(np.asarray(sinks, dtype=np.float32).reshape(-1).tolist())
        return cls(**known)
