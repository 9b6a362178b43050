"""TensorRT engines for a `plugin`-attention build: parse prefill.onnx / decode.onnx, build
one engine per phase with an optimization profile derived from typed limits, and return the
manifest's `engines` entry (its schema, `EnginesEntry` and the `EngineBuildOptions` it records,
lives in kvexport/manifest_engines.py; the TensorRT/CUDA checks, shared with the runtime, in
kvexport/tensorrt_env.py).

    build dir (plugin graphs)                       build dir/engines/
      prefill.onnx ──┐                                prefill.plan
      decode.onnx  ──┼─ OnnxParser ─ profile ─ build ─ decode.plan
      weights.data ──┘   (strongly typed)              timing.cache  (reused by later builds)

The caller runs this after the ONNX build is complete and in place, so a missing TensorRT or
GPU never costs the ONNX part: `TensorRTUnavailableError` says what is missing and that the
build is usable with onnxruntime as it is.

NOTE: precision. The networks are created STRONGLY_TYPED: every tensor's type comes from the
ONNX graph (fp32 or fp16 graphs from `kvexport build --dtype`). The weak-typing builder flags
(BuilderFlag.FP16/BF16) are deprecated since TensorRT 10.12 and removed in 11, and under weak
typing TensorRT may put a cast in front of a plugin input; for the aliased KV pools that would
turn the in-place write into a write to a copy. So `precision` must equal the graphs' dtype,
and since the plugin kernels take fp16/bf16 activations, that is an fp16 graph today (fp32
builds are refused; `tf32` is kept for fp32 matmuls should fp32 plugin kernels come); bf16
needs a bf16 graph. A mismatch raises ConfigError saying what to rebuild. Quantized weights
(`--weights int4`) pass to TensorRT the same way, by type: the graphs' block-wise INT4
DequantizeLinear -> MatMul become weight-only INT4 GEMMs; what TensorRT's Q/DQ cannot take
(zero points, int8 blocks, other block sizes) is refused first (engine_quantization).

NOTE: this glue follows the TensorRT Python API documentation and is type-checked against
`tensorrt-stubs` (tests/tensorrt/test_typecheck.py); it has never run against a real TensorRT
on the project's machines (TensorRT cannot be installed there). See docs/TENSORRT.md.
"""

from __future__ import annotations

import importlib
import logging
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from kvexport import io, outputs
from kvexport import manifest as mf
from kvexport.errors import ConfigError, EngineBuildError, KvExportError, TensorRTUnavailableError
from kvexport.manifest import (EngineBuildOptions, EngineFile, EngineLimits, EnginesEntry, Manifest, PluginInfo,
                               ShapeRange, sha256)
from kvexport.tensorrt_env import cuda_device, register_plugins, require_tensorrt, trt_logger

if TYPE_CHECKING:  # typed by tensorrt-stubs; imported for real only inside functions
    import tensorrt as trt

__all__ = ["EngineBuildOptions", "EngineQuantization", "ShapeRange", "TensorRTUnavailableError", "add_engines",
           "axis_ranges", "build_engines", "check_buildable", "engine_quantization", "profile_shapes",
           "weight_problems", "write_atomically"]

log = logging.getLogger(__name__)

ENGINES_DIR = "engines"
ENGINE_FILES = {io.Phase.PREFILL: "prefill.plan", io.Phase.DECODE: "decode.plan"}
TIMING_CACHE = "timing.cache"
_T = TypeVar("_T")


