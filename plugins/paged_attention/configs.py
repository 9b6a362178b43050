"""Kernel configurations of `kvexport::PagedAttention`: the one list of tile configs (the
TensorRT plugin's tactics), the representative model shapes, and how one configuration
becomes a `triton.compile` source (signature + constexprs) — shared by the JIT launcher
(launch.py), the TensorRT ahead-of-time registration (trt.py), the PTX compile tests and
the GPU check.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common import kernel_source
from ..common.kernel_source import AOT_TARGETS, GPU_ACT_DTYPES, TRITON_TYPES, pow2  # noqa: F401  (shared by every op)
from .spec import PagedAttentionAttrs


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One tiling of a kernel (a TensorRT tactic)."""

    block_m: int  # query rows per program (new tokens × heads of one KV group); power of 2, >= 16
    block_n: int  # keys per inner iteration; power of 2, >= 16
    num_warps: int  # warps per program
    num_stages: int  # software-pipelining stages of the key loop

    @property
    def tactic(self) -> int:  # TensorRT tactic id: 1-based, stable by list position
        return (PREFILL_TILES + DECODE_TILES).index(self) + 1


# NOTE: the order is part of the engine format (tactic ids are positions); append only.
PREFILL_TILES = (TileConfig(64, 64, 4, 2), TileConfig(128, 64, 8, 2), TileConfig(64, 32, 4, 3))
DECODE_TILES = (TileConfig(16, 64, 4, 2), TileConfig(16, 128, 4, 3))
INTERPRET_TILE = TileConfig(16, 16, 4, 1)  # CPU interpreter tests: small tiles run fastest
# the attention_scores kernel (kernels.scores_kernel, JIT only; not a tactic): rows of observation
# queries × group heads per tile, keys per iteration
SCORES_TILE = TileConfig(32, 32, 4, 1)
REDUCE_WARPS = 4


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's attention shape, for ahead-of-time compilation."""

    name: str
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    block_size: int  # tokens per KV block
    sliding_window: int = 0  # tokens; 0 = none
    logit_softcap: float = 0.0  # attention-logit soft-cap; 0 = off
    scale: float = 0.0  # softmax scale; 0 = head_dim ** -0.5
    sinks: bool = False  # learned attention sinks (GPT-OSS): fixed stand-in values, one per query head

    def attrs(self, kv_dtype: str) -> PagedAttentionAttrs:
        heads = self.num_kv_heads * self.group
        sinks = tuple(0.25 * (h % 7) - 0.75 for h in range(heads)) if self.sinks else ()
        return PagedAttentionAttrs(heads, self.num_kv_heads, self.head_dim,
                                   self.block_size, self.scale or self.head_dim ** -0.5, self.sliding_window,
                                   kv_dtype, self.logit_softcap, sinks)


# Representative shapes every configuration is compiled for in CI.
SHAPES = (Shape("llama3-8b", 8, 4, 128, 16),  # GQA, head_dim 128
          Shape("smollm2-135m", 3, 3, 64, 16),  # group 3: not a power of 2
          Shape("mistral-window", 8, 4, 128, 16, 4096),  # sliding window
          # Gemma-2-9B local layers: window, soft-capped logits, query_pre_attn_scalar 256
          Shape("gemma2-9b-local", 8, 2, 256, 16, 4096, logit_softcap=50.0, scale=256 ** -0.5),
          # GPT-OSS-20B sliding layers: 64 heads in groups of 8, head_dim 64, window 128, attention sinks
          Shape("gpt-oss-20b-local", 8, 8, 64, 16, 128, sinks=True))


def block_m_for(tile: TileConfig, group: int) -> int:
    """Rows per program: at least one whole query group."""
    return max(tile.block_m, pow2(group))


def kv_pairs(act_dtypes=GPU_ACT_DTYPES) -> list[tuple[str, str]]:
    """(activation dtype, pool dtype) combinations of the TensorRT plugin: pool = activation
    dtype, int8, or int4 (uint8 rows of codes and per-token scales)."""
    return [(a, kv) for a in act_dtypes for kv in (a, "int8", "int4")]


@dataclass(frozen=True, slots=True)
class KernelSource(kernel_source.KernelSource):
    """One configuration of a PagedAttention kernel: "prefill" | "decode" | "decode_split" | "reduce"."""

    def kernel_fn(self):
        from . import kernels

        return {"prefill": kernels.prefill_kernel, "decode": kernels.decode_kernel,
                "decode_split": kernels.decode_kernel, "reduce": kernels.reduce_kernel,
                "scores": kernels.scores_kernel}[self.kernel]


