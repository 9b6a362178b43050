"""The manifest's `engines` entry: the TensorRT engines of a plugin build, what they were built
with and the limits the runtime must stay within. exporter/tensorrt_build.py writes it, the
runtime (runtime/execution/trt_backend.py, runtime/engine.py) reads it; both import it from
`kvexport.manifest`, which decodes and checks it like every other entry.

    engines: EnginesEntry
      ├─ engines: {"prefill" | "decode": EngineFile(file, bytes, sha256, profile: {input: ShapeRange})}
      ├─ limits: EngineLimits        (sequences, tokens, context, blocks)
      ├─ gpu: GpuInfo                (engines run only on this compute capability)
      ├─ plugin: PluginInfo          (kvexport::PagedAttention version + kernel configurations)
      └─ options: EngineBuildOptions (as given to the build)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True, slots=True)
class EngineBuildOptions:
    """What `kvexport engines` / `kvexport build --backend tensorrt` builds (checked when made);
    recorded as given in the manifest."""

    max_num_seqs: int = 64  # sequences in one step, max (decode batch; prefill sequences)
    max_num_batched_tokens: int = 2048  # tokens in one prefill step, max
    max_seq_len: int | None = None  # longest context, tokens; None: the build's kv.max_seq_len
    opt_seq_len: int | None = None  # context the profile is tuned for, tokens; None: max_seq_len // 2
    max_num_blocks: int = 16384  # KV pool blocks the engines accept, max (the runtime's pool must fit)
    precision: str | None = None  # "fp32" | "fp16" | "bf16"; None: the graphs' dtype (tensorrt_build NOTE)
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
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigError(f"engine precision {self.precision!r} is not one of {PRECISIONS}")
        if not 0 <= self.optimization_level <= 5:
            raise ConfigError(f"engine optimization_level must be in 0..5, got {self.optimization_level}")
        if self.workspace_bytes is not None and self.workspace_bytes < 1:
            raise ConfigError(f"engine workspace_bytes must be >= 1, got {self.workspace_bytes}")


@dataclass(frozen=True, slots=True)
class GpuInfo:
    name: str  # torch.cuda.get_device_name(), e.g. "NVIDIA H200"
    compute_capability: str  # "major.minor"; engines run only on GPUs of this capability


@dataclass(frozen=True, slots=True)
class ShapeRange:
    """One input's IOptimizationProfile.set_shape(min, opt, max), each a full shape."""

    min: tuple[int, ...]  # smallest shape accepted
    opt: tuple[int, ...]  # shape the tactics are timed for
    max: tuple[int, ...]  # largest shape accepted (the runtime sizes its buffers for it)

    def to_json(self) -> dict:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}


@dataclass(frozen=True, slots=True)
class EngineFile:
    file: str  # path inside the build, e.g. "engines/decode.plan"
    bytes: int  # its size, bytes
    sha256: str  # hex digest of the file (checked with verify_checksums)
    profile: dict[str, ShapeRange]  # graph input name -> its optimization profile


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What the runtime's scheduler and KV pool must stay within (the profiles' maxima)."""

    max_num_seqs: int  # sequences in one step, max
    max_num_batched_tokens: int  # tokens in one prefill step, max
    max_seq_len: int  # longest context (prompt + output), tokens
    max_blocks_per_seq: int  # block-table width, blocks: ceil(max_seq_len / block_size)
    max_num_blocks: int  # KV pool blocks, max (the pad block included)


@dataclass(frozen=True, slots=True)
class PluginInfo:
    id: str  # "<io.PLUGIN_DOMAIN>::<io.PLUGIN_OP>"
    version: str  # io.PLUGIN_VERSION the engines were built with
    kernel_configs: Any  # the plugin's kernel configurations (its tactics), plugin-defined JSON; None: unknown


@dataclass(frozen=True, slots=True)
class EnginesEntry:
    backend: str  # "tensorrt"
    tensorrt_version: str  # TensorRT that built the engines; they run only on that version
    gpu: GpuInfo  # GPU they were built (and timed) on
    precision: str  # one of PRECISIONS: the graphs' dtype (strongly typed networks)
    strongly_typed: bool  # NetworkDefinitionCreationFlag.STRONGLY_TYPED
    tf32: bool  # fp32 matmuls allowed to use TF32
    engines: dict[str, EngineFile]  # io.Phase value ("prefill" / "decode") -> engine
    timing_cache: str  # path inside the build of the timing cache later builds reuse
    limits: EngineLimits
    plugin: PluginInfo
    options: EngineBuildOptions  # as given to the build
