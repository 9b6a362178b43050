"""What every op's TensorRT registration (its folder's trt.py, the `tensorrt.plugin` API with
ahead-of-time kernels, TensorRT >= 10.10) shares: the TensorRT check, registering once, the
dtype names both ways, the autotune type strings, the tactic -> tile lookup, and the launch of an
AOT Triton kernel over packed tokens.

    register_once(op, define)  check_tensorrt(op), then define(dtype names) once per process
    type_combinations(...)     "FP16, FP16, INT8, INT64, ..." per (activation, pool) pair
    tactic_tile(...)           a TensorRT tactic id -> the op's tile (or "rebuild the engine")
    aot_launch(...)            (kernel name, PTX, KernelLaunchParams, int32 extra args) of a
                               kernel with grid (T // tokens per program + S, grid_y)

NOTE: no `from __future__ import annotations` in the ops' trt.py (tensorrt.plugin reads the
decorated functions' annotations as classes); nothing here is decorated. Type-checked against
`tensorrt-stubs` through the ops' modules (tests/tensorrt/test_typecheck.py); the stubs do not
cover `tensorrt.plugin`, and TensorRT has never run on the project's machines.
"""

from typing import Any, Callable, Dict, Iterable, List, Protocol, Sequence, Tuple, TypeVar

from kvexport.errors import EngineBuildError, KvExportError, TensorRTUnavailableError

# TensorRT type names (tensorrt.plugin AutoTuneCombination) of the specs' dtypes (int4: rows of UINT8)
TRT_TYPES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "int8": "INT8", "int4": "UINT8"}
INDEX_TYPES = ("INT64",) * 4  # block_tables, seq_lens, query_start_loc, slot_mapping
_REGISTERED: set = set()  # op types registered in this process



class _Tile(Protocol):
    @property
    def tactic(self) -> int: ...


Tile = TypeVar("Tile", bound=_Tile)  # an op's tile configuration (configs.TileConfig)


def check_tensorrt(op_type: str) -> None:
    """TensorRTUnavailableError naming the kvexport::<op_type> plugin unless TensorRT >= 10.10 (with
    tensorrt.plugin.aot_impl) is importable."""
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp  # type: ignore[import-not-found, unused-ignore]  # not in the stubs
    except ImportError as e:
        raise TensorRTUnavailableError(
            f"TensorRT is not installed: the kvexport::{op_type} plugin needs TensorRT >= 10.10 "
            "(`pip install tensorrt` on a machine with an NVIDIA GPU and driver). ONNX builds and the "
            f"onnxruntime backend do not need it. ({e})") from e
    if not hasattr(trtp, "aot_impl"):
        raise TensorRTUnavailableError(f"TensorRT {getattr(trt, '__version__', '?')} has no "
                                       "tensorrt.plugin.aot_impl; ahead-of-time plugins need TensorRT >= 10.10")


def register_once(op_type: str, define: Callable[[Dict[Any, str]], None], int4_pools: bool = False) -> None:
    """Registers an op with TensorRT's plugin registry, once per process: check_tensorrt(op_type),
    then define(dtype names: trt.DataType -> spec dtype name; UINT8 -> "int4" with int4_pools)."""
    if op_type in _REGISTERED:
        return
    check_tensorrt(op_type)
    import tensorrt as trt

    names: Dict[trt.DataType, str] = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16",
                                      trt.int8: "int8"}
    if int4_pools:
        names[trt.uint8] = "int4"
    define(names)
    _REGISTERED.add(op_type)


def type_combinations(pairs: Iterable[Tuple[str, str]],
                      row: Callable[[str, str], Sequence[str]]) -> List[str]:
    """The autotune type strings, one per (activation, pool) dtype pair: row(activation TensorRT type,
    pool TensorRT type) lists every input's then every output's type in spec order."""
    return [", ".join(row(TRT_TYPES[act], TRT_TYPES[kv])) for act, kv in pairs]


def tactic_tile(op_type: str, tiles: Iterable[Tile], tactic: int) -> Tile:
    """The tile of a TensorRT tactic id (each tile's `.tactic`); an unknown one is an engine built by
    another kvexport version."""
    for tile in tiles:
        if tile.tactic == tactic:
            return tile
    raise EngineBuildError(f"unknown {op_type} tactic {tactic}: the engine was built by another kvexport "
                           "version; rebuild it")


def text_attr(value: Any) -> str:
    """A string attribute as tensorrt.plugin hands it (bytes or str) -> str."""
    return value.decode() if isinstance(value, bytes) else value


def check_pool(op_type: str, pool: str, kv_dtype: str) -> None:
    """The pool tensor's dtype must be the node's kv_dtype attribute."""
    if pool != kv_dtype:
        raise KvExportError(f"{op_type}: pool dtype {pool} != kv_dtype attribute {kv_dtype}")


def aot_launch(trtp: Any, kernel: Any, num_tokens: Any, num_seqs: Any, tokens_per_program: int, grid_y: int,
               max_blocks: Any, num_blocks: Any) -> Tuple[Any, Any, Any, Any]:
    """(kernel name, PTX, KernelLaunchParams, int32 extra args) of a compiled Triton kernel over
    packed tokens: grid (num_tokens // tokens_per_program + num_seqs, grid_y) — q-tiles:
    T // BLOCK_Q + S bounds them all — and the kernel's scalars after its inputs: num_seqs,
    max_blocks, num_blocks (shape expressions of the inputs)."""
    params = trtp.KernelLaunchParams()
    params.grid_x = num_tokens // tokens_per_program + num_seqs
    params.grid_y = grid_y
    params.block_x = kernel.metadata.num_warps * 32
    params.shared_mem = kernel.metadata.shared
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(num_seqs), trtp.SymInt32(max_blocks),
                                         trtp.SymInt32(num_blocks)])
    return kernel.metadata.name, kernel.asm["ptx"], params, extra
