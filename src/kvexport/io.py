"""The one contract between exporter, plugins and runtime.

This module owns every graph tensor name, its dtype and its axes, the KV layouts,
attention variants and KV dtypes. The exporter emits exactly these names, the runtime
binds exactly these names, the plugins implement the attention they describe.
Nobody else spells a tensor name.

Layouts
-------
``contiguous`` (optimum / onnxruntime-genai compatible)::

    input_ids [batch, seq] int64, attention_mask [batch, total_seq] int64,
    position_ids [batch, seq] int64, past_key_values.{i}.key/value
    [batch, kv_heads, past_seq, head_dim]  ->  logits [batch, seq|1, vocab],
    present.{i}.key/value [batch, kv_heads, total_seq, head_dim]

    Prompts in one batch are left-padded; ``attention_mask`` marks real tokens.
    The prefill graph has no ``past_key_values`` inputs and returns the last token's logits
    (every token's with all_logits). The decode graph takes any ``seq`` (1 per step; the
    whole prompt with ``past_seq`` 0 when a tool runs it as its only graph) and returns
    logits for every token it is given.

``paged`` (production): tokens of all sequences are packed (no padding)::

    input_ids [num_tokens] int64       this step's tokens, sequence after sequence
    positions [num_tokens] int64       position of each token in its sequence
    query_start_loc [num_seqs+1] int64 cumulative token offsets (0, q0, q0+q1, ...)
    seq_lens [num_seqs] int64          KV length of each sequence after this step
    block_tables [num_seqs, max_blocks] int64   physical block ids, padded with PAD_BLOCK_ID
    slot_mapping [num_tokens] int64    block_id * block_size + offset for each new token
    key_cache.{i}/value_cache.{i} [kv_heads, num_blocks, block_size, head_dim]
    -> logits [num_seqs|num_tokens, vocab],
       new_key.{i}/new_value.{i} [num_tokens, kv_heads, head_dim]

    NOTE: with the ``onnx`` attention the graph reads the pool but never writes it
    (ONNX has no in-place update; copying a whole pool per step would cost O(pool)).
    It returns this step's K/V and the runtime stores them at ``slot_mapping``.
    ``block_tables`` then only needs the blocks holding earlier steps' KV.

``paged`` + ``plugin`` attention: the same inputs; one ``kvexport::PagedAttention`` node
per layer stores this step's K/V into the pool itself (TensorRT: in place, the output
aliases the input) and reads everything back from it, so ``block_tables`` must cover
``seq_lens`` (this step's blocks too)::

    -> logits, key_cache_out.{i}/value_cache_out.{i} [kv_heads, num_blocks, block_size, head_dim]

KV cache groups (paged builds of models whose layers differ in window: gemma2, gemma3,
qwen3 with max_window_layers): the windowed layers keep their KV in a second group,
``local``, with its own, smaller pools and block tables, so the runtime can release its
blocks behind the window while the full-attention layers (group ``full``, today's names)
keep every block::

    block_tables.local [num_seqs, max_blocks] int64, slot_mapping.local [num_tokens] int64
    key_cache.{i}/value_cache.{i} of a windowed layer [kv_heads, num_blocks.local, block_size, head_dim]

    Block ``j`` of a local table still means positions ``j*block_size..``; blocks the window
    released are PAD_BLOCK_ID. seq_lens, query_start_loc and positions are shared. Builds whose
    layers all have the same window (or none) have one group and exactly the I/O above.

MLA (multi-head latent attention, DeepSeek-V2/V3; paged only): a layer's KV cache is ONE latent pool
(no value pool), one row per token of kv_lora_rank + qk_rope_head_dim elements (the normed KV
latent, then the RoPE-rotated shared key), shaped like a single-KV-head key pool so block copies,
tiers and transfers move it like any pool (the manifest's kv.num_kv_heads is 1, kv.head_dim the
row width, kv.latent_rank the kv_lora_rank)::

    latent_cache.{i} [1, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
    -> new_latent.{i} [num_tokens, 1, row]  (onnx attention)  |  latent_cache_out.{i} (plugin: kvexport::PagedMLA)

int8 KV: static symmetric scales per layer, KV head and channel (``kvexport calibrate``),
stored in both graphs as float32 initializers ``kv_scales.{i}.key/value`` [kv_heads, head_dim]
([kv_heads] in builds made before per-channel scales) and in the manifest; pools hold
``saturate(round_half_even(x / scale))`` (ONNX QuantizeLinear).

int4 KV: dynamic scales (the key transform before them is calibrated: `k_offset`), per
token, KV head and group of ``KV_INT4_GROUP`` channels. The pools are uint8 and each (token, KV head) row of
``kv_row_width(head_dim, "int4")`` bytes holds the codes and their scales (`KV_INT4_FORMAT`);
the int4 graphs rotate q, k and v by a fixed orthogonal Hadamard matrix after RoPE
(exporter/attention.py `hadamard`), so the pools hold rotated keys and values (keys as
rotate((k - μ) / s): exporter/kv_int4.py calibrate_transform).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

SCHEMA_VERSION = 1
MANIFEST_NAME = "kvexport.json"
WEIGHTS_FILE = "weights.data"
TOKENIZER_DIR = "tokenizer"
PREFILL_GRAPH = "prefill.onnx"
DECODE_GRAPH = "decode.onnx"
# side files for other tools (exporter/interop.py): optimum / transformers, onnxruntime-genai
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
GENAI_CONFIG = "genai_config.json"  # contiguous builds only
ROOT_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # copies of tokenizer/'s, for onnxruntime-genai
INTEROP_FILES = (HF_CONFIG, GENERATION_CONFIG, GENAI_CONFIG, *ROOT_TOKENIZER_FILES)

# Block 0 of every pool is never handed out; padded block-table entries point to it
# so a gather stays in bounds. Its contents are always masked out.
PAD_BLOCK_ID = 0

ONNX_OPSET = 18
QDQ_OPSET = 21  # quantized-weight builds: block-wise DequantizeLinear (opset 21) with INT4/INT8 weights
PLUGIN_DOMAIN = "kvexport"
PLUGIN_OP = "PagedAttention"
PLUGIN_VERSION = "1"
MLA_PLUGIN_OP = "PagedMLA"  # MLA layers' node in PLUGIN_DOMAIN (plugins/paged_mla/spec.py)
# what runs a build's graphs: the runtime's --backend, and the backend a build is made for
# (`kvexport build --backend`; tensorrt builds also hold TensorRT engines)
BACKENDS = ("onnxruntime", "tensorrt")


class KVLayout(str, enum.Enum):
    CONTIGUOUS = "contiguous"
    PAGED = "paged"


class Attention(str, enum.Enum):
    ONNX = "onnx"  # standard ONNX ops; runs on onnxruntime CPU
    PLUGIN = "plugin"  # one kvexport::PagedAttention node per layer (TensorRT plugin)


class DType(str, enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"  # reserved for GPU engines
    INT8 = "int8"  # KV only, with static per-channel scales
    INT4 = "int4"  # KV only: 4-bit codes with dynamic per-token group scales in the pool (KV_INT4_FORMAT)

    @property
    def numpy_name(self) -> str:
        """The element type's name (PagedAttention's kv_dtype attribute); "int4" is not a numpy
        dtype: its pools are `pool_dtype` (uint8)."""
        return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8", "int4": "int4"}[self.value]

    @property
    def pool_dtype(self) -> str:
        """The numpy / ONNX element type of KV pools and of graph KV tensors in this dtype."""
        return kv_element_type(self.numpy_name)

    @property
    def itemsize(self) -> int:
        """Bytes per element of the pools' last axis (int4: one byte of `kv_row_width`)."""
        return {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 1}[self.value]


