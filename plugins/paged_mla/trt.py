"""TensorRT registration of `kvexport::PagedMLA` with the `tensorrt.plugin` API (quickly deployable
plugins, TensorRT >= 10.10 for ahead-of-time kernels), as plugins/paged_attention/trt.py does for
PagedAttention.

    register()   defines, once, on the caller's request (never at import):
      @trtp.register   shapes/dtypes: output [T, H, kv_lora_rank] of the query's dtype; output 1
                       aliases the pool
      @trtp.autotune   (activation, pool) dtype combinations × tactics (configs.TILES)
      @trtp.aot_impl   compiles kernels.mla_kernel for the build GPU and returns (kernel name, PTX,
                       KernelLaunchParams, int32 extra args): the kernel is baked into the engine.

NOTE (one launch): an AOT plugin is a single kernel launch, so the AOT kernel is the fused store +
attention `mla_kernel` (any q_len) without split-K; split-K (two launches) is the JIT launcher's
(launch.py). NOTE (8 inputs): no optional tensors in a QDP signature, so kv_scale is always an
input (ignored unless int8). NOTE: no `from __future__ import annotations` here — tensorrt.plugin
reads the decorated functions' annotations as classes.

What every op's registration shares (the TensorRT check, registering once, type strings, tactic
lookup, the AOT launch) is plugins/common/trt.py's. Type-checked against `tensorrt-stubs`
(tests/tensorrt/test_typecheck.py); TensorRT is not installable on the project's machines, so the
registration has never run.
"""

from typing import Any, Dict, List, Tuple, Union

from kvexport.errors import TensorRTUnavailableError  # noqa: F401  (register() raises it)

from ..common import trt as common
from . import configs, spec
from .spec import PagedMLAAttrs


def type_combinations() -> List[str]:
    """The autotune type strings, one per (activation, pool) pair, over the 8 inputs and 2 outputs
    in spec order: query, latent, latent_cache, 4 index tensors, kv_scale | output, latent_cache."""
    return common.type_combinations(configs.kv_pairs(), lambda a, p: (a, a, p) + common.INDEX_TYPES + ("FP32", a, p))


def tactic_tile(tactic: int) -> configs.TileConfig:
    """The tile of a TensorRT tactic id (configs.TileConfig.tactic)."""
    return common.tactic_tile(spec.OP_TYPE, configs.TILES, tactic)


def aot_kernel(attrs: PagedMLAAttrs, act: str, tactic: int, capability: Union[int, None] = None):
    """(KernelSource, CompiledKernel) of the AOT kernel; capability None = the current GPU."""
    src = configs.mla_source(attrs, act, tactic_tile(tactic))
    return src, src.compile(capability)


def launch_grid(attrs: PagedMLAAttrs, tactic: int) -> Tuple[int, int]:
    """(tokens per program, programs along the head axis) of a tactic: the AOT grid is
    (T // tokens + S, head programs)."""
    tile = tactic_tile(tactic)
    heads = configs.heads_per_program(tile, attrs.num_heads)
    return tile.block_m // heads, -(-attrs.num_heads // heads)


def register() -> None:
    """Registers the plugin with TensorRT's plugin registry (idempotent). Raises
    TensorRTUnavailableError when TensorRT (>= 10.10, with tensorrt.plugin.aot_impl) is missing."""
    common.register_once(spec.OP_TYPE, _define)


def _define(dtype_names: Dict[Any, str]) -> None:
    import tensorrt.plugin as trtp  # type: ignore[import-not-found, unused-ignore]
    from tensorrt.plugin import TensorDesc as TD  # type: ignore[import-not-found, unused-ignore]

    @trtp.register(spec.PLUGIN_ID)
    def paged_mla_desc(query: TD, latent: TD, latent_cache: TD, block_tables: TD, seq_lens: TD,
                       query_start_loc: TD, slot_mapping: TD, kv_scale: TD, num_heads: int, kv_lora_rank: int,
                       qk_rope_head_dim: int, block_size: int, scale: float, kv_dtype: str) -> Tuple[TD, TD]:
        # output [T, H, L]: the query's [T, H, L + R] with the last axis L; the pool updated in place
        out = trtp.from_shape_expr((query.shape_expr[0], query.shape_expr[1], kv_lora_rank), dtype=query.dtype)
        return out, latent_cache.aliased()

    @trtp.autotune(spec.PLUGIN_ID)
    def paged_mla_autotune(query: TD, latent: TD, latent_cache: TD, block_tables: TD, seq_lens: TD,
                           query_start_loc: TD, slot_mapping: TD, kv_scale: TD, outputs: Tuple[TD, TD]
                           ) -> List[trtp.AutoTuneCombination]:
        tactics = [t.tactic for t in configs.TILES]
        return [trtp.AutoTuneCombination(types, "LINEAR", tactics) for types in type_combinations()]

    @trtp.aot_impl(spec.PLUGIN_ID)
    def paged_mla_aot(query: TD, latent: TD, latent_cache: TD, block_tables: TD, seq_lens: TD,
                      query_start_loc: TD, slot_mapping: TD, kv_scale: TD, num_heads: int, kv_lora_rank: int,
                      qk_rope_head_dim: int, block_size: int, scale: float, kv_dtype: str,
                      outputs: Tuple[TD, TD], tactic: int
                      ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        attrs = PagedMLAAttrs(num_heads, kv_lora_rank, qk_rope_head_dim, block_size, scale,
                              common.text_attr(kv_dtype))
        act, pool = dtype_names[query.dtype], dtype_names[latent_cache.dtype]
        common.check_pool(spec.OP_TYPE, pool, attrs.kv_dtype)
        src, kernel = aot_kernel(attrs, act, tactic)
        block_q, head_programs = launch_grid(attrs, tactic)
        # query [T, H, W], seq_lens [S]; kernel scalars after the 8 inputs: num_seqs, max_blocks, num_blocks
        return common.aot_launch(trtp, kernel, query.shape_expr[0], seq_lens.shape_expr[0], block_q, head_programs,
                                 block_tables.shape_expr[1], latent_cache.shape_expr[1])
