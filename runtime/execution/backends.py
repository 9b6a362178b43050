"""The one factory of execution backends: a build plus the runtime settings -> the backend
that runs it (runtime/execution/ort_backends.py for onnxruntime, runtime/execution/trt_backend.py for TensorRT),
and the settings capped to what that backend accepts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvexport.errors import KvExportError
from kvexport.manifest import Manifest

from ..config import EngineConfig
from .model_input import Backend


def create_backend(build_dir: Path, manifest: Manifest, config: EngineConfig, num_blocks: int,
                   ort_kind: str = "auto", local_num_blocks: int | None = None) -> tuple[Backend, EngineConfig]:
    """(backend, settings it accepts). TensorRT engines cap the batch limits, the context
    and the pool at their optimization profiles (manifest `engines.limits`).
    `local_num_blocks`: blocks of the local KV cache group's pools (builds with one)."""
    if config.backend == "tensorrt":
        from .trt_backend import TensorRTBackend

        if not manifest.engines:
            raise KvExportError(f"{build_dir} has no TensorRT engines: build them with "
                                f"`kvexport engines {build_dir}` (needs TensorRT and a GPU)")
        lim = manifest.engines.limits
        config = replace(config, max_num_seqs=min(config.max_num_seqs, lim.max_num_seqs),
                         max_num_batched_tokens=min(config.max_num_batched_tokens, lim.max_num_batched_tokens),
                         max_model_len=min(config.max_model_len or lim.max_seq_len, lim.max_seq_len))
        local = min(local_num_blocks, lim.max_num_blocks) if local_num_blocks else None
        backend = TensorRTBackend(build_dir, manifest, min(num_blocks, lim.max_num_blocks),
                                  cuda_graph_batch_sizes=config.cuda_graph_batch_sizes, local_num_blocks=local)
        return backend, config
    from .ort_backends import ort_backend

    return (ort_backend(build_dir, manifest, num_blocks, config.threads, ort_kind,
                        accuracy=config.weight_matmul_accuracy, local_num_blocks=local_num_blocks), config)
