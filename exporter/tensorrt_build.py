"""TensorRT engines for a `plugin`-attention build: parse prefill.onnx / decode.onnx, build
one engine per phase with an optimization profile derived from typed limits, and return the
manifest's `engines` entry.

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
needs a bf16 graph. A mismatch raises ConfigError saying what to rebuild.

NOTE: this glue follows the TensorRT Python API documentation and is type-checked against
`tensorrt-stubs` (tests/tensorrt/test_typecheck.py); it has never run against a real TensorRT
on the project's machines (TensorRT cannot be installed there). See docs/TENSORRT.md.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kvexport import io
from kvexport.errors import ConfigError, EngineBuildError, KvExportError, TensorRTUnavailableError
from kvexport.manifest import Manifest

from .source import sha256

if TYPE_CHECKING:  # typed by tensorrt-stubs; imported for real only inside functions
    import tensorrt as trt

log = logging.getLogger(__name__)

ENGINES_DIR = "engines"
ENGINE_FILES = {io.Phase.PREFILL: "prefill.plan", io.Phase.DECODE: "decode.plan"}
TIMING_CACHE = "timing.cache"
PLUGIN_MODULE = "kvexport.plugins.paged_attention.trt"  # exposes register() (and kernel_configs())
_PRECISIONS = ("fp32", "fp16", "bf16")

_INSTALL_HINT = ('install TensorRT with `pip install "kvexport[tensorrt]"` on a machine with an NVIDIA GPU '
                 'and driver, or use the NVIDIA TensorRT container (see docker/)')
_ONNX_OK = ("The ONNX build is complete and usable with onnxruntime as it is (`kvexport generate`, "
            "`kvexport serve`); build the engines later with TensorRT present.")


def require_tensorrt() -> str:
    """Check that the real TensorRT bindings import; returns their version.

    NOTE: `import tensorrt` alone proves nothing: the `tensorrt-stubs` package (a folder with
    only `__init__.pyi`) or a half-installed PyPI placeholder import as an empty namespace
    package. The bindings are there only if `tensorrt.Builder` is."""
    try:
        import tensorrt
    except ImportError as e:
        raise TensorRTUnavailableError(f"TensorRT is not installed (`import tensorrt` failed: {e}); "
                                       f"{_INSTALL_HINT}. {_ONNX_OK}") from None
    if not hasattr(tensorrt, "Builder"):
        raise TensorRTUnavailableError(
            f"`import tensorrt` found {getattr(tensorrt, '__path__', '?')} without the TensorRT bindings (only type "
            f"stubs or the PyPI placeholder package are installed); {_INSTALL_HINT}. {_ONNX_OK}")
    return str(tensorrt.__version__)


def cuda_device(device: int = 0) -> dict:
    """Name and compute capability of CUDA device `device` (via torch, a dependency), or
    TensorRTUnavailableError when there is none."""
    import torch

    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else "no NVIDIA GPU or driver is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
        raise TensorRTUnavailableError(f"TensorRT engines need a CUDA GPU, but {why}; build and run the engines on "
                                       f"a machine with an NVIDIA GPU and driver and a CUDA build of torch, or in "
                                       f"the NVIDIA TensorRT container (see docker/). {_ONNX_OK}")
    if device >= torch.cuda.device_count():
        raise ConfigError(f"CUDA device {device} does not exist; this machine has {torch.cuda.device_count()}")
    major, minor = torch.cuda.get_device_capability(device)
    return {"name": torch.cuda.get_device_name(device), "compute_capability": f"{major}.{minor}"}


def plugin_module() -> Any:
    """The PagedAttention TensorRT registration module (imported late: it imports tensorrt)."""
    try:
        return importlib.import_module(PLUGIN_MODULE)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "tensorrt":
            raise TensorRTUnavailableError(f"the PagedAttention plugin needs `{e.name}` (the `tensorrt.plugin` Python "
                                           f"plugin API), which this TensorRT lacks; {_INSTALL_HINT}. {_ONNX_OK}") from None
        if e.name and not PLUGIN_MODULE.startswith(e.name):
            raise  # something else the plugin module imports is missing: let its own error speak
        raise KvExportError(f"{PLUGIN_MODULE} is not part of this kvexport installation; reinstall kvexport "
                            f"(`pip install --force-reinstall kvexport`)") from None


# ---- options and optimization profiles (pure Python) -----------------------------------------


@dataclass(frozen=True, slots=True)
class EngineBuildOptions:
    max_num_seqs: int = 64  # sequences in one step, max (decode batch; prefill sequences)
    max_num_batched_tokens: int = 2048  # tokens in one prefill step, max
    max_seq_len: int | None = None  # longest context, tokens; None: the build's kv.max_seq_len
    opt_seq_len: int | None = None  # context the profile is tuned for, tokens; None: max_seq_len // 2
    max_num_blocks: int = 16384  # KV pool blocks the engines accept, max (the runtime's pool must fit)
    precision: str | None = None  # "fp32" | "fp16" | "bf16"; None: the graphs' dtype (see module NOTE)
    tf32: bool = False  # let fp32 matmuls use TF32 (TensorRT's default is on; off keeps fp32 exact)
    optimization_level: int = 3  # IBuilderConfig.builder_optimization_level, 0..5
    workspace_bytes: int | None = None  # cap on TensorRT's workspace pool, bytes; None: TensorRT's default
    device: int = 0  # CUDA device to build on

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine option {name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_blocks < 2:
            raise ConfigError(f"engine option max_num_blocks must be >= 2 (block 0 is the pad block), "
                              f"got {self.max_num_blocks}")
        for name in ("max_seq_len", "opt_seq_len"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"engine option {name} must be >= 1, got {v}")
        if self.precision is not None and self.precision not in _PRECISIONS:
            raise ConfigError(f"engine precision {self.precision!r} is not one of {_PRECISIONS}")
        if not 0 <= self.optimization_level <= 5:
            raise ConfigError(f"engine optimization_level must be in 0..5, got {self.optimization_level}")
        if self.workspace_bytes is not None and self.workspace_bytes < 1:
            raise ConfigError(f"engine workspace_bytes must be >= 1, got {self.workspace_bytes}")


@dataclass(frozen=True, slots=True)
class ShapeRange:
    """One input's IOptimizationProfile.set_shape(min, opt, max)."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def to_json(self) -> dict:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}


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
    if phase is io.Phase.PREFILL:
        ranges[io.NUM_TOKENS] = (1, tokens, tokens)
    return ranges