_IN = ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "bt_ptr", "seq_lens_ptr", "qsl_ptr", "slot_ptr",
       "ks_ptr", "vs_ptr")
_OUT = ("out_ptr", "kc_out_ptr", "vc_out_ptr")


def _pointer_types(act: str, kv: str) -> dict:
    a, k = "*" + TRITON_TYPES[act], "*" + TRITON_TYPES[kv]
    types = (a, a, a, k, k, "*i64", "*i64", "*i64", "*i64", "*fp32", "*fp32")
    return dict(zip(_IN, types)), dict(zip(_OUT, (a, k, k)))


def attn_constexprs(attrs: PagedAttentionAttrs, block_m: int, block_n: int,
                    per_channel_scales: bool = True) -> dict:
    """The attention kernels' constexprs for one layer. per_channel_scales: int8 scales are
    [kv_heads, head_dim] (False: per-head [kv_heads], builds calibrated before them). SINKS (a
    tuple of num_heads floats) only for a layer with attention sinks (kernels.py)."""
    const = dict(NUM_KV_HEADS=attrs.num_kv_heads, GROUP=attrs.group_size, HEAD_DIM=attrs.head_dim,
                 BLOCK_SIZE=attrs.block_size, SCALE=float(attrs.scale), WINDOW=attrs.sliding_window,
                 KV_INT8=attrs.quantized, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=pow2(attrs.head_dim),
                 SOFTCAP=float(attrs.logit_softcap), SCALES_PER_CHANNEL=per_channel_scales, KV_INT4=attrs.int4)
    return {**const, **sink_constexprs(attrs)}


def sink_constexprs(attrs: PagedAttentionAttrs) -> dict:
    """{"SINKS": the layer's sinks} when it has any, else {} (the kernels' default: none)."""
    return {"SINKS": tuple(attrs.attention_sinks)} if attrs.attention_sinks else {}


def prefill_source(attrs: PagedAttentionAttrs, act: str, tile: TileConfig,
                   per_channel_scales: bool = True) -> KernelSource:
    """prefill_kernel(11 inputs, num_seqs, max_blocks, num_blocks, 3 outputs) — the AOT kernel."""
    ins, outs = _pointer_types(act, attrs.kv_dtype)
    const = attn_constexprs(attrs, block_m_for(tile, attrs.group_size), tile.block_n, per_channel_scales)
    sig = {**ins, "num_seqs": "i32", "max_blocks": "i32", "num_blocks": "i32", **outs,
           **{k: "constexpr" for k in const}}
    return KernelSource("prefill", sig, const, tile.num_warps, tile.num_stages)


def decode_source(attrs: PagedAttentionAttrs, act: str, tile: TileConfig, split: bool) -> KernelSource:
    ins, outs = _pointer_types(act, attrs.kv_dtype)
    const = attn_constexprs(attrs, block_m_for(tile, attrs.group_size), tile.block_n)
    const["SPLIT"] = split
    sig = {**ins, "max_blocks": "i32", "num_blocks": "i32", "partition": "i32", **outs,
           "part_out_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
           **{k: "constexpr" for k in const}}
    return KernelSource("decode_split" if split else "decode", sig, const, tile.num_warps, tile.num_stages)


def reduce_source(attrs: PagedAttentionAttrs, act: str, max_splits: int) -> KernelSource:
    const = dict(NUM_HEADS=attrs.num_heads, HEAD_DIM=attrs.head_dim, BLOCK_D=pow2(attrs.head_dim),
                 MAX_SPLITS=pow2(max_splits), **sink_constexprs(attrs))
    sig = {"part_out_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "qsl_ptr": "*i64",
           "out_ptr": "*" + TRITON_TYPES[act], "num_splits": "i32", **{k: "constexpr" for k in const}}
    return KernelSource("reduce", sig, const, REDUCE_WARPS, 1)