# int4 KV rows (one per token and KV head, uint8): the 4-bit codes of head_dim channels, two
# per byte, then per group of KV_INT4_GROUP channels its scale as float16 (llama.cpp's q4_0 form):
#   bytes [0, D/2)         channel 2i in the low nibble of byte i, 2i+1 in the high one (nibble = code + 8)
#   bytes [D/2 + 2g, +2)   scale_g (float16, little-endian)
# x ≈ code * scale_g, code = clamp(round_half_even(x / scale_g), -8, 7); the group's extreme
# e = max if max >= -min else min maps to -8: s = f16(max(|e| / 8, 2^-14)), scale_g = -s if
# e >= 0 else s; f16 = IEEE round-to-nearest-even to float16 (saturating at 65504), every step
# in float32. Dequantized values are exact float32 (code * scale_g has <= 15 significant bits).
# This form won the measurement (docs/QUANTIZATION.md "int4 KV"). plugins/paged_attention/spec.py
# is the definition, reference.py the executable one.
KV_INT4_GROUP = 32  # channels per scale
KV_INT8_QMAX = 127.0  # int8 KV: codes in [-127, 127], scale = absmax / KV_INT8_QMAX (the manifest's "qmax")
KV_INT4_FORMAT = "int4-q4_0-g32-f16-hadamard"  # the manifest's kv.quantization["scheme"]


