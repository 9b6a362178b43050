"""TensorRT registration of `kvexport::PagedAttention` with the `tensorrt.plugin` API
(quickly deployable plugins, TensorRT >= 10.10 for ahead-of-time kernels).

    register()   defines, once, on the caller's request (never at import):
      @trtp.register   shapes/dtypes: output = query.like(); outputs 1, 2 alias the pools
      @trtp.autotune   (activation, pool) dtype combinations × tactics (configs.PREFILL_TILES)
      @trtp.aot_impl   compiles kernels.prefill_kernel for the build GPU and returns
                       (kernel name, PTX, KernelLaunchParams, int32 extra args): the kernel is
                       baked into the engine, which then runs in trtexec / Triton Inference
                       Server without Python.
    and kvexport::PagedAttentionScores (spec.SCORES_OP_TYPE: the attention_scores output as a node of
    its own, since a QDP has no optional inputs and one kernel): kernels.scores_kernel, grid
    (num_seqs, kv_heads), its output [num_seqs, kv_heads, max_blocks * block_size] float32 shaped
    from the inputs' shape expressions. UNVERIFIED like the rest (TensorRT has never run here), and no
    exporter emits the node yet (spec.py "Attention scores").

NOTE (one launch): an AOT plugin is a single kernel launch, so the AOT kernel is the fused
store + attention `prefill_kernel` (any q_len; decode too) without split-K; split-K decode
(two launches) is a JIT-only (launch.py) path. NOTE (11 inputs): a QDP signature has no
optional tensors, so the plugin always takes k_scale / v_scale (ignored unless int8).
NOTE (attention sinks): a 1-D float32 array attribute (GPT-OSS), not a 12th input (no optional
inputs); its default, empty, is what graphs without the attribute mean. UNVERIFIED: that
tensorrt.plugin takes a default for an attribute the node lacks (TensorRT has never run here).
NOTE (int4): int4 pools are UINT8 tensors of rows (codes + per-token float16 scales,
kvexport/io.py KV_INT4_FORMAT); the kv_dtype attribute "int4" tells them from other byte tensors.
NOTE: no `from __future__ import annotations` here — tensorrt.plugin reads the annotations
of the decorated functions as classes.

What every op's registration shares (the TensorRT check, registering once, type strings, tactic
lookup, the AOT launch) is plugins/common/trt.py's. Type-checked against `tensorrt-stubs`
(tests/tensorrt/test_typecheck.py); the stubs do not cover `tensorrt.plugin`, and TensorRT itself
is not installable on the project's machines, so the registration has never run (README.md,
"What is verified how").
"""

from typing import Any, Dict, List, Tuple, Union

import numpy as np
import numpy.typing as npt

from kvexport.errors import TensorRTUnavailableError  # noqa: F401  (register() raises it)

from ..common import trt as common
from . import configs, spec
from .spec import PagedAttentionAttrs

# attention_sinks (a float32 array attribute): nodes without it (graphs exported before sinks, models
# without them) take none; the sinks are compiled into the layer's kernel (kernels.py SINKS)
_NO_SINKS = np.zeros(0, np.float32)


def type_combinations() -> List[str]:
    """The autotune type strings, one per (activation, pool) pair, over the 11 inputs and 3
    outputs in spec order: q, k, v, key_cache, value_cache, 4 index tensors, k_scale,
    v_scale | output, key_cache, value_cache."""
    return common.type_combinations(configs.kv_pairs(),
                                    lambda a, p: (a, a, a, p, p) + common.INDEX_TYPES + ("FP32", "FP32", a, p, p))


SCORES_TACTIC = 1  # the scores plugin's one tactic (configs.SCORES_TILE)


def scores_type_combinations() -> List[str]:
    """The scores plugin's autotune type strings (spec.SCORES_INPUTS, then the scores output): q, key_cache,
    block_tables, seq_lens, query_start_loc, k_scale, observation_lens | attention_scores."""
    return common.type_combinations(configs.kv_pairs(),
                                    lambda a, p: (a, p, "INT64", "INT64", "INT64", "FP32", "INT64", "FP32"))


def scores_aot_kernel(attrs: PagedAttentionAttrs, act: str, capability: Union[int, None] = None,
                      per_channel_scales: bool = True):
    """(KernelSource, CompiledKernel) of the scores plugin's kernel; capability None = the current GPU."""
    src = configs.scores_source(attrs, act, per_channel_scales=per_channel_scales)
    return src, src.compile(capability)


def tactic_tile(tactic: int) -> configs.TileConfig:
    """The prefill tile of a TensorRT tactic id (configs.TileConfig.tactic)."""
    return common.tactic_tile(spec.OP_TYPE, configs.PREFILL_TILES, tactic)


def aot_kernel(attrs: PagedAttentionAttrs, act: str, tactic: int, capability: Union[int, None] = None,
               per_channel_scales: bool = True):
    """(KernelSource, CompiledKernel) of the AOT kernel; capability None = the current GPU."""
    src = configs.prefill_source(attrs, act, tactic_tile(tactic), per_channel_scales)
    return src, src.compile(capability)


def register() -> None:
    """Registers the plugin with TensorRT's plugin registry (idempotent). Raises
    TensorRTUnavailableError when TensorRT (>= 10.10, with tensorrt.plugin.aot_impl) is missing."""
    common.register_once(spec.OP_TYPE, _define, int4_pools=True)


