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
    logits_indices [num_logits] int64  (prefill graph of builds made with it: the rows to return)
    -> logits [num_seqs|num_tokens|num_logits, vocab],
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

Shared KV (Gemma 4's num_kv_shared_layers; `graph_io`'s kv_layers and layer_dims): a layer that
attends over an earlier layer's KV cache has no pools and no KV inputs or outputs of its own (no
key_cache.{i} / new_key.{i} / past_key_values.{i}); its attention reads its source layer's, which
the source alone writes, so the cache is held (and counted: `kv_bytes_per_token_layers`) once.
Layers may differ in KV heads and head_dim (Gemma 4's global layers): each pool has its layer's.

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
# hidden states for draft heads (paged builds that declare them, `kvexport build --hidden-states`; issue 45):
# every token of the step, at the layer boundaries the build lists (GraphEntry.hidden_layers), each
# exactly transformers' `output_hidden_states[b]`: b < num_layers the residual stream entering layer b (0: the
# embeddings; vLLM's EAGLE-3 "aux hidden states" of layers 2, L/2, L-3), b == num_layers the final normed
# state the LM head reads (what MTP layers take).
#   -> hidden_states [num_tokens, len(hidden_layers), hidden_size] float32
HIDDEN_STATES = "hidden_states"
HIDDEN_PRESETS = ("eagle3", "mtp")  # --hidden-states words besides a list of boundaries


def hidden_state_layers(which: str, num_layers: int) -> tuple[int, ...]:
    """The layer boundaries `--hidden-states` names: "eagle3" (2, L // 2, L - 3: vLLM's default aux layers),
    "mtp" (L: the final normed state) or a comma list of boundaries in 0..L, ascending, each once.
    ValueError saying what is allowed."""
    w = which.strip().lower()
    if w == "eagle3":
        if num_layers < 4:
            raise ValueError(f"eagle3 reads layers 2, L/2 and L-3, which a {num_layers}-layer model does not have")
        return tuple(sorted({2, num_layers // 2, num_layers - 3}))
    if w == "mtp":
        return (num_layers,)
    try:
        layers = tuple(int(x) for x in w.split(","))
    except ValueError:
        raise ValueError(f"{which!r} is neither {' nor '.join(HIDDEN_PRESETS)} nor a comma list of layer "
                         f"boundaries 0..{num_layers}") from None
    if not layers or list(layers) != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] <= num_layers:
        raise ValueError(f"{which!r}: layer boundaries must be ascending, each once, in 0..{num_layers} "
                         f"({num_layers}: the final normed state)")
    return layers
# LoRA adapters at serve time (paged builds that declare them, `kvexport build --lora-max-rank R`; issue 44): each
# token's adapter slot, and for each adapted matmul of each layer the loaded adapters' low-rank factors side by side
#   lora_index [num_tokens] int64: the token's slot, -1 the base model (no adapter)
#   lora_a.{i}.{m} [in, lora_rows.{m}], lora_b.{i}.{m} [lora_rows.{m}, out] (the activation dtype)
# lora_rows.{m} = slots x the module's rank: slot s owns rows/columns [s R, (s + 1) R), its parts (q, k, v of the
# fused qkv; gate, up) R / parts each, their scale folded into B (exporter/lora.py pack). The graph adds
#   ((x @ A) masked to each token's slot) @ B
# to the matmul's output: one GEMM per factor whatever the mix of adapters in the step (a dense form of
# Punica's batched LoRA); its cost grows with the slots the runtime loads, chosen at serve time.
LORA_INDEX = "lora_index"
# the graph matmuls (exporter/graph.py weight names model.layers.{i}.<m>.weight) an adapter can reach, and the
# HF modules fused into each, in its column order
LORA_MODULES: dict[str, tuple[str, ...]] = {"attn.qkv": ("q_proj", "k_proj", "v_proj"), "attn.o": ("o_proj",),
                                            "mlp.up": ("gate_proj", "up_proj"), "mlp.down": ("down_proj",)}


def lora_a(i: int, module: str) -> str:
    return f"lora_a.{i}.{module}"


def lora_b(i: int, module: str) -> str:
    return f"lora_b.{i}.{module}"


def lora_rows(module: str) -> str:
    """The dynamic axis of a module's factors: slots x its rank."""
    return f"lora_rows.{module}"


# KV cache groups (see the module docstring): the full group uses the names above
FULL_GROUP = "full"
LOCAL_GROUP = "local"
# A hybrid's recurrent-state checkpoints ("Recurrent state" below) as the runtime moves them: a group
# beside the KV groups whose "block" is one checkpoint slot (every state pool's row) keyed by the
# prefix-cache key of the block it ends, so the KV tiers and the disaggregated hand-off carry a
# checkpoint the way they carry a KV block. It is no graph input (its graphs read the state pools).
STATE_GROUP = "state"


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


def pool_names(num_layers: int, latent: bool = False, kv_layers=None) -> list[str]:
    """Every layer's pool inputs, in graph order: key_cache.{i}, value_cache.{i} per layer, or an
    MLA build's latent_cache.{i}. The runtime allocates, binds and copies exactly these.
    `kv_layers`: the layers holding pools where some share another's (`kv_layout`); None: all."""
    return [n for i in _kv_layers(num_layers, kv_layers)
            for n in ((latent_cache(i),) if latent else (key_cache(i), value_cache(i)))]


def pool_layers(num_layers: int, latent: bool = False, kv_layers=None) -> list[int]:
    """The layer of each of `pool_names`' pools."""
    return [i for i in _kv_layers(num_layers, kv_layers) for _ in range(1 if latent else 2)]


def new_kv_names(num_layers: int, latent: bool = False, kv_layers=None) -> list[str]:
    """The `onnx` attention's per-step KV outputs, one per pool of `pool_names` (same order)."""
    return [n for i in _kv_layers(num_layers, kv_layers)
            for n in ((new_latent(i),) if latent else (new_key(i), new_value(i)))]


def pool_out_names(num_layers: int, latent: bool = False, kv_layers=None) -> list[str]:
    """The plugin attention's updated-pool outputs, one per pool of `pool_names` (same order)."""
    return [n for i in _kv_layers(num_layers, kv_layers)
            for n in ((latent_cache_out(i),) if latent else (key_cache_out(i), value_cache_out(i)))]


def _kv_layers(num_layers: int, kv_layers) -> tuple[int, ...]:
    return tuple(range(num_layers)) if kv_layers is None else tuple(kv_layers)


def kv_layout(model: dict, num_kv_heads: int,
              head_dim: int) -> tuple[tuple[int, ...] | None, tuple[tuple[int, int], ...]]:
    """(the layers holding pools, None: all; each layer's (KV heads, head_dim)) of a build, from
    its manifest's model spec (exporter/spec.py kv_sources, layer_kv_heads, layer_head_dims; see
    "Shared KV" above); `num_kv_heads` / `head_dim`: the manifest kv entry's, for uniform layers."""
    n = model["num_layers"]
    sources = model.get("kv_sources")
    kv_layers = None if sources is None else tuple(i for i in range(n) if sources[i] == i)
    if (la := model.get("linear_attn")) is not None:  # a hybrid's linear layers hold state, no KV ("Recurrent state")
        kv_layers = tuple(i for i in (kv_layers or range(n)) if i not in set(la["layers"]))
    heads, dims = model.get("layer_kv_heads"), model.get("layer_head_dims")
    return kv_layers, tuple((heads[i] if heads else num_kv_heads, dims[i] if dims else head_dim) for i in range(n))


def kv_bytes_per_token_layers(layer_groups: tuple[str, ...], layer_dims, kv_layers, kv_dtype: "DType",
                              latent: bool = False) -> dict[str, int]:
    """`kv_bytes_per_token_by_group` for layers of differing KV shapes (`kv_layout`), a shared
    cache counted once (only `kv_layers` hold pools; None: all): per group, the sum over its
    pool-holding layers of `kv_bytes_per_token` of one layer (equal to `kv_bytes_per_token_by_group`
    for uniform layers)."""
    out = dict.fromkeys(layer_groups, 0)
    for i in _kv_layers(len(layer_groups), kv_layers):
        out[layer_groups[i]] += kv_bytes_per_token(1, layer_dims[i][0], layer_dims[i][1], kv_dtype, latent)
    return out


def kv_bytes_per_token_model(model: dict, num_kv_heads: int, head_dim: int, kv_dtype: "DType",
                             latent: bool = False) -> int:
    """KV bytes per token of a whole build (the manifest's ``kv.bytes_per_token``) from its model spec
    (`kv_layout`): the layers holding pools only, each its own KV shape, a shared cache once, a hybrid's
    linear layers none; `kv_bytes_per_token` of every layer where the layers are uniform."""
    kv_layers, dims = kv_layout(model, num_kv_heads, head_dim)
    groups = (FULL_GROUP,) * model["num_layers"]
    return sum(kv_bytes_per_token_layers(groups, dims, kv_layers, kv_dtype, latent).values())


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


# ---- recurrent state (hybrid models: Qwen3.5, Qwen3-Next, OLMo-Hybrid, LFM2; paged only) -------
# Each gated DeltaNet layer keeps a fixed-size state per sequence instead of a growing KV cache: the
# causal short conv's last K-1 inputs and the delta rule's matrix per value head; an LFM2 short-conv
# layer keeps the conv's inputs alone (no recurrent matrix: SHORT_CONV). The runtime holds
# them in a STATE POOL of slots (runtime/core/state_pool.py: one per running sequence, plus prefix-
# cache checkpoints) beside the KV pool; `state_slots` says which slot each sequence of the step
# reads. Like the `onnx` attention's KV, the graphs read the pools and return the sequences' new
# states, which the runtime stores back at those slots. A sequence whose first token in the step is
# at position 0 starts from a zero state whatever its slot holds (fresh prompts, preemption by
# recompute). The state pools are numbered j = 0.. over the state-holding ("linear") layers (the
# manifest's model.linear_attn.layers); only the other (attention) layers hold KV pools (`kv_layout`)::
#
#   state_slots [num_seqs] int64
#   conv_state.{j} [num_state_slots, K-1, conv_dim] float32
#   recurrent_state.{j} [num_state_slots, Hv, Dk, Dv] float32          (gated DeltaNet layers only)
#   -> new_conv_state.{j} [num_seqs, K-1, conv_dim], new_recurrent_state.{j} [num_seqs, Hv, Dk, Dv]
STATE_SLOTS = "state_slots"
NUM_STATE_SLOTS = "num_state_slots"
# the manifest's model.linear_attn["mixer"] of short-conv layers (LFM2: exporter/short_conv.py), whose state
# is the conv's alone; a gated DeltaNet's linear_attn has no "mixer" key (builds made before it unchanged)
SHORT_CONV = "short_conv"


@dataclass(frozen=True, slots=True)
class StateDims:
    """One state-holding layer's state shapes (from the manifest's model.linear_attn: `state_dims`).
    A short-conv layer (LFM2) has no recurrent matrix: num_v_heads (and the head dims) 0."""

    conv_width: int  # K - 1: conv inputs kept
    conv_dim: int  # channels of the short conv (q, k and v; LFM2: hidden_size)
    num_v_heads: int = 0  # Hv; 0: no delta-rule state (SHORT_CONV)
    k_head_dim: int = 0  # Dk
    v_head_dim: int = 0  # Dv

    @property
    def recurrent(self) -> bool:
        """The layer holds a delta-rule matrix beside its conv state (recurrent_state.{j})."""
        return self.num_v_heads > 0

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_width, self.conv_dim)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.k_head_dim, self.v_head_dim)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """One slot's row shape of each of one layer's pools, `state_names` order."""
        return (self.conv_shape, self.recurrent_shape) if self.recurrent else (self.conv_shape,)


def state_dims(model: dict) -> tuple[int, StateDims] | None:
    """(state-holding layers, their state shapes) of a build from its manifest's model spec
    (exporter/linear_attention.py LinearAttnSpec.to_json, exporter/short_conv.py ShortConvSpec.to_json),
    or None: no recurrent state."""
    la = model.get("linear_attn")
    if la is None:
        return None
    if la.get("mixer") == SHORT_CONV:  # LFM2: the conv state alone
        return len(la["layers"]), StateDims(la["conv_kernel"] - 1, la["conv_dim"])
    hk, dk, hv, dv = la["num_k_heads"], la["k_head_dim"], la["num_v_heads"], la["v_head_dim"]
    return len(la["layers"]), StateDims(la["conv_kernel"] - 1, 2 * hk * dk + hv * dv, hv, dk, dv)


def conv_state(j: int) -> str:
    """Linear layer j's conv-state pool [num_state_slots, K-1, conv_dim] (graph input)."""
    return f"conv_state.{j}"


def recurrent_state(j: int) -> str:
    """Linear layer j's delta-rule state pool [num_state_slots, Hv, Dk, Dv] (graph input)."""
    return f"recurrent_state.{j}"


def new_conv_state(j: int) -> str:
    return f"new_conv_state.{j}"


def new_recurrent_state(j: int) -> str:
    return f"new_recurrent_state.{j}"


def state_names(num_linear_layers: int, recurrent: bool = True) -> list[str]:
    """Every state pool input, in graph order: conv_state.{j}, recurrent_state.{j} per linear layer
    (`recurrent` False, short-conv layers: conv_state.{j} alone; StateDims.recurrent)."""
    return [n for j in range(num_linear_layers)
            for n in ((conv_state(j), recurrent_state(j)) if recurrent else (conv_state(j),))]


def new_state_names(num_linear_layers: int, recurrent: bool = True) -> list[str]:
    """The graphs' new-state outputs, one per pool of `state_names` (same order)."""
    return [n for j in range(num_linear_layers)
            for n in ((new_conv_state(j), new_recurrent_state(j)) if recurrent else (new_conv_state(j),))]


def state_bytes_per_sequence(num_linear_layers: int, dims: StateDims) -> int:
    """Memory one sequence's recurrent state occupies whatever its length (float32): layers x
    (conv_width x conv_dim + Hv x Dk x Dv) x 4 (a Qwen3.5-0.8B-shaped model, 18 linear layers of 16 x 128 x 128
    and conv_dim 6144: 18 x (3 x 6144 + 262,144) x 4 = 20,201,472; an LFM2-1.2B-shaped one, 10 short-conv
    layers of 2 x 2048 and no matrix: 10 x 4096 x 4 = 163,840). `kvexport plan` shows exactly this."""
    per = dims.conv_width * dims.conv_dim + dims.num_v_heads * dims.k_head_dim * dims.v_head_dim
    return num_linear_layers * per * 4


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
# KV positions an attention_scores row covers: max_blocks_per_seq * block_size (plugin attention); the
# `onnx` form, whose tables cover only earlier steps' blocks, adds the step's longest chunk
SCORE_LEN = "score_len"


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
    logits_indices: bool = False,
    kv_layers: tuple[int, ...] | None = None,
    layer_dims: tuple[tuple[int, int], ...] | None = None,
    state: tuple[int, StateDims] | None = None,
    scores: bool = False,
    hidden_layers: tuple[int, ...] = (),
    hidden_size: int = 0,
    lora: tuple[tuple[int, str, int, int], ...] = (),
) -> GraphIO:
    """Every input and output of one graph, in order. The exporter declares exactly
    these; the runtime feeds exactly these. `layer_groups`: each layer's KV cache group
    (`kv_groups`; paged only); None: every layer in FULL_GROUP. `latent`: an MLA build
    (paged only; num_kv_heads 1 and head_dim the latent row width). `logits_indices`: the
    paged prefill graph takes LOGITS_INDICES (last input) and returns logits [NUM_LOGITS, vocab]
    (rows where asked; then all_logits changes nothing in the graph). NOTE: the paged decode
    graph never takes it: each of its rows is a sequence's last token, and a step of 1 + k
    tokens per sequence (a verified draft) runs through the prefill graph like a prompt chunk.
    `state`: a hybrid's (linear layers, state shapes) (`state_dims`; paged only): the recurrent
    state I/O ("Recurrent state" above), after the pools. `scores`: the paged graphs take
    OBSERVATION_LENS (last input) and return attention_scores.{i} per KV layer (last outputs;
    importance eviction; MLA builds: [NUM_SEQS, 1, SCORE_LEN], the one latent "KV head").
    `hidden_layers`: the paged graphs return HIDDEN_STATES at those boundaries (the last output).
    `lora`: (layer, module, in, out) of each adapted matmul: the paged graphs take LORA_INDEX and each one's
    lora_a / lora_b (the last inputs)."""
    dims = layer_dims or ((num_kv_heads, head_dim),) * num_layers  # per layer (KV heads, head_dim)
    if layout is KVLayout.CONTIGUOUS:
        if latent or state is not None or hidden_layers or lora:
            raise ValueError("MLA, recurrent-state (hybrid) builds and hidden-state outputs are paged only")
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
        elem = kv_element_type(kv_dtype)
        rows = [kv_row_width(d, kv_dtype) for _, d in dims]
        if phase is Phase.DECODE:
            for i in _kv_layers(num_layers, kv_layers):
                for name in (past_key(i), past_value(i)):
                    inputs.append(TensorSpec(name, elem, (BATCH, dims[i][0], PAST_SEQ, rows[i])))
        logits_seq = seq if (all_logits or phase is Phase.DECODE) else 1
        outputs = [TensorSpec(LOGITS, act_dtype, (BATCH, logits_seq, vocab_size))]
        for i in _kv_layers(num_layers, kv_layers):
            for name in (present_key(i), present_value(i)):
                outputs.append(TensorSpec(name, elem, (BATCH, dims[i][0], TOTAL_SEQ, rows[i])))
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
    pools = [paged_pool_shape(num_blocks_axis(g), dims[i][0], block_size, dims[i][1], kv_dtype)
             for i, g in enumerate(groups)]
    elem = kv_element_type(kv_dtype)
    layers = pool_layers(num_layers, latent, kv_layers)
    for i, name in zip(layers, pool_names(num_layers, latent, kv_layers)):
        inputs.append(TensorSpec(name, elem, pools[i]))
    if state is not None:
        inputs += _state_io(*state, rows=NUM_STATE_SLOTS, inputs=True)
    logits_rows = ntok if all_logits else NUM_SEQS
    if logits_indices and phase is Phase.PREFILL:
        inputs.append(TensorSpec(LOGITS_INDICES, "int64", (NUM_LOGITS,)))
        logits_rows = NUM_LOGITS
    outputs = [TensorSpec(LOGITS, act_dtype, (logits_rows, vocab_size))]
    if attention is Attention.PLUGIN:
        outputs += [TensorSpec(n, elem, pools[i]) for i, n in zip(layers, pool_out_names(num_layers, latent, kv_layers))]
    else:
        outputs += [TensorSpec(n, elem, (ntok, dims[i][0], kv_row_width(dims[i][1], kv_dtype)))
                    for i, n in zip(layers, new_kv_names(num_layers, latent, kv_layers))]
    if state is not None:
        outputs += _state_io(*state, rows=NUM_SEQS, inputs=False)
    if scores:
        inputs.append(TensorSpec(OBSERVATION_LENS, "int64", (NUM_SEQS,)))
        outputs += [TensorSpec(attention_scores(i), "float32", (NUM_SEQS, dims[i][0], SCORE_LEN))
                    for i in _kv_layers(num_layers, kv_layers)]
    if hidden_layers:
        outputs.append(TensorSpec(HIDDEN_STATES, "float32", (ntok, len(hidden_layers), hidden_size)))
    if lora:
        inputs.append(TensorSpec(LORA_INDEX, "int64", (ntok,)))
        for i, m, fan_in, fan_out in lora:
            inputs += [TensorSpec(lora_a(i, m), act_dtype, (fan_in, lora_rows(m))),
                       TensorSpec(lora_b(i, m), act_dtype, (lora_rows(m), fan_out))]
    return GraphIO(tuple(inputs), tuple(outputs))


def _state_io(num_linear: int, dims: StateDims, rows: str, inputs: bool) -> list[TensorSpec]:
    """The recurrent-state inputs (state_slots, then the pools) or outputs (the new states)."""
    out = [TensorSpec(STATE_SLOTS, "int64", (NUM_SEQS,))] if inputs else []
    names = (state_names if inputs else new_state_names)(num_linear, dims.recurrent)
    shapes = dims.shapes * num_linear
    return out + [TensorSpec(n, "float32", (rows, *shape)) for n, shape in zip(names, shapes)]


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