def kv_element_type(kv_dtype: str) -> str:
    """Element type (numpy / ONNX name) of pools and KV tensors of kv_dtype (a numpy_name)."""
    return "uint8" if kv_dtype == "int4" else kv_dtype


def kv_row_width(head_dim: int, kv_dtype: str) -> int:
    """Length of the pools' last axis (one token of one KV head): head_dim, or for int4
    head_dim / 2 code bytes + 2 bytes per group (KV_INT4_FORMAT). kv_dtype: a numpy_name."""
    if kv_dtype != "int4":
        return head_dim
    if head_dim % KV_INT4_GROUP:
        raise ValueError(f"int4 KV needs head_dim a multiple of {KV_INT4_GROUP}, got {head_dim}")
    return head_dim // 2 + 2 * (head_dim // KV_INT4_GROUP)


class Phase(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


# ---- tensor names -------------------------------------------------------------------
INPUT_IDS = "input_ids"
LOGITS = "logits"
# contiguous
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
# paged
POSITIONS = "positions"
QUERY_START_LOC = "query_start_loc"
SEQ_LENS = "seq_lens"
BLOCK_TABLES = "block_tables"
SLOT_MAPPING = "slot_mapping"
# logits where they are asked for (speculative decoding, echo; paged builds that declare it):
# the packed token rows (ascending indices into input_ids) whose logits the step returns, vLLM's
# `logits_indices`. The runtime asks for each sequence's last token (plain decode), the 1 + k rows of
# a verified draft, or the prompt rows of an echo / prompt_logprobs request.
#   logits_indices [num_logits] int64  ->  logits [num_logits, vocab]
LOGITS_INDICES = "logits_indices"
# importance eviction (paged builds that declare it): each sequence's last `observation_lens[s]`
# tokens of this step are observation queries (0: none); `attention_scores.{i}` is, per sequence and
# KV head, the softmax attention mass those queries (all query heads of the KV head's group, summed)
# give each KV position j of the sequence (block table entry j // block_size; positions the step
# does not attend to are 0).
#   observation_lens [num_seqs] int64  ->  attention_scores.{i} [num_seqs, kv_heads, score_len] float32
OBSERVATION_LENS = "observation_lens"
# KV cache groups (see the module docstring): the full group uses the names above
FULL_GROUP = "full"
LOCAL_GROUP = "local"


def kv_groups(layer_windows) -> tuple[str, ...]:
    """Each layer's KV cache group: LOCAL_GROUP for windowed layers of a model that also has
    full-attention layers, else FULL_GROUP (one group: uniform windows, or differing windows
    with no full-attention layer, whose blocks are all kept)."""
    windows = tuple(layer_windows)
    hybrid = None in windows and any(w is not None for w in windows)
    return tuple(LOCAL_GROUP if hybrid and w is not None else FULL_GROUP for w in windows)


def block_tables(group: str) -> str:
    """The block-table input of a KV cache group."""
    return BLOCK_TABLES if group == FULL_GROUP else f"{BLOCK_TABLES}.{group}"


def slot_mapping(group: str) -> str:
    """The slot-mapping input of a KV cache group."""
    return SLOT_MAPPING if group == FULL_GROUP else f"{SLOT_MAPPING}.{group}"


def num_blocks_axis(group: str) -> str:
    """The dynamic pool axis of a KV cache group's layers."""
    return NUM_BLOCKS if group == FULL_GROUP else f"{NUM_BLOCKS}.{group}"


def past_key(i: int) -> str:
    return f"past_key_values.{i}.key"


def past_value(i: int) -> str:
    return f"past_key_values.{i}.value"


def present_key(i: int) -> str:
    return f"present.{i}.key"


def present_value(i: int) -> str:
    return f"present.{i}.value"


def key_cache(i: int) -> str:
    return f"key_cache.{i}"


def value_cache(i: int) -> str:
    return f"value_cache.{i}"


def new_key(i: int) -> str:
    return f"new_key.{i}"


def new_value(i: int) -> str:
    return f"new_value.{i}"


def key_cache_out(i: int) -> str:
    return f"key_cache_out.{i}"


def value_cache_out(i: int) -> str:
    return f"value_cache_out.{i}"


def attention_scores(i: int) -> str:
    """Layer i's attention mass per KV position for the observation queries (OBSERVATION_LENS)."""
    return f"attention_scores.{i}"


def latent_cache(i: int) -> str:
    """MLA: layer i's latent pool (the module docstring)."""
    return f"latent_cache.{i}"


def new_latent(i: int) -> str:
    return f"new_latent.{i}"


def latent_cache_out(i: int) -> str:
    return f"latent_cache_out.{i}"


def pool_names(num_layers: int, latent: bool = False) -> list[str]:
    """Every layer's pool inputs, in graph order: key_cache.{i}, value_cache.{i} per layer, or an
    MLA build's latent_cache.{i}. The runtime allocates, binds and copies exactly these."""
    return [n for i in range(num_layers) for n in ((latent_cache(i),) if latent else (key_cache(i), value_cache(i)))]


def pool_layers(num_layers: int, latent: bool = False) -> list[int]:
    """The layer of each of `pool_names`' pools."""
    return [i for i in range(num_layers) for _ in range(1 if latent else 2)]


def new_kv_names(num_layers: int, latent: bool = False) -> list[str]:
    """The `onnx` attention's per-step KV outputs, one per pool of `pool_names` (same order)."""
    return [n for i in range(num_layers) for n in ((new_latent(i),) if latent else (new_key(i), new_value(i)))]


def pool_out_names(num_layers: int, latent: bool = False) -> list[str]:
    """The plugin attention's updated-pool outputs, one per pool of `pool_names` (same order)."""
    return [n for i in range(num_layers)
            for n in ((latent_cache_out(i),) if latent else (key_cache_out(i), value_cache_out(i)))]


def latent_scale(i: int) -> str:
    """int8 MLA KV: graph initializer [kv_lora_rank + qk_rope_head_dim] float32, layer i's latent scales."""
    return f"kv_scales.{i}.latent"


def k_scale(i: int) -> str:
    """int8 KV: graph initializer [kv_heads] float32 with layer i's key scales."""
    return f"kv_scales.{i}.key"


def v_scale(i: int) -> str:
    return f"kv_scales.{i}.value"


def k_offset(i: int) -> str:
    """int4 KV: graph initializer [kv_heads, head_dim] float32, layer i's key offset μ (subtracted
    from the post-RoPE keys before they are rotated and stored; exporter/kv_int4.py calibrate_transform)."""
    return f"kv_offsets.{i}.key"


def k_channel_scale(i: int) -> str:
    """int4 KV: [kv_heads, head_dim] float32, layer i's key channel scales s (keys / s, queries *
    s: q_channel_scale, the same per query head)."""
    return f"kv_offsets.{i}.key_scale"


def q_channel_scale(i: int) -> str:
    return f"kv_offsets.{i}.query_scale"


# ---- dynamic axis names ---------------------------------------------------------------
BATCH = "batch"
SEQ = "seq"
PAST_SEQ = "past_seq"
TOTAL_SEQ = "total_seq"
NUM_TOKENS = "num_tokens"
NUM_SEQS = "num_seqs"
NUM_SEQS_PLUS_1 = "num_seqs_plus_1"
MAX_BLOCKS = "max_blocks_per_seq"
NUM_BLOCKS = "num_blocks"
NUM_LOGITS = "num_logits"  # rows of LOGITS_INDICES
SCORE_LEN = "score_len"  # KV positions an attention_scores row covers (max_blocks_per_seq * block_size)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One graph input or output: name, element type ('int64', 'float32', ...), shape
    with ints for fixed axes and axis names (above) for dynamic ones."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True, slots=True)
class GraphIO:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


def graph_io(
    *,
    layout: KVLayout,
    phase: Phase,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    block_size: int,
    act_dtype: str,
    kv_dtype: str,
    all_logits: bool,
    attention: Attention = Attention.ONNX,
    layer_groups: tuple[str, ...] | None = None,
    latent: bool = False,
) -> GraphIO:
    """Every input and output of one graph, in order. The exporter declares exactly
    these; the runtime feeds exactly these. `layer_groups`: each layer's KV cache group
    (`kv_groups`; paged only); None: every layer in FULL_GROUP. `latent`: an MLA build
    (paged only; num_kv_heads 1 and head_dim the latent row width)."""
    if layout is KVLayout.CONTIGUOUS:
        if latent:
            raise ValueError("MLA builds are paged only")
        # NOTE: decode's sequence axis is dynamic too (one token per step in the runtime): the decode
        # graph is then also a single "decoder with past" that optimum's ORTModelForCausalLM and
        # onnxruntime-genai's `decoder` type run on the prompt (empty past) and every step; its
        # attention mask is causal over past + new tokens already, so nothing else changes
        seq = SEQ
        inputs = [
            TensorSpec(INPUT_IDS, "int64", (BATCH, seq)),
            TensorSpec(ATTENTION_MASK, "int64", (BATCH, TOTAL_SEQ)),
            TensorSpec(POSITION_IDS, "int64", (BATCH, seq)),
        ]
        elem, row = kv_element_type(kv_dtype), kv_row_width(head_dim, kv_dtype)
        if phase is Phase.DECODE:
            for i in range(num_layers):
                for name in (past_key(i), past_value(i)):
                    inputs.append(TensorSpec(name, elem, (BATCH, num_kv_heads, PAST_SEQ, row)))
        logits_seq = seq if (all_logits or phase is Phase.DECODE) else 1
        outputs = [TensorSpec(LOGITS, act_dtype, (BATCH, logits_seq, vocab_size))]
        for i in range(num_layers):
            for name in (present_key(i), present_value(i)):
                outputs.append(TensorSpec(name, elem, (BATCH, num_kv_heads, TOTAL_SEQ, row)))
        return GraphIO(tuple(inputs), tuple(outputs))

    ntok = NUM_TOKENS if phase is Phase.PREFILL else NUM_SEQS
    inputs = [
        TensorSpec(INPUT_IDS, "int64", (ntok,)),
        TensorSpec(POSITIONS, "int64", (ntok,)),
        TensorSpec(QUERY_START_LOC, "int64", (NUM_SEQS_PLUS_1,)),
        TensorSpec(SEQ_LENS, "int64", (NUM_SEQS,)),
        TensorSpec(BLOCK_TABLES, "int64", (NUM_SEQS, MAX_BLOCKS)),
        TensorSpec(SLOT_MAPPING, "int64", (ntok,)),
    ]
    groups = layer_groups or (FULL_GROUP,) * num_layers
    if len(groups) != num_layers:
        raise ValueError(f"layer_groups lists {len(groups)} layers, the graph has {num_layers}")
    for g in sorted(set(groups) - {FULL_GROUP}):
        inputs += [TensorSpec(block_tables(g), "int64", (NUM_SEQS, MAX_BLOCKS)), TensorSpec(slot_mapping(g), "int64", (ntok,))]
    pools = [paged_pool_shape(num_blocks_axis(g), num_kv_heads, block_size, head_dim, kv_dtype) for g in groups]
    elem, row = kv_element_type(kv_dtype), kv_row_width(head_dim, kv_dtype)
    layers = pool_layers(num_layers, latent)
    for i, name in zip(layers, pool_names(num_layers, latent)):
        inputs.append(TensorSpec(name, elem, pools[i]))
    logits_rows = ntok if all_logits else NUM_SEQS
    outputs = [TensorSpec(LOGITS, act_dtype, (logits_rows, vocab_size))]
    if attention is Attention.PLUGIN:
        outputs += [TensorSpec(n, elem, pools[i]) for i, n in zip(layers, pool_out_names(num_layers, latent))]
    else:
        outputs += [TensorSpec(n, elem, (ntok, num_kv_heads, row)) for n in new_kv_names(num_layers, latent)]
    return GraphIO(tuple(inputs), tuple(outputs))


def paged_pool_shape(num_blocks, num_kv_heads: int, block_size: int, head_dim: int, kv_dtype: str = "float32") -> tuple:
    """One layer's K (or V) pool: [kv_heads, num_blocks, block_size, head_dim] (int4:
    [.., kv_row_width] bytes; kv_dtype is a DType.numpy_name).

    NOTE: heads outermost. Gathering a sequence's blocks along axis 1 yields
    [kv_heads, seqs, blocks, block_size, head_dim], which is already each head's keys in
    token order ([kv_heads, seqs, tokens, head_dim] by a free reshape): attention is then
    one GEMM per (head, sequence) with no transpose or concat of the gathered KV. A
    block-major pool would need either a transpose per step or thousands of tiny
    per-block GEMMs (both measured: 24% and ~25% of a decode step)."""
    return (num_kv_heads, num_blocks, block_size, kv_row_width(head_dim, kv_dtype))


def store_paged_kv(pool, slot_mapping, new) -> None:
    """pool[:, block, offset, :] = new[t] for slot = block * block_size + offset (numpy).
    What the runtime does with the `onnx` attention's new_key/new_value outputs
    (new is [num_tokens, kv_heads, head_dim])."""
    block_size = pool.shape[2]
    pool[:, slot_mapping // block_size, slot_mapping % block_size, :] = new.transpose(1, 0, 2)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: DType,
                       latent: bool = False) -> int:
    """Memory one token occupies in the KV cache: 2 (K and V) x layers x kv_heads x
    head_dim x bytes (int4: x `kv_row_width` bytes, its per-token scales included); MLA
    (`latent`, num_kv_heads 1, head_dim = kv_lora_rank + qk_rope_head_dim): one latent pool,
    layers x (kv_lora_rank + qk_rope_head_dim) x bytes (DeepSeek-V3 fp16: 61 x 576 x 2 = 70,272). The runtime
    and every planner use exactly this formula (per KV cache group: `kv_bytes_per_token_by_group`;
    the manifest's ``kv.bytes_per_token``: all layers).
    NOTE: int8 scales are static (per layer, head and channel, not per token), so they add
    nothing here: they live in the graphs, outside the pool (`kv_static_bytes`)."""
    pools = 1 if latent else 2
    return pools * num_layers * num_kv_heads * kv_row_width(head_dim, kv_dtype.numpy_name) * kv_dtype.itemsize


def kv_bytes_per_token_by_group(layer_groups: tuple[str, ...], num_kv_heads: int, head_dim: int,
                                kv_dtype: DType, latent: bool = False) -> dict[str, int]:
    """`kv_bytes_per_token` of each KV cache group's layers (group -> bytes); they sum to
    the model's bytes per token."""
    return {g: kv_bytes_per_token(layer_groups.count(g), num_kv_heads, head_dim, kv_dtype, latent)
            for g in dict.fromkeys(layer_groups)}


def kv_static_bytes(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: DType,
                    latent: bool = False, num_heads: int | None = None) -> int:
    """Bytes a KV dtype needs whatever the number of tokens, outside the pool (graph
    initializers, float32), 0 for float KV:
        int8   the static scales ``kv_scales.{i}.key/value`` [kv_heads, head_dim] per layer
               (MLA, `latent`: one ``kv_scales.{i}.latent`` [kv_lora_rank + qk_rope_head_dim])
        int4   the key transform (exporter/kv_int4.py calibrate_transform) per layer: the offset μ
               ``kv_offsets.{i}.key`` and channel scales ``.key_scale`` [kv_heads, head_dim], and the
               query's ``.query_scale`` [num_heads, head_dim]: layers x (2 x kv_heads + heads) x
               head_dim x 4 (smollm2-135m: 30 x (2 x 3 + 9) x 64 x 4 = 115,200)
    NOTE: int4 counts every layer's three: a layer without μ (soft-capped or sink attention)
    holds kv_heads x head_dim x 4 bytes fewer, so this is the most a build holds (what a memory
    plan should reserve). `num_heads`: the query heads, needed for int4 (MLA has no int4 pools)."""
    if kv_dtype is DType.INT8:
        return (1 if latent else 2) * num_layers * num_kv_heads * head_dim * 4
    if kv_dtype is DType.INT4 and not latent:
        if num_heads is None:
            raise ValueError("kv_static_bytes of int4 KV needs num_heads (the query channel scales)")
        return num_layers * (2 * num_kv_heads + num_heads) * head_dim * 4
    return 0


def local_window(layer_windows) -> int | None:
    """The window of the local KV cache group (`kv_groups`): the largest of its layers'
    windows, in tokens; None when the layers make one group (a paged build's
    ``kv.local_window``)."""
    windows = tuple(layer_windows)
    local = [w for w, g in zip(windows, kv_groups(windows)) if g == LOCAL_GROUP]
    return max(local) if local else None
