"""TensorRT registration of `kvexport::GatedDeltaRule` with the `tensorrt.plugin` API (quickly
deployable plugins, TensorRT >= 10.10 for ahead-of-time kernels), as plugins/paged_mla/trt.py does
for PagedMLA.

    register()   defines, once, on the caller's request (never at import):
      @trtp.register   shapes/dtypes: output [T, Hv, Dv] like value; new_recurrent_state
                       [S, Hv, Dk, Dv] float32 (S from state_slots, the rest from the pool)
      @trtp.autotune   fp16 / bf16 activations × tactics (configs.TILES)
      @trtp.aot_impl   compiles kernels.gated_delta_kernel for the build GPU and returns (kernel
                       name, PTX, KernelLaunchParams with grid (S, Hv, cdiv(Dv, BLOCK_V)), no extra
                       scalars): the kernel is baked into the engine.

NOTE: the pool is an input only, the new states an output (spec.py): no aliasing. NOTE: no `from
__future__ import annotations` here — tensorrt.plugin reads the decorated functions' annotations as
classes. Type-checked against `tensorrt-stubs` (tests/tensorrt/test_typecheck.py); TensorRT is not
installable on the project's machines, so the registration has never run.
"""

from typing import Any, Dict, List, Tuple, Union

from kvexport.errors import TensorRTUnavailableError  # noqa: F401  (register() raises it)

from ..common import trt as common
from . import configs, spec
from .spec import GatedDeltaAttrs


def type_combinations() -> List[str]:
    """The autotune type strings, one per activation dtype, over the 9 inputs and 2 outputs in spec
    order: query, key, value, g, beta, recurrent_state, 3 index tensors | output, new_recurrent_state."""
    return common.type_combinations([(a, a) for a in configs.GPU_ACT_DTYPES],
                                    lambda a, _: (a, a, a, "FP32", "FP32", "FP32") + ("INT64",) * 3 + (a, "FP32"))


def tactic_tile(tactic: int) -> configs.TileConfig:
    """The tile of a TensorRT tactic id (configs.TileConfig.tactic)."""
    return common.tactic_tile(spec.OP_TYPE, configs.TILES, tactic)


def aot_kernel(attrs: GatedDeltaAttrs, act: str, tactic: int, capability: Union[int, None] = None):
    """(KernelSource, CompiledKernel) of the AOT kernel; capability None = the current GPU."""
    src = configs.source(attrs, act, tactic_tile(tactic))
    return src, src.compile(capability)


def launch_grid(attrs: GatedDeltaAttrs, tactic: int) -> Tuple[int, int]:
    """(grid_y, grid_z) of a tactic: value heads, value-channel tiles (grid_x is the sequences)."""
    block_v = configs.constexprs(attrs, tactic_tile(tactic))["BLOCK_V"]
    return attrs.num_v_heads, -(-attrs.v_head_dim // block_v)


def register() -> None:
    """Registers the plugin with TensorRT's plugin registry (idempotent). Raises
    TensorRTUnavailableError when TensorRT (>= 10.10, with tensorrt.plugin.aot_impl) is missing."""
    common.register_once(spec.OP_TYPE, _define)


def _define(dtype_names: Dict[Any, str]) -> None:
    import tensorrt.plugin as trtp  # type: ignore[import-not-found, unused-ignore]
    from tensorrt.plugin import TensorDesc as TD  # type: ignore[import-not-found, unused-ignore]

    @trtp.register(spec.PLUGIN_ID)
    def gated_delta_desc(query: TD, key: TD, value: TD, g: TD, beta: TD, recurrent_state: TD, state_slots: TD,
                         seq_lens: TD, query_start_loc: TD, num_k_heads: int, num_v_heads: int, k_head_dim: int,
                         v_head_dim: int, scale: float, use_qk_l2norm: int) -> Tuple[TD, TD]:
        new_state = trtp.from_shape_expr((state_slots.shape_expr[0], recurrent_state.shape_expr[1],
                                          recurrent_state.shape_expr[2], recurrent_state.shape_expr[3]),
                                         dtype=recurrent_state.dtype)
        return value.like(), new_state

    @trtp.autotune(spec.PLUGIN_ID)
    def gated_delta_autotune(query: TD, key: TD, value: TD, g: TD, beta: TD, recurrent_state: TD, state_slots: TD,
                             seq_lens: TD, query_start_loc: TD, outputs: Tuple[TD, TD]
                             ) -> List[trtp.AutoTuneCombination]:
        tactics = [t.tactic for t in configs.TILES]
        return [trtp.AutoTuneCombination(types, "LINEAR", tactics) for types in type_combinations()]

    @trtp.aot_impl(spec.PLUGIN_ID)
    def gated_delta_aot(query: TD, key: TD, value: TD, g: TD, beta: TD, recurrent_state: TD, state_slots: TD,
                        seq_lens: TD, query_start_loc: TD, num_k_heads: int, num_v_heads: int, k_head_dim: int,
                        v_head_dim: int, scale: float, use_qk_l2norm: int, outputs: Tuple[TD, TD], tactic: int
                        ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        attrs = GatedDeltaAttrs(num_k_heads, num_v_heads, k_head_dim, v_head_dim, scale, use_qk_l2norm)
        _, kernel = aot_kernel(attrs, dtype_names[query.dtype], tactic)
        grid_y, grid_z = launch_grid(attrs, tactic)
        params = trtp.KernelLaunchParams()
        params.grid_x = state_slots.shape_expr[0]
        params.grid_y = grid_y
        params.grid_z = grid_z
        params.block_x = kernel.metadata.num_warps * 32
        params.shared_mem = kernel.metadata.shared
        return kernel.metadata.name, kernel.asm["ptx"], params, trtp.SymIntExprs(0)
