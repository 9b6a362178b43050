"""Kernel configurations of `kvexport::GatedDeltaRule`: the one list of tile configs (the TensorRT
plugin's tactics), the representative model shapes, and how one configuration becomes a
`triton.compile` source — shared by the launcher (launch.py), the TensorRT ahead-of-time
registration (trt.py), the PTX compile tests and the GPU check.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common import kernel_source
from ..common.kernel_source import AOT_TARGETS, GPU_ACT_DTYPES, TRITON_TYPES, pow2  # noqa: F401  (shared by every op)
from .spec import GatedDeltaAttrs


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One tiling of the kernel (a TensorRT tactic)."""

    block_v: int  # value channels per program; power of 2
    num_warps: int

    @property
    def tactic(self) -> int:  # TensorRT tactic id: 1-based, stable by list position
        return TILES.index(self) + 1


# NOTE: the order is part of the engine format (tactic ids are positions); append only. The state
# slice [Dk, BLOCK_V] float32 lives in registers: 128 x 32 over 4 warps is 32 a thread.
TILES = (TileConfig(32, 4), TileConfig(64, 4), TileConfig(16, 2))
INTERPRET_TILE = TileConfig(16, 1)


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's gated DeltaNet shape, for ahead-of-time compilation."""

    name: str
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int

    def attrs(self) -> GatedDeltaAttrs:
        return GatedDeltaAttrs(self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim,
                               self.k_head_dim ** -0.5, 1)


# Qwen3.5-0.8B (16 q/k and 16 value heads of 128) and Qwen3-Next-80B-A3B (16 q/k, 32 value heads)
SHAPES = (Shape("qwen3.5-0.8b", 16, 16, 128, 128), Shape("qwen3-next-80b", 16, 32, 128, 128))


def constexprs(attrs: GatedDeltaAttrs, tile: TileConfig) -> dict:
    return dict(HK=attrs.num_k_heads, HV=attrs.num_v_heads, DK=attrs.k_head_dim, DV=attrs.v_head_dim,
                BLOCK_K=max(16, pow2(attrs.k_head_dim)), BLOCK_V=min(tile.block_v, max(16, pow2(attrs.v_head_dim))),
                SCALE=float(attrs.scale), L2NORM=bool(attrs.use_qk_l2norm))


@dataclass(frozen=True, slots=True)
class KernelSource(kernel_source.KernelSource):
    """One configuration of the GatedDeltaRule kernel: "gated_delta"."""

    def kernel_fn(self):
        from . import kernels

        return {"gated_delta": kernels.gated_delta_kernel}[self.kernel]


def source(attrs: GatedDeltaAttrs, act: str, tile: TileConfig) -> KernelSource:
    """gated_delta_kernel(9 inputs, 2 outputs) — the AOT kernel (q, k, v and the output in `act`)."""
    a = "*" + TRITON_TYPES[act]
    const = constexprs(attrs, tile)
    sig = {"q_ptr": a, "k_ptr": a, "v_ptr": a, "g_ptr": "*fp32", "beta_ptr": "*fp32", "state_ptr": "*fp32",
           "slots_ptr": "*i64", "seq_lens_ptr": "*i64", "qsl_ptr": "*i64", "out_ptr": a, "new_state_ptr": "*fp32",
           **{k: "constexpr" for k in const}}
    return KernelSource("gated_delta", sig, const, tile.num_warps, 1)


def all_sources() -> list[KernelSource]:
    """Every GPU configuration: both shapes × fp16 / bf16 × every tile."""
    return [source(shape.attrs(), act, t) for shape in SHAPES for act in GPU_ACT_DTYPES for t in TILES]


def ci_sources() -> list[tuple[KernelSource, int]]:
    """The CI subset: Qwen3.5-0.8B's shape, fp16 with the first tile for sm_90, bf16 with the second for sm_80."""
    attrs = SHAPES[0].attrs()
    return [(source(attrs, "float16", TILES[0]), 90), (source(attrs, "bfloat16", TILES[1]), 80)]