def profile_shapes(manifest: Manifest, opts: EngineBuildOptions) -> dict[str, dict[str, ShapeRange]]:
    """phase -> input name -> ShapeRange, for every input the manifest lists for that graph."""
    out: dict[str, dict[str, ShapeRange]] = {}
    for phase in (io.Phase.PREFILL, io.Phase.DECODE):
        axes = axis_ranges(manifest, opts, phase)
        shapes = {}
        for spec in manifest.graphs[phase.value].inputs:
            dims: list[tuple[int, int, int]] = []
            for d in spec["shape"]:
                if isinstance(d, int):
                    dims.append((d, d, d))
                elif d in axes:
                    dims.append(axes[d])
                else:
                    raise KvExportError(f"input {spec['name']!r} of the {phase.value} graph has axis {d!r}, which "
                                        f"the TensorRT profile does not know; rebuild with `kvexport build --force`")
            shapes[spec["name"]] = ShapeRange(*(tuple(d[k] for d in dims) for k in range(3)))
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
    return precision


# ---- writing engines/ atomically ---------------------------------------------------------------


def write_atomically(build_dir: Path, produce: Callable[[Path], dict]) -> dict:
    """Run produce(tmp) on a fresh temporary folder inside `build_dir` and rename it to
    `build_dir/engines` only when it returns; an existing engines/ is replaced then, and kept
    untouched on any failure (the temporary folder is removed). The old timing cache, if any,
    is copied into tmp first so a rebuild reuses it."""
    final = build_dir / ENGINES_DIR
    tmp = Path(tempfile.mkdtemp(prefix=f".{ENGINES_DIR}.tmp-", dir=build_dir))
    try:
        if (final / TIMING_CACHE).is_file():
            shutil.copy2(final / TIMING_CACHE, tmp / TIMING_CACHE)
        result = produce(tmp)
        if final.exists():
            old = build_dir / f".{ENGINES_DIR}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


# ---- TensorRT ------------------------------------------------------------------------------------


