"""Kernel configurations of `kvexport::PagedMLA`: the one list of tile configs (the TensorRT
plugin's tactics), the representative model shapes, and how one configuration becomes a
`triton.compile` source (signature + constexprs) — shared by the JIT launcher (launch.py), the
TensorRT ahead-of-time registration (trt.py), the PTX compile tests and the GPU check.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common import kernel_source
from ..common.kernel_source import AOT_TARGETS, GPU_ACT_DTYPES, TRITON_TYPES, pow2  # noqa: F401  (shared by every op)
from .spec import PagedMLAAttrs


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One tiling of the MLA kernel (a TensorRT tactic)."""

    block_m: int  # query rows per program (new tokens × heads); power of 2, >= 16
    block_n: int  # pool rows per inner iteration; power of 2, >= 16
    num_warps: int  # warps per program
    num_stages: int  # software-pipelining stages of the key loop

    @property
    def tactic(self) -> int:  # TensorRT tactic id: 1-based, stable by list position
        return TILES.index(self) + 1


# NOTE: the order is part of the engine format (tactic ids are positions); append only.
# DeepSeek rows are 576 channels: a [BLOCK_N, 512] latent tile in fp16 is 32 KiB at BLOCK_N 32,
# and the float32 accumulator [BLOCK_M, 512] is BLOCK_M * 512 / (32 * warps) registers a thread.
TILES = (TileConfig(16, 32, 4, 2), TileConfig(32, 32, 8, 2), TileConfig(64, 16, 8, 2))
INTERPRET_TILE = TileConfig(16, 16, 4, 1)  # CPU interpreter tests: small tiles run fastest
SCORES_TILE = TileConfig(32, 32, 8, 1)  # the attention_scores kernel (JIT only; not a tactic)
REDUCE_WARPS = 4
MAX_SPLITS = 64  # upper bound of context splits (the reduce kernel's vector width)


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's MLA shape, for ahead-of-time compilation."""

    name: str
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int  # only for the softmax scale: (nope + rope) ** -0.5
    block_size: int

    def attrs(self, kv_dtype: str) -> PagedMLAAttrs:
        return PagedMLAAttrs(self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, self.block_size,
                             (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5, kv_dtype)


# Representative shapes every configuration is compiled for in CI (per-GPU head counts of the
# usual tensor-parallel splits are covered by the head chunks: any num_heads works).
SHAPES = (Shape("deepseek-v3", 128, 512, 64, 128, 16),  # also Kimi K2 (64 heads) and R1
          Shape("deepseek-v2-lite", 16, 512, 64, 128, 16))


def heads_per_program(tile: TileConfig, num_heads: int) -> int:
    """Query heads of one program: all of them when they fit in BLOCK_M (then BLOCK_M / HEADS
    tokens per program), else BLOCK_M (more programs along the head axis)."""
    return min(pow2(num_heads), tile.block_m)


def kv_pairs(act_dtypes=GPU_ACT_DTYPES) -> list[tuple[str, str]]:
    """(activation dtype, pool dtype) combinations of the TensorRT plugin: pool = activation dtype or int8."""
    return [(a, kv) for a in act_dtypes for kv in (a, "int8")]


def constexprs(attrs: PagedMLAAttrs, tile: TileConfig) -> dict:
    """The attention kernels' constexprs for one layer."""
    return dict(NUM_HEADS=attrs.num_heads, LORA=attrs.kv_lora_rank, ROPE=attrs.qk_rope_head_dim,
                BLOCK_SIZE=attrs.block_size, SCALE=float(attrs.scale), KV_INT8=attrs.quantized,
                HEADS=heads_per_program(tile, attrs.num_heads), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                BLOCK_L=max(16, pow2(attrs.kv_lora_rank)), BLOCK_R=max(16, pow2(attrs.qk_rope_head_dim)))


@dataclass(frozen=True, slots=True)
class KernelSource(kernel_source.KernelSource):
    """One configuration of a PagedMLA kernel: "mla" | "mla_split" | "reduce"."""

    def kernel_fn(self):
        from . import kernels

        return {"mla": kernels.mla_kernel, "mla_split": kernels.mla_split_kernel,
                "reduce": kernels.mla_reduce_kernel, "scores": kernels.mla_scores_kernel}[self.kernel]


_IN = ("q_ptr", "lat_ptr", "cache_ptr", "bt_ptr", "seq_lens_ptr", "qsl_ptr", "slot_ptr", "scale_ptr")


def _inputs(act: str, kv: str) -> dict:
    a, k = "*" + TRITON_TYPES[act], "*" + TRITON_TYPES[kv]
    return dict(zip(_IN, (a, a, k, "*i64", "*i64", "*i64", "*i64", "*fp32")))


def mla_source(attrs: PagedMLAAttrs, act: str, tile: TileConfig) -> KernelSource:
    """mla_kernel(8 inputs, num_seqs, max_blocks, num_blocks, 2 outputs) — the AOT kernel."""
    const = constexprs(attrs, tile)
    sig = {**_inputs(act, attrs.kv_dtype), "num_seqs": "i32", "max_blocks": "i32", "num_blocks": "i32",
           "out_ptr": "*" + TRITON_TYPES[act], "cache_out_ptr": "*" + TRITON_TYPES[attrs.kv_dtype],
           **{k: "constexpr" for k in const}}
    return KernelSource("mla", sig, const, tile.num_warps, tile.num_stages)


def split_source(attrs: PagedMLAAttrs, act: str, tile: TileConfig) -> KernelSource:
    const = constexprs(attrs, tile)
    sig = {**_inputs(act, attrs.kv_dtype), "num_seqs": "i32", "max_blocks": "i32", "partition": "i32",
           "cache_out_ptr": "*" + TRITON_TYPES[attrs.kv_dtype], "part_out_ptr": "*fp32", "part_m_ptr": "*fp32",
           "part_l_ptr": "*fp32", **{k: "constexpr" for k in const}}
    return KernelSource("mla_split", sig, const, tile.num_warps, tile.num_stages)


def reduce_source(attrs: PagedMLAAttrs, act: str, max_splits: int = MAX_SPLITS) -> KernelSource:
    const = dict(NUM_HEADS=attrs.num_heads, LORA=attrs.kv_lora_rank, BLOCK_L=max(16, pow2(attrs.kv_lora_rank)),
                 MAX_SPLITS=pow2(max_splits))
    sig = {"part_out_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "out_ptr": "*" + TRITON_TYPES[act],
           "num_splits": "i32", **{k: "constexpr" for k in const}}
    return KernelSource("reduce", sig, const, REDUCE_WARPS, 1)


def scores_source(attrs: PagedMLAAttrs, act: str, tile: TileConfig = SCORES_TILE) -> KernelSource:
    """mla_scores_kernel(query, latent_cache, block_tables, seq_lens, query_start_loc, kv_scale,
    observation_lens, max_blocks, score_len, partials) — the optional attention_scores pass (launch.py)."""
    const = constexprs(attrs, tile)
    sig = {"q_ptr": "*" + TRITON_TYPES[act], "cache_ptr": "*" + TRITON_TYPES[attrs.kv_dtype], "bt_ptr": "*i64",
           "seq_lens_ptr": "*i64", "qsl_ptr": "*i64", "scale_ptr": "*fp32", "obs_ptr": "*i64", "max_blocks": "i32",
           "score_len": "i32", "part_ptr": "*fp32", **{k: "constexpr" for k in const}}
    return KernelSource("scores", sig, const, tile.num_warps, tile.num_stages)


def all_sources() -> list[KernelSource]:
    """Every GPU configuration, as CI compiles it to PTX: DeepSeek-V3's shape × fp16 / bf16 ×
    same-dtype / int8 pools × every tile of the AOT kernel, the split kernel with the first tile and
    the reduce kernel; DeepSeek-V2-Lite (16 heads: several tokens per program) fp16 × both pools ×
    the first tile of both kernels; the attention_scores kernel at DeepSeek-V3's shape × both pools."""
    out: dict[tuple, KernelSource] = {}

    def add(src: KernelSource) -> None:
        out.setdefault((src.kernel, tuple(src.signature.items()), tuple(src.constexprs.items()),
                        src.num_warps, src.num_stages), src)

    for shape in SHAPES:
        for act, kv in kv_pairs():
            attrs = shape.attrs(kv)
            if shape is SHAPES[0]:
                for t in TILES:
                    add(mla_source(attrs, act, t))
                add(split_source(attrs, act, TILES[0]))
                add(reduce_source(attrs, act))
                add(scores_source(attrs, act))
            elif act == "float16":
                add(mla_source(attrs, act, TILES[0]))
                add(split_source(attrs, act, TILES[0]))
    return list(out.values())


def ci_sources() -> list[tuple[KernelSource, int]]:
    """(source, compute capability) pairs CI compiles on every run: the AOT kernel with each pool
    kind at DeepSeek-V3's shape and the reduce kernel, sm_80 and sm_90 both used. The split kernel
    shares the AOT kernel's device code (`_program`) and differs only in its partial stores; it is in
    `python -m kvexport.plugins.paged_mla.ptx --all` (every configuration for both archs; an MLA
    compile takes ~20 s of CPU, too many for every CI run)."""
    v3 = SHAPES[0]
    return [(mla_source(v3.attrs("float16"), "float16", TILES[0]), 80),
            (mla_source(v3.attrs("int8"), "bfloat16", TILES[0]), 90),
            (reduce_source(v3.attrs("float16"), "float16"), 80),
            (scores_source(v3.attrs("int8"), "float16"), 90)]