# ---- optimization profiles (pure Python) ---------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def axis_ranges(manifest: Manifest, opts: EngineBuildOptions, phase: io.Phase) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every dynamic axis of `phase`'s graph.

    opt = max for the token/sequence/pool axes (the steady state of a loaded server: decode at
    full batch, prefill chunks filling the token budget, one big pool); the block-table width
    is tuned for `opt_seq_len`. Every sequence has >= 1 token and >= 1 block (plugin block
    tables cover seq_lens), so a prefill step has at most min(max_num_seqs, max_tokens)
    sequences."""
    kv = manifest.kv
    max_len = opts.max_seq_len or kv.max_seq_len
    if max_len > kv.max_seq_len:
        raise ConfigError(f"engine max_seq_len {max_len} exceeds the graphs' {kv.max_seq_len} "
                          f"(rebuild the ONNX with a larger --max-seq-len)")
    opt_len = min(opts.opt_seq_len or max(1, max_len // 2), max_len)
    max_blocks = _cdiv(max_len, kv.block_size)
    if phase is io.Phase.DECODE:
        seqs = opts.max_num_seqs
        tokens = seqs
    else:
        tokens = opts.max_num_batched_tokens
        seqs = min(opts.max_num_seqs, tokens)
    ranges = {
        io.NUM_SEQS: (1, seqs, seqs),
        io.NUM_SEQS_PLUS_1: (2, seqs + 1, seqs + 1),
        io.MAX_BLOCKS: (1, _cdiv(opt_len, kv.block_size), max_blocks),
        io.NUM_BLOCKS: (2, opts.max_num_blocks, opts.max_num_blocks),
    }
    if manifest.layer_groups is not None:  # the local KV cache group's pools (kvexport/io.py): as many at most
        ranges[io.num_blocks_axis(io.LOCAL_GROUP)] = (2, opts.max_num_blocks, opts.max_num_blocks)
    if phase is io.Phase.PREFILL:
        ranges[io.NUM_TOKENS] = (1, tokens, tokens)
        # io.LOGITS_INDICES (builds that take it): a row per sequence usually, up to every token
        # (a verified draft's 1 + k rows, an echo's prompt rows)
        ranges[io.NUM_LOGITS] = (1, seqs, tokens)
    return ranges


def profile_shapes(manifest: Manifest, opts: EngineBuildOptions) -> dict[str, dict[str, ShapeRange]]:
    """phase -> input name -> ShapeRange, for every input the manifest lists for that graph."""
    out: dict[str, dict[str, ShapeRange]] = {}
    for phase in (io.Phase.PREFILL, io.Phase.DECODE):
        axes = axis_ranges(manifest, opts, phase)
        shapes = {}
        for spec in manifest.graphs[phase.value].inputs:
            dims: list[tuple[int, int, int]] = []
            for d in spec.shape:
                if isinstance(d, int):
                    dims.append((d, d, d))
                elif d in axes:
                    dims.append(axes[d])
                else:
                    raise KvExportError(f"input {spec.name!r} of the {phase.value} graph has axis {d!r}, which "
                                        f"the TensorRT profile does not know; rebuild with `kvexport build --force`")
            shapes[spec.name] = ShapeRange(*(tuple(d[k] for d in dims) for k in range(3)))
        out[phase.value] = shapes
    return out


def check_buildable(manifest: Manifest, opts: EngineBuildOptions) -> str:
    """Refuse builds TensorRT cannot serve before touching TensorRT; returns the precision."""
    if manifest.kv.layout != io.KVLayout.PAGED.value or manifest.kv.attention != io.Attention.PLUGIN.value:
        raise ConfigError(f"TensorRT engines are built from `--layout paged --attention plugin` graphs; this build "
                          f"has layout {manifest.kv.layout!r}, attention {manifest.kv.attention!r}: rebuild with "
                          f"`kvexport build MODEL --attention plugin`")
    precision = opts.precision or manifest.dtype
    if manifest.dtype == io.DType.FP32.value:
        raise ConfigError("the PagedAttention plugin kernels take fp16/bf16 activations (plugins/paged_attention/"
                          "README.md), so TensorRT engines need an fp16 build: rebuild with "
                          "`kvexport build MODEL --attention plugin --dtype fp16`")
    if precision != manifest.dtype:
        raise ConfigError(f"engine precision {precision} differs from the graphs' dtype {manifest.dtype}: engines are "
                          f"strongly typed, so the precision comes from the ONNX graph; rebuild it with "
                          f"`kvexport build MODEL --attention plugin --dtype {precision}`")
    engine_quantization(manifest.weights)  # ConfigError for weights TensorRT's Q/DQ cannot take
    return precision


# ---- quantized weights (pure Python) ---------------------------------------------------------------
# NOTE: what TensorRT's explicit quantization takes (TensorRT 10 docs, "Quantization Schemes" and the
# Dequantize operator): symmetric codes only (a zero point must be all zeros); block-wise scales for
# INT4 only, in blocks of 64 or 128 along one of the last two axes; INT8 per-tensor or per-channel.
# With strong typing no builder flag enables them (BuilderFlag.INT8/INT4 are deprecated since 10.12,
# "superseded by strong typing"): the ONNX initializers' INT4/INT8 types make the DequantizeLayers,
# and a DQ that feeds only a MatMul's weight input is weight-only quantization.
TRT_INT4_BLOCKS = (64, 128)


@dataclass(frozen=True, slots=True)
class EngineQuantization:
    """How the engines run a build's matmul weights (engine_quantization)."""

    weights: str  # the build's matmul weights: fp32 | fp16 | int8 | int4
    mode: str  # "none" (float weights) | "weight-only" (DQ -> MatMul, activations in the graph dtype)
    block_size: int | None  # rows of K per scale, 0 per output channel; None for float weights
    builder_flags: tuple[str, ...] = ()  # BuilderFlag names to set: none, strong typing decides


