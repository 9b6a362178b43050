"""The `kvexport::PagedMLA` op: absorbed multi-head latent attention (DeepSeek-V2/V3, Kimi K2)
over a paged pool holding one latent row per token per layer — inputs, outputs, attributes,
aliasing, int8 scales, tolerances.

One spec, shared by every implementation (the float64 reference, the native CPU op, the Triton
kernels, the TensorRT plugin, the onnxruntime-extensions harness) and by the exporter's
`--attention plugin` graphs of MLA families. Contract agreed with the exporter/runtime work
(issue 24); names shared with PagedAttention (domain, version) live in `kvexport.io`.

Notation: H query heads, L = kv_lora_rank, R = qk_rope_head_dim, W = L + R (one pool row).

Semantics (the reference in `reference.py` is the executable definition):

    MLA caches, per token, c = kv_a_layernorm(c_kv) [L] and the shared rotated RoPE key
    k_rope [R]; row = c | k_rope [W]. Head h's key is k_h = W_UK_h c | k_rope and its value
    v_h = W_UV_h c. Folding W_UK into the query (q_h = q_nope_h W_UK_h | q_rope_h, computed by
    the graph) gives q_h · row = q_nope_h · (W_UK_h c) + q_rope_h · k_rope = the original score,
    so attention runs over the rows themselves and returns the attended latent; the graph
    applies W_UV (and o_proj) afterwards ("absorbed" MLA, DeepSeek-V2 §2.1.2):

    for each sequence s with q_len = qsl[s+1] - qsl[s] new tokens and ctx = seq_lens[s] - q_len
    rows already in the pool:
      1. store: token t's row latent[t] goes to slot_mapping[t] (= block * block_size + offset)
         of the pool, quantized when kv_dtype is int8; slot < 0 means "do not store" (padding);
      2. attend: new token i (position p = ctx + i) of sequence s reads the rows at positions
         j = 0..p of s, row j at block_tables[s, j // block_size], offset j % block_size — read
         back from the pool, so this step's rows are seen exactly as stored (rounded to kv_dtype);
         s_hj = scale * query[t, h, :] · row_j   (all W channels)
         output[t, h, :] = sum_j softmax_j(s_hj) * row_j[:L]   (the latent part only)

Inputs (in order)::

    0 query           [num_tokens, num_heads, W]   float32 | float16 | bfloat16  absorbed query
                      (q_nope_h @ W_UK_h [L] | rotated q_rope_h [R])
    1 latent          [num_tokens, W]              same dtype: this step's rows
                      (kv_a_layernorm(c_kv) [L] | rotated k_rope [R])
    2 latent_cache    [1, num_blocks, block_size, W]  kv dtype
                      NOTE rank 4 with a leading 1 (a single "KV head", io.paged_pool_shape with
                      num_kv_heads 1), so the runtime's block copies, tiers and transfers treat it
                      like a PagedAttention key pool.
    3 block_tables    [num_seqs, max_blocks] int64   (padded with io.PAD_BLOCK_ID)
    4 seq_lens        [num_seqs] int64               KV length after this step
    5 query_start_loc [num_seqs + 1] int64           cumulative new-token offsets
    6 slot_mapping    [num_tokens] int64             slot < 0: not stored
    7 kv_scale        [W] float32                    int8: static per-channel scale, x ≈ code * scale;
                                                     float pools: present but ignored (ones)

    NOTE: always 8 inputs: `tensorrt.plugin` has no optional inputs (as PagedAttention).

Outputs::

    0 output          [num_tokens, num_heads, L]   query dtype
    1 latent_cache_out  aliased to input 2 (updated in place)

Attention scores (optional; importance eviction, runtime/core/importance.py — PagedAttention's
"Attention scores" for the latent pool): a node of a build that declares scoring (manifest
kv.attention_scores) has a 9th input and a 3rd output::

    8 observation_lens [num_seqs] int64    each sequence's last min(observation_lens[s], q_len) new
                                           tokens are observation queries (0: none)
    2 attention_scores [num_seqs, 1, max_blocks * block_size] float32
        scores[s, 0, j] = sum over the observation queries i of s and all H query heads h
                          of softmax_j(s_hij), the probabilities `attend` uses; 0 at positions
                          nothing attends to

    NOTE (one row per sequence, not per head): the pool has one latent "KV head" that every query
    head reads, so a block is kept or dropped for all heads at once; the scores are pooled over the
    whole group (all H heads), exactly as PagedAttention pools the G query heads of a KV head, and
    the runtime reads [num_seqs, kv_heads = 1, score_len] like any other layer's. Implemented by the
    reference (`reference.attention_scores`), the native CPU op and the Triton kernels
    (launch.attention_scores_triton); the MLA `onnx` attention form and the TensorRT plugin do not
    score (builds with them do not declare scores: exporter/build.py scores_declared).

Attributes (per node): num_heads, kv_lora_rank, qk_rope_head_dim, block_size, scale (required:
DeepSeek's softmax scale, (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 times yarn's mscale²
when the config's rope_scaling asks for it — the op does not derive it), kv_dtype.

INT8 KV: static symmetric scales per channel of the row ([W], from calibration: the calibration
text's absmax of each channel / 127); code = saturate_int8(round_half_even(f32(x / scale))) —
exactly onnxruntime's QuantizeLinear with zero point 0, as PagedAttention's int8 — read back as
code * scale. Per channel because the two halves differ in kind: the latent channels carry
kv_a_layernorm's learned per-channel gains, the RoPE channels the rotated key's (a handful of
channels is much larger than the rest). A scale per channel costs nothing at run time: the
scales fold into the query for the scores (s = sum_w (q_w * scale_w) * code_w) and into the
output for the values (out_l = scale_l * sum_j p_j * code_jl). KV bytes per token per layer:
W * element size (int8: W bytes; the scales are static).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvexport import io
from kvexport.errors import ConfigError

OP_TYPE = "PagedMLA"
NAMESPACE = io.PLUGIN_DOMAIN  # "kvexport"; also the ONNX domain of the node
VERSION = io.PLUGIN_VERSION  # "1"
PLUGIN_ID = f"{NAMESPACE}::{OP_TYPE}"  # tensorrt.plugin id

INPUTS = ("query", "latent", "latent_cache", "block_tables", "seq_lens", "query_start_loc", "slot_mapping",
          "kv_scale")
OUTPUTS = ("output", "latent_cache_out")
SCORE_INPUT = io.OBSERVATION_LENS  # optional input 8 ("Attention scores" above)
SCORE_OUTPUT = "attention_scores"  # optional output 2; the graph names it io.attention_scores(layer)
SCORE_TOLERANCE = 1e-5  # max |implementation - reference| of attention_scores (float32 sums of probabilities)
ALIASES = {1: 2}  # output index -> the input index it aliases (in-place pool update)
NUM_INPUTS = 8  # kv_scale included for every kv dtype (see the NOTE above)

KV_DTYPES = ("float32", "float16", "bfloat16", "int8")
ACT_DTYPES = ("float32", "float16", "bfloat16")

# max |implementation - reference| over outputs, by query dtype; the reference computes in
# float64. Implementations accumulate in float32; fp16/bf16 round the output once more (and the
# kernels' probabilities once, for the value dot), on outputs of magnitude ~1.
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2.4e-2}


@dataclass(frozen=True)
class PagedMLAAttrs:
    """Attributes of one PagedMLA node (one layer); also the TensorRT plugin's fields."""

    num_heads: int  # query heads H
    kv_lora_rank: int  # L: latent channels of a row (the value width)
    qk_rope_head_dim: int  # R: rotated shared-key channels after the latent
    block_size: int  # tokens per KV block
    scale: float  # softmax scale applied to q · row (DeepSeek: incl. yarn mscale²)
    kv_dtype: str = "float32"  # element type of the pool: one of KV_DTYPES

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"PagedMLA: {name} must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim < 0:
            raise ConfigError(f"PagedMLA: qk_rope_head_dim must be >= 0, got {self.qk_rope_head_dim}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"PagedMLA: kv_dtype {self.kv_dtype!r} is not one of {KV_DTYPES}")
        if not self.scale > 0:
            raise ConfigError(f"PagedMLA: scale must be > 0, got {self.scale}")

    @property
    def row_width(self) -> int:
        """W = kv_lora_rank + qk_rope_head_dim: elements of one pool row (one token)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def quantized(self) -> bool:
        """int8: static per-channel scales (the kv_scale input)."""
        return self.kv_dtype == "int8"

    def pool_shape(self, num_blocks: int) -> tuple:
        """One layer's pool: [1, num_blocks, block_size, W] (io.paged_pool_shape, one KV head)."""
        return io.paged_pool_shape(num_blocks, 1, self.block_size, self.row_width, self.kv_dtype)

    def onnx_attributes(self) -> dict:
        """Attributes of the ONNX node (TensorRT's ONNX parser passes them to the plugin as
        fields; plugin_namespace / plugin_version select the registered plugin)."""
        d = asdict(self)
        d["plugin_namespace"] = NAMESPACE
        d["plugin_version"] = VERSION
        return d

    @classmethod
    def from_onnx_attributes(cls, attrs: dict) -> "PagedMLAAttrs":
        known = {k: v for k, v in attrs.items() if k in cls.__dataclass_fields__}
        if isinstance(known.get("kv_dtype"), bytes):
            known["kv_dtype"] = known["kv_dtype"].decode()
        return cls(**known)


def kv_bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, element_bytes: int) -> int:
    """KV cache bytes per token of an MLA model: layers × (kv_lora_rank + qk_rope_head_dim) × bytes
    (int8: 1 byte; its scales are static, not per token)."""
    return num_layers * (kv_lora_rank + qk_rope_head_dim) * element_bytes