def trt_logger() -> trt.ILogger:
    """A tensorrt.ILogger that forwards to `logging` (TensorRT INFO/VERBOSE become DEBUG)."""
    import tensorrt as trt

    levels = {trt.ILogger.INTERNAL_ERROR: logging.ERROR, trt.ILogger.ERROR: logging.ERROR,
              trt.ILogger.WARNING: logging.WARNING, trt.ILogger.INFO: logging.DEBUG,
              trt.ILogger.VERBOSE: logging.DEBUG}

    class _LogBridge(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            log.log(levels.get(severity, logging.INFO), "TensorRT: %s", msg)

    return _LogBridge()


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


def _kernel_configs(plugin: Any) -> Any:
    """The plugin's kernel configurations (its TensorRT tactics) for the manifest: the
    plugin module's kernel_configs() when it has one, else the tile lists of configs.py."""
    fn = getattr(plugin, "kernel_configs", None)
    if callable(fn):
        return fn()
    try:
        configs = importlib.import_module("kvexport.plugins.paged_attention.configs")
    except ImportError:
        log.warning("no kernel configurations found for %s::%s", io.PLUGIN_DOMAIN, io.PLUGIN_OP)
        return None
    tiles = lambda ts: [dict(asdict(t), tactic=t.tactic) for t in ts]  # noqa: E731
    return {"prefill": tiles(configs.PREFILL_TILES), "decode": tiles(configs.DECODE_TILES),
            "aot_targets": list(configs.AOT_TARGETS)}


def build_engines(build_dir: str | Path, manifest: Manifest, opts: EngineBuildOptions = EngineBuildOptions()) -> dict:
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
    plugin = plugin_module()
    plugin.register()
    kernel_configs = _kernel_configs(plugin)

    def produce(tmp: Path) -> dict:
        logger = trt_logger()
        builder = trt.Builder(logger)
        config = builder.create_builder_config()
        cache_file = tmp / TIMING_CACHE
        cache = config.create_timing_cache(cache_file.read_bytes() if cache_file.is_file() else b"")
        files = {}
        for phase in (io.Phase.PREFILL, io.Phase.DECODE):
            out = tmp / ENGINE_FILES[phase]
            log.info("building the TensorRT %s engine (%s)", phase.value, precision)
            _build_one(builder, logger, build_dir / manifest.graphs[phase.value].file, shapes[phase.value],
                       cache, opts, out)
            files[phase.value] = {"file": f"{ENGINES_DIR}/{out.name}", "bytes": out.stat().st_size,
                                  "sha256": sha256(out),
                                  "profile": {k: v.to_json() for k, v in shapes[phase.value].items()}}
        with open(cache_file, "wb") as f:
            f.write(cache.serialize())
        return files

    files = write_atomically(build_dir, produce)
    kv = manifest.kv
    return {
        "backend": "tensorrt",
        "tensorrt_version": version,
        "gpu": gpu,
        "precision": precision,
        "strongly_typed": True,
        "tf32": opts.tf32,
        "engines": files,
        "timing_cache": f"{ENGINES_DIR}/{TIMING_CACHE}",
        "limits": {  # what the runtime must stay within (scheduler and pool)
            "max_num_seqs": opts.max_num_seqs,
            "max_num_batched_tokens": opts.max_num_batched_tokens,
            "max_seq_len": opts.max_seq_len or kv.max_seq_len,
            "max_blocks_per_seq": _cdiv(opts.max_seq_len or kv.max_seq_len, kv.block_size),
            "max_num_blocks": opts.max_num_blocks,
        },
        "plugin": {"id": f"{io.PLUGIN_DOMAIN}::{io.PLUGIN_OP}", "version": io.PLUGIN_VERSION,
                   "kernel_configs": kernel_configs},
        "options": asdict(opts),
    }


def add_engines(build_dir: str | Path, opts: EngineBuildOptions = EngineBuildOptions()) -> Manifest:
    """Build the engines of an existing plugin build and record them in its manifest (for
    `kvexport build --backend tensorrt` after the ONNX build is in place, or for a build made
    elsewhere). The manifest is rewritten only after engines/ is complete."""
    from dataclasses import replace

    from kvexport import manifest as mf

    build_dir = Path(build_dir)
    manifest = mf.load(build_dir)
    manifest = replace(manifest, engines=build_engines(build_dir, manifest, opts))
    manifest.save(build_dir)
    return manifest