def scores_source(attrs: PagedAttentionAttrs, act: str, tile: TileConfig = SCORES_TILE,
                  per_channel_scales: bool = True) -> KernelSource:
    """scores_kernel(query, key_cache, block_tables, seq_lens, query_start_loc, k_scale, observation_lens,
    max_blocks, num_blocks, score_len, scores) — the optional attention_scores pass (launch.py), and the
    AOT kernel of the PagedAttentionScores TensorRT plugin (spec.SCORES_INPUTS, extras, output)."""
    a, k = "*" + TRITON_TYPES[act], "*" + TRITON_TYPES[attrs.kv_dtype]
    const = attn_constexprs(attrs, block_m_for(tile, attrs.group_size), tile.block_n, per_channel_scales)
    sig = {"q_ptr": a, "kc_ptr": k, "bt_ptr": "*i64", "seq_lens_ptr": "*i64", "qsl_ptr": "*i64", "ks_ptr": "*fp32",
           "obs_ptr": "*i64", "max_blocks": "i32", "num_blocks": "i32", "score_len": "i32", "scores_ptr": "*fp32",
           **{k: "constexpr" for k in const}}
    return KernelSource("scores", sig, const, tile.num_warps, tile.num_stages)


MAX_SPLITS = 64  # upper bound of decode splits (the reduce kernel's vector width)


def all_sources() -> list[KernelSource]:
    """Every GPU configuration, as CI compiles it to PTX: for Llama-3-8B's shape, fp16
    activations × (fp16, int8) pools × every tile of the prefill (AOT) kernel, of the decode
    kernel with and without split-K, and the reduce kernel; bf16, and int4 pools, the same with
    the first tiles (a TensorRT build may still pick any tactic for them); for the other shapes
    (group 3 / head_dim 64, sliding window, Gemma-2 window + soft-cap + scale, head_dim 256,
    GPT-OSS window + attention sinks), fp16 × every pool kind × the first tiles of the prefill and
    split decode kernels (with sinks also the unsplit decode and the reduce kernel). The attention_scores
    kernel: Llama-3-8B with fp16 × every pool and bf16 pools, Gemma 2 and GPT-OSS fp16. fp32 activations
    are a CPU (interpreter) mode only."""
    out: dict[tuple, KernelSource] = {}

    def add(src: KernelSource) -> None:  # the reduce kernel does not depend on the pool dtype
        out.setdefault((src.kernel, tuple(src.signature.items()), tuple(src.constexprs.items()),
                        src.num_warps, src.num_stages), src)

    for shape in SHAPES:
        for act, kv in kv_pairs(GPU_ACT_DTYPES):
            attrs = shape.attrs(kv)
            if shape is SHAPES[0]:
                # tiles change no dtype handling: bf16 and int4 pools with the first ones
                every = act == "float16" and kv != "int4"
                for t in PREFILL_TILES if every else PREFILL_TILES[:1]:
                    add(prefill_source(attrs, act, t))
                for t in DECODE_TILES if every else DECODE_TILES[:1]:
                    add(decode_source(attrs, act, t, False))
                    add(decode_source(attrs, act, t, True))
                add(reduce_source(attrs, act, MAX_SPLITS))
            elif act == "float16":
                add(prefill_source(attrs, act, PREFILL_TILES[0]))
                add(decode_source(attrs, act, DECODE_TILES[0], True))
                if shape.sinks:  # the unsplit decode and the reduce fold the sinks in too
                    add(decode_source(attrs, act, DECODE_TILES[0], False))
                    add(reduce_source(attrs, act, MAX_SPLITS))
            # the attention_scores pass: every pool kind of the first shape; window + soft-cap + head_dim
            # 256 (Gemma 2) and sinks (GPT-OSS), fp16
            if (shape is SHAPES[0] and (act == "float16" or kv == act)) or (
                    act == kv == "float16" and (shape.logit_softcap or shape.sinks)):
                add(scores_source(attrs, act))
    return list(out.values())


CI_CAPABILITIES = (80, 90)


def ci_sources() -> list[tuple[KernelSource, int]]:
    """(source, compute capability) pairs CI compiles on every run: every configuration of
    all_sources() once, the capabilities taken in turn within each kind (kernel, activation type,
    pool type), so every kind with two or more configurations compiles for sm_80 and sm_90 both.
    `python -m kvexport.plugins.paged_attention.ptx --all` compiles each for both.
    NOTE: a compile takes ~6 s of CPU; both archs for all of them took 11 minutes of a CI run,
    and a configuration's lowering does not depend on the arch beyond what each kind exercises."""
    seen: dict[tuple, int] = {}
    out = []
    for src in all_sources():
        kind = (src.kernel, src.signature.get("q_ptr", src.signature.get("out_ptr")), src.signature.get("kc_ptr"))
        n = seen[kind] = seen.get(kind, -1) + 1
        out.append((src, CI_CAPABILITIES[n % len(CI_CAPABILITIES)]))
    return out