def _define(dtype_names: Dict[Any, str]) -> None:
    import tensorrt.plugin as trtp  # type: ignore[import-not-found, unused-ignore]
    from tensorrt.plugin import TensorDesc as TD  # type: ignore[import-not-found, unused-ignore]

    @trtp.register(spec.PLUGIN_ID)
    def paged_attention_desc(query: TD, key: TD, value: TD, key_cache: TD, value_cache: TD, block_tables: TD,
                             seq_lens: TD, query_start_loc: TD, slot_mapping: TD, k_scale: TD, v_scale: TD,
                             num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float,
                             sliding_window: int, kv_dtype: str, logit_softcap: float,
                             attention_sinks: npt.NDArray[np.float32] = _NO_SINKS) -> Tuple[TD, TD, TD]:
        # output [T, H, D] like the query; the pools are updated in place (spec.ALIASES)
        return query.like(), key_cache.aliased(), value_cache.aliased()

    @trtp.autotune(spec.PLUGIN_ID)
    def paged_attention_autotune(query: TD, key: TD, value: TD, key_cache: TD, value_cache: TD,
                                 block_tables: TD, seq_lens: TD, query_start_loc: TD, slot_mapping: TD,
                                 k_scale: TD, v_scale: TD, outputs: Tuple[TD, TD, TD]
                                 ) -> List[trtp.AutoTuneCombination]:
        tactics = [t.tactic for t in configs.PREFILL_TILES]
        return [trtp.AutoTuneCombination(types, "LINEAR", tactics) for types in type_combinations()]

    @trtp.aot_impl(spec.PLUGIN_ID)
    def paged_attention_aot(query: TD, key: TD, value: TD, key_cache: TD, value_cache: TD, block_tables: TD,
                            seq_lens: TD, query_start_loc: TD, slot_mapping: TD, k_scale: TD, v_scale: TD,
                            num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float,
                            sliding_window: int, kv_dtype: str, logit_softcap: float,
                            attention_sinks: npt.NDArray[np.float32], outputs: Tuple[TD, TD, TD], tactic: int
                            ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        attrs = PagedAttentionAttrs(num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window,
                                    common.text_attr(kv_dtype), logit_softcap,
                                    tuple(np.asarray(attention_sinks, np.float32).reshape(-1).tolist()))
        act, pool = dtype_names[query.dtype], dtype_names[key_cache.dtype]
        common.check_pool(spec.OP_TYPE, pool, attrs.kv_dtype)
        # int8 scales [kvH, head_dim] (per channel) or [kvH] (per head: builds before per-channel)
        src, kernel = aot_kernel(attrs, act, tactic, per_channel_scales=k_scale.ndim == 2)
        block_q = src.constexprs["BLOCK_M"] // attrs.group_size
        # query [T, H, D], seq_lens [S]; kernel scalars after the 11 inputs: num_seqs, max_blocks, num_blocks
        return common.aot_launch(trtp, kernel, query.shape_expr[0], seq_lens.shape_expr[0], block_q, num_kv_heads,
                                 block_tables.shape_expr[1], key_cache.shape_expr[1])

    @trtp.register(spec.SCORES_PLUGIN_ID)
    def paged_attention_scores_desc(query: TD, key_cache: TD, block_tables: TD, seq_lens: TD, query_start_loc: TD,
                                    k_scale: TD, observation_lens: TD, num_heads: int, num_kv_heads: int,
                                    head_dim: int, block_size: int, scale: float, sliding_window: int, kv_dtype: str,
                                    logit_softcap: float, attention_sinks: npt.NDArray[np.float32] = _NO_SINKS
                                    ) -> TD:
        import tensorrt as trt

        # attention_scores [num_seqs, kv_heads, max_blocks * block_size] float32 (spec.py "Attention scores")
        return trtp.from_shape_expr((seq_lens.shape_expr[0], num_kv_heads, block_tables.shape_expr[1] * block_size),
                                    dtype=trt.float32)

    @trtp.autotune(spec.SCORES_PLUGIN_ID)
    def paged_attention_scores_autotune(query: TD, key_cache: TD, block_tables: TD, seq_lens: TD,
                                        query_start_loc: TD, k_scale: TD, observation_lens: TD, outputs: Tuple[TD]
                                        ) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(types, "LINEAR", [SCORES_TACTIC]) for types in scores_type_combinations()]

    @trtp.aot_impl(spec.SCORES_PLUGIN_ID)
    def paged_attention_scores_aot(query: TD, key_cache: TD, block_tables: TD, seq_lens: TD, query_start_loc: TD,
                                   k_scale: TD, observation_lens: TD, num_heads: int, num_kv_heads: int,
                                   head_dim: int, block_size: int, scale: float, sliding_window: int, kv_dtype: str,
                                   logit_softcap: float, attention_sinks: npt.NDArray[np.float32],
                                   outputs: Tuple[TD], tactic: int
                                   ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,
                                              trtp.SymExprs]:
        attrs = PagedAttentionAttrs(num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window,
                                    common.text_attr(kv_dtype), logit_softcap,
                                    tuple(np.asarray(attention_sinks, np.float32).reshape(-1).tolist()))
        act, pool = dtype_names[query.dtype], dtype_names[key_cache.dtype]
        common.check_pool(spec.SCORES_OP_TYPE, pool, attrs.kv_dtype)
        _src, kernel = scores_aot_kernel(attrs, act, per_channel_scales=k_scale.ndim == 2)
        # grid (num_seqs, kv_heads); kernel scalars after the 7 inputs: max_blocks, num_blocks, score_len
        params = trtp.KernelLaunchParams()
        params.grid_x = seq_lens.shape_expr[0]
        params.grid_y = num_kv_heads
        params.block_x = kernel.metadata.num_warps * 32
        params.shared_mem = kernel.metadata.shared
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(block_tables.shape_expr[1]),
                                             trtp.SymInt32(key_cache.shape_expr[1]),
                                             trtp.SymInt32(block_tables.shape_expr[1] * block_size)])
        return kernel.metadata.name, kernel.asm["ptx"], params, extra