def weight_problems(bits: int, block_size: int, symmetric: bool = True, offsets: bool = False,
                    head_block_size: int | None = None) -> list[str]:
    """Why TensorRT cannot take weights quantized so (empty: it can); each reason says what to
    do. block_size 0 is per output channel (exporter/quantize.py CHANNEL); head_block_size is the
    int8 LM head's (None: no quantized head)."""
    out = []
    if bits == 8 and block_size:
        out.append(f"int8 weights in blocks of {block_size}: TensorRT dequantizes INT8 only per tensor or per "
                   f"channel; rebuild with --weight-block-size channel")
    elif bits == 4 and block_size not in TRT_INT4_BLOCKS:
        what = "per channel" if not block_size else f"in blocks of {block_size}"
        out.append(f"int4 weights {what}: TensorRT's INT4 blocks are {' or '.join(map(str, TRT_INT4_BLOCKS))}; "
                   f"rebuild with --weight-block-size 64 or 128")
    if not symmetric:
        out.append("the codes have zero points (AWQ/GPTQ asymmetric checkpoints, GGUF Q4_1), and TensorRT takes only "
                   "symmetric ones: build from the float checkpoint (round-to-nearest and --quant-method awq are "
                   "symmetric) or from a GPTQ sym=true checkpoint")
    if offsets:
        out.append("the matrices carry per-block offsets (GGUF Q4_1 minimums): build from a float checkpoint")
    if head_block_size:
        out.append(f"the int8 LM head is in blocks of {head_block_size} (an onnxruntime build): rebuild with "
                   f"--backend tensorrt, which quantizes it per channel")
    return out


def engine_quantization(weights: mf.WeightsEntry) -> EngineQuantization:
    """The quantization the engines take from a build's QDQ graphs, checked before TensorRT is
    touched; ConfigError listing every reason TensorRT cannot take it otherwise."""
    q = weights.quantization
    if q is None:
        return EngineQuantization(weights.precision or "fp16", "none", None)
    block = lambda b: 0 if b == "channel" else int(b)  # noqa: E731 - the manifest writes CHANNEL as "channel"
    head = block(q.head_block_size) if "lm_head.quantized" in q.quantized.names else None
    problems = weight_problems(q.bits, block(q.block_size), q.symmetric, q.block_offsets, head)
    if problems:
        raise ConfigError(f"TensorRT cannot build engines from these {q.precision} weights:\n  - "
                          + "\n  - ".join(problems))
    return EngineQuantization(q.precision, "weight-only", block(q.block_size))


# ---- writing engines/ atomically ---------------------------------------------------------------


def write_atomically(build_dir: Path, produce: Callable[[Path], _T]) -> _T:
    """Run produce(tmp) on a fresh temporary folder inside `build_dir` and rename it to
    `build_dir/engines` only when it returns; an existing engines/ is replaced then, and kept
    untouched on any failure (the temporary folder is removed). The old timing cache, if any,
    is copied into tmp first so a rebuild reuses it."""
    final = build_dir / ENGINES_DIR
    outputs.clean_stale(final)  # what killed earlier runs left
    tmp = outputs.new_temp_dir(build_dir, outputs.sibling_prefix(final))  # umask's permissions, not 0700
    try:
        if (final / TIMING_CACHE).is_file():
            shutil.copy2(final / TIMING_CACHE, tmp / TIMING_CACHE)
        result = produce(tmp)
        outputs.replace_dir(tmp, final)
    except BaseException:
        outputs.remove_dir(tmp)
        raise
    return result


# ---- TensorRT ------------------------------------------------------------------------------------


def _build_one(builder: trt.Builder, logger: trt.ILogger, onnx_path: Path, shapes: dict[str, ShapeRange],
               cache: trt.ITimingCache, opts: EngineBuildOptions, out: Path) -> None:
    """Parse one graph and write its serialized engine to `out`."""
    import tensorrt as trt

    flags = (1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)) \
        | (1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS))
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    # NOTE: parse_from_file (not parse(bytes)) so the parser finds weights.data next to the graph
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT could not parse {onnx_path.name}: {errors}. If it names "
                               f"{io.PLUGIN_OP}, the plugin was not registered (see docs/TENSORRT.md)")
    config = builder.create_builder_config()
    # the PagedAttention outputs key_cache_out/value_cache_out alias its pool inputs
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    if not opts.tf32:
        config.clear_flag(trt.BuilderFlag.TF32)
    config.builder_optimization_level = opts.optimization_level
    if opts.workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, opts.workspace_bytes)
    config.set_timing_cache(cache, False)
    profile = builder.create_optimization_profile()
    for name, r in shapes.items():
        profile.set_shape(name, trt.Dims(list(r.min)), trt.Dims(list(r.opt)), trt.Dims(list(r.max)))
    if config.add_optimization_profile(profile) < 0:
        raise EngineBuildError(f"TensorRT refused the optimization profile of {onnx_path.name}: "
                               f"{ {k: v.to_json() for k, v in shapes.items()} }")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"TensorRT built no engine from {onnx_path.name}; rerun with `-v` for its log")
    with open(out, "wb") as f:
        f.write(serialized)


def _kernel_configs() -> Any:
    """The plugin's kernel configurations (its TensorRT tactics) for the manifest: the tile
    lists of plugins/paged_attention/configs.py."""
    try:
        configs = importlib.import_module("kvexport.plugins.paged_attention.configs")
    except ImportError:
        log.warning("no kernel configurations found for %s::%s", io.PLUGIN_DOMAIN, io.PLUGIN_OP)
        return None
    tiles = lambda ts: [dict(asdict(t), tactic=t.tactic) for t in ts]  # noqa: E731
    return {"prefill": tiles(configs.PREFILL_TILES), "decode": tiles(configs.DECODE_TILES),
            "aot_targets": list(configs.AOT_TARGETS)}


def build_engines(build_dir: str | Path, manifest: Manifest,
                  opts: EngineBuildOptions = EngineBuildOptions()) -> EnginesEntry:
    """Build engines/prefill.plan and engines/decode.plan for a plugin build; returns the
    manifest's `engines` entry (files, sha256, TensorRT version, GPU, profiles, precision,
    plugin id/version and kernel configurations). Raises TensorRTUnavailableError without
    TensorRT or a GPU, ConfigError for a build or option TensorRT cannot serve,
    EngineBuildError when TensorRT fails; on any failure an existing engines/ is untouched."""
    build_dir = Path(build_dir)
    precision = check_buildable(manifest, opts)
    shapes = profile_shapes(manifest, opts)
    version = require_tensorrt()
    gpu = cuda_device(opts.device)
    import tensorrt as trt
    import torch

    torch.cuda.set_device(opts.device)
    quant = engine_quantization(manifest.weights)
    log.info("engine weights: %s (%s%s)", quant.weights, quant.mode,
             f", blocks of {quant.block_size}" if quant.block_size else "")
    register_plugins()  # PagedAttention, and PagedMLA for MLA graphs
    kernel_configs = _kernel_configs()

    def produce(tmp: Path) -> dict[str, EngineFile]:
        logger = trt_logger()
        builder = trt.Builder(logger)
        config = builder.create_builder_config()
        cache_file = tmp / TIMING_CACHE
        cache = config.create_timing_cache(cache_file.read_bytes() if cache_file.is_file() else b"")
        files: dict[str, EngineFile] = {}
        for phase in (io.Phase.PREFILL, io.Phase.DECODE):
            out = tmp / ENGINE_FILES[phase]
            log.info("building the TensorRT %s engine (%s)", phase.value, precision)
            _build_one(builder, logger, build_dir / manifest.graphs[phase.value].file, shapes[phase.value],
                       cache, opts, out)
            files[phase.value] = EngineFile(f"{ENGINES_DIR}/{out.name}", out.stat().st_size, sha256(out),
                                            shapes[phase.value])
        with open(cache_file, "wb") as f:
            f.write(cache.serialize())
        return files

    files = write_atomically(build_dir, produce)
    max_len = opts.max_seq_len or manifest.kv.max_seq_len
    return EnginesEntry(
        backend="tensorrt", tensorrt_version=version, gpu=gpu, precision=precision, strongly_typed=True,
        tf32=opts.tf32, engines=files, timing_cache=f"{ENGINES_DIR}/{TIMING_CACHE}",
        limits=EngineLimits(max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=opts.max_num_batched_tokens,
                            max_seq_len=max_len, max_blocks_per_seq=_cdiv(max_len, manifest.kv.block_size),
                            max_num_blocks=opts.max_num_blocks),
        plugin=PluginInfo(f"{io.PLUGIN_DOMAIN}::{io.PLUGIN_OP}", io.PLUGIN_VERSION, kernel_configs),
        options=opts)


def add_engines(build_dir: str | Path, opts: EngineBuildOptions = EngineBuildOptions()) -> Manifest:
    """Build the engines of an existing plugin build and record them in its manifest (for
    `kvexport build --backend tensorrt` after the ONNX build is in place, or for a build made
    elsewhere). The manifest is rewritten only after engines/ is complete."""
    build_dir = Path(build_dir)
    manifest = mf.load(build_dir)
    manifest = replace(manifest, engines=build_engines(build_dir, manifest, opts))
    manifest.save(build_dir)
    return manifest
