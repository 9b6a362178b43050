"""The TensorRT backend: runs a plugin build's prefill/decode engines (engines/*.plan, built
by `kvexport.exporter.tensorrt_build`) on one step's model input; owns the KV pools on the GPU.

    ModelInput (numpy, host) ──copy──> static int64 device buffers ─┐
    K/V pools (torch CUDA, one per layer and K/V) ──────────────────┼─> execute_async_v3 ─> logits ─copy─> host
                        bound as key_cache.{i} AND key_cache_out.{i} ┘   (or a captured CUDA graph)

NOTE: the PagedAttention plugin writes this step's K/V into the pool in place: its outputs
key_cache_out.{i}/value_cache_out.{i} alias the inputs key_cache.{i}/value_cache.{i}, so both
names are bound to the same device address and the pools never cross the PCIe bus. Block
tables must cover seq_lens (this step's blocks too); `model_runner.pack()` does that for
plugin builds.

NOTE: every input gets one device buffer sized for the profile's maximum, bound once; a step
copies its arrays into the buffers' prefixes. Fixed addresses are what CUDA graphs need: with
`cuda_graph_batch_sizes`, decode steps of up to B sequences replay a graph captured at B,
padded with rows that store nothing (slot -1) and read one token of the pad block.

NOTE: written against the documented TensorRT Python API and type-checked with
`tensorrt-stubs`; never run against a real TensorRT here (see docs/TENSORRT.md).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from kvexport import io
from kvexport.errors import KvExportError
from kvexport.manifest import EngineLimits, EnginesEntry, GpuInfo, Manifest, ShapeRange, sha256
from kvexport.tensorrt_env import cuda_device, register_plugins, require_tensorrt, trt_logger

from .model_input import ModelInput, select_rows

if TYPE_CHECKING:  # typed by tensorrt-stubs; imported for real only inside functions
    import tensorrt as trt

log = logging.getLogger(__name__)

_REBUILD = "rebuild them with `kvexport build BUILD_DIR --backend tensorrt --force`"


def engines_entry(manifest: Manifest, build_dir: Path) -> EnginesEntry:
    """The manifest's `engines` entry, checked: a plugin build whose engine files exist."""
    kv = manifest.kv
    if kv.layout != io.KVLayout.PAGED.value or kv.attention != io.Attention.PLUGIN.value:
        raise KvExportError(f"the TensorRT backend runs `--attention plugin` builds; {build_dir} has attention "
                            f"{kv.attention!r}: use the onnxruntime backend, or rebuild with `--attention plugin`")
    if manifest.model.spec.get("linear_attn") is not None:  # GatedDeltaRule engines build; their state I/O is not bound
        raise KvExportError(f"the TensorRT backend does not bind a hybrid's recurrent state yet (state_slots, "
                            f"conv_state.*, recurrent_state.*: kvexport/io.py); serve {build_dir} with the "
                            f"onnxruntime backend")
    entry = manifest.engines
    if not entry:
        raise KvExportError(f"{build_dir} has no TensorRT engines; build them with "
                            f"`kvexport build MODEL --attention plugin --backend tensorrt` on a machine with "
                            f"TensorRT and an NVIDIA GPU, or use the onnxruntime backend")
    for phase in (io.Phase.PREFILL, io.Phase.DECODE):
        e = entry.engines[phase.value]
        path = build_dir / e.file
        if not path.is_file():
            raise KvExportError(f"{path} listed in the manifest is missing; {_REBUILD}")
        if path.stat().st_size != e.bytes:
            raise KvExportError(f"{path} has {path.stat().st_size} bytes, the manifest says {e.bytes}; {_REBUILD}")
    return entry


def check_engine_target(entry: EnginesEntry, trt_version: str, gpu: GpuInfo) -> None:
    """Engines run only on the TensorRT version and GPU architecture they were built with."""
    if entry.tensorrt_version != trt_version:
        raise KvExportError(f"the engines were built with TensorRT {entry.tensorrt_version}, this is TensorRT "
                            f"{trt_version}; {_REBUILD}")
    built = entry.gpu
    if built.compute_capability != gpu.compute_capability:
        raise KvExportError(f"the engines were built for {built.name} (compute capability "
                            f"{built.compute_capability}), this GPU is {gpu.name} (compute capability "
                            f"{gpu.compute_capability}); {_REBUILD} on this machine")
    if built.name != gpu.name:
        log.warning("engines were built on %s and run on %s (same compute capability): they work, but their "
                    "tactics were timed on the other GPU", built.name, gpu.name)


def pad_decode(inp: ModelInput, batch: int, width: int) -> ModelInput:
    """A decode input padded to `batch` sequences and `width` block-table columns.

    Padding rows: token 0 at position 0, seq_len 1, slot -1 (the plugin stores nothing), a
    block table of PAD_BLOCK_ID. NOTE: seq_len 1 rather than 0: a decode row always has one
    query token, and seq_len 0 would put it at context -1; with seq_len 1 it attends to
    position 0 of the pad block, which nothing ever writes (finite, and its logits are dropped)."""
    s, w = len(inp.seq_lens), inp.block_tables.shape[1]
    assert inp.is_decode and s <= batch and w <= width
    pad = batch - s
    tables: np.ndarray = np.full((batch, width), io.PAD_BLOCK_ID, np.int64)
    tables[:s, :w] = inp.block_tables
    cat = lambda a, v: np.concatenate([a, np.full(pad, v, np.int64)])  # noqa: E731
    groups: list[tuple[str, np.ndarray, np.ndarray]] = []
    for g, g_tables, g_slots in inp.groups:  # other KV cache groups: padded alike
        padded: np.ndarray = np.full((batch, width), io.PAD_BLOCK_ID, np.int64)
        padded[:s, :w] = g_tables
        groups.append((g, padded, cat(g_slots, -1)))
    return ModelInput(cat(inp.token_ids, 0), cat(inp.positions, 0), np.arange(batch + 1, dtype=np.int64),
                      cat(inp.seq_lens, 1), tables, cat(inp.slot_mapping, -1), tuple(groups))


def _torch_dtype(trt_dtype: trt.DataType) -> Any:
    import tensorrt as trt
    import torch

    table = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16, trt.DataType.BF16: torch.bfloat16,
             trt.DataType.INT8: torch.int8, trt.DataType.INT32: torch.int32, trt.DataType.INT64: torch.int64,
             trt.DataType.UINT8: torch.uint8}  # UINT8: int4 KV pools (rows of codes + scales)
    if trt_dtype not in table:
        raise KvExportError(f"the engine has a tensor of type {trt_dtype}, which this backend does not bind")
    return table[trt_dtype]


class _Phase:
    """One engine, its static input/output buffers, and its execution contexts: one for eager
    runs and one per captured CUDA graph.

    NOTE: a graph is captured on a context of its own. A captured enqueue may read state the
    context keeps for its current shapes; an eager run at another batch size would change that
    state under the graph. All contexts share one scratch allocation (USER_MANAGED): they
    run one after another on one stream, never at the same time."""

    def __init__(self, runtime: trt.Runtime, path: Path, profile: dict[str, ShapeRange], pool_names: list[str],
                 pools: list, stream: Any):
        import tensorrt as trt
        import torch

        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise KvExportError(f"TensorRT could not load {path} (see the TensorRT log above); {_REBUILD}")
        self.engine = engine
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        self.pool_bindings = [(n, n.replace("_cache.", "_cache_out."), p) for n, p in zip(pool_names, pools)]
        if names != set(profile) | {io.LOGITS} | {out for _, out, _ in self.pool_bindings}:
            raise KvExportError(f"{path} has tensors {sorted(names)}, not those of the manifest; {_REBUILD}")
        self.buffers: dict[str, Any] = {}
        for name, r in profile.items():
            if name not in pool_names:  # flat, sized for the profile's max; a step uses a prefix
                self.buffers[name] = torch.zeros(max(int(np.prod(r.max)), 1), dtype=torch.int64, device="cuda")
        self.vocab = engine.get_tensor_shape(io.LOGITS)[1]
        rows = max(profile[io.INPUT_IDS].max[0], profile[io.SEQ_LENS].max[0])
        self.logits = torch.empty(rows * self.vocab, dtype=_torch_dtype(engine.get_tensor_dtype(io.LOGITS)),
                                  device="cuda")
        self.stream = stream
        self.context: trt.IExecutionContext | None = None  # set by new_context() once the shared scratch memory exists
        self.graphs: dict[int, tuple[trt.IExecutionContext, Any]] = {}  # batch size -> (context, torch.cuda.CUDAGraph)

    def new_context(self, scratch: Any) -> trt.IExecutionContext:
        """A context on the shared `scratch` (a uint8 CUDA tensor) with every address bound."""
        import tensorrt as trt

        ctx = self.engine.create_execution_context(
            trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        ctx.set_device_memory(scratch.data_ptr(), scratch.numel())
        for name, buf in self.buffers.items():
            ctx.set_tensor_address(name, buf.data_ptr())
        for name, out_name, pool in self.pool_bindings:
            ctx.set_input_shape(name, tuple(pool.shape))
            ctx.set_tensor_address(name, pool.data_ptr())
            ctx.set_tensor_address(out_name, pool.data_ptr())  # aliased: the same memory
        ctx.set_tensor_address(io.LOGITS, self.logits.data_ptr())
        return ctx

    def load(self, inp: ModelInput, ctx: trt.IExecutionContext) -> None:
        """Copy the step's arrays into the static buffers (on the stream); set ctx's shapes."""
        import torch

        for name, arr in inp.feeds().items():  # the metadata of every KV cache group (kvexport/io.py)
            if name in (io.LOGITS_INDICES, io.OBSERVATION_LENS) and name not in self.buffers:
                continue  # an engine of a graph without it (the decode graph, builds made before it)
            self.buffers[name][:arr.size].copy_(torch.from_numpy(np.ascontiguousarray(arr).reshape(-1)),
                                                non_blocking=True)
            ctx.set_input_shape(name, arr.shape)

    def run(self, ctx: trt.IExecutionContext) -> None:
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise KvExportError("TensorRT failed to run the engine (see the TensorRT log above)")


class TensorRTBackend:
    """Backend protocol (runtime/execution/model_input.py) over TensorRT engines.

    `cuda_graph_batch_sizes`: decode batch sizes to capture as CUDA graphs (empty: off);
    a decode step of S sequences replays the smallest captured size >= S."""

    full_block_tables = True  # model_runner.pack(): tables cover seq_lens (the plugin reads this step's KV back)
    pads_queries = False  # the plugin works on the packed tokens: one engine call per step
    attention_impl = "plugin (TensorRT)"

    def __init__(self, build_dir: str | Path, manifest: Manifest, num_blocks: int, *, device: int = 0,
                 cuda_graph_batch_sizes: Sequence[int] = (), verify_checksums: bool = False,
                 local_num_blocks: int | None = None):
        self.build_dir, self.manifest, self.num_blocks = Path(build_dir), manifest, num_blocks
        # KV cache groups (kvexport/io.py): the local group's pools have `local_num_blocks` blocks
        layer_groups = manifest.layer_groups or (io.FULL_GROUP,) * manifest.kv.num_layers
        self.groups = tuple(sorted(set(layer_groups) - {io.FULL_GROUP}))
        self.local_num_blocks = (local_num_blocks or num_blocks) if self.groups else None
        entry = engines_entry(manifest, self.build_dir)
        limits = entry.limits
        if not 2 <= num_blocks <= limits.max_num_blocks or not 2 <= (local_num_blocks or 2) <= limits.max_num_blocks:
            raise KvExportError(f"a KV pool of {num_blocks} blocks does not fit the engines (2..{limits.max_num_blocks} "
                                f"blocks); lower the KV memory budget, or rebuild the engines with a larger "
                                f"max_num_blocks")
        bad = [b for b in cuda_graph_batch_sizes if not 1 <= b <= limits.max_num_seqs]
        if bad:
            raise KvExportError(f"CUDA graph batch sizes {bad} are outside the decode engine's 1..{limits.max_num_seqs}")
        self.limits: EngineLimits = limits
        trt_version = require_tensorrt()
        gpu = cuda_device(device)
        check_engine_target(entry, trt_version, gpu)
        if verify_checksums:
            for e in entry.engines.values():
                if sha256(self.build_dir / e.file) != e.sha256:
                    raise KvExportError(f"{self.build_dir / e.file} does not match its sha256 in the manifest; {_REBUILD}")
        import tensorrt as trt
        import torch

        torch.cuda.set_device(device)
        register_plugins()  # NOTE: JIT plugins need it to deserialize; AOT ones run without it
        self._logger = trt_logger()
        self._runtime = trt.Runtime(self._logger)
        kv = manifest.kv
        pool_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                      "int8": torch.int8, "int4": torch.uint8}[kv.dtype]  # int4: rows of codes + scales
        blocks = {io.FULL_GROUP: num_blocks, io.LOCAL_GROUP: self.local_num_blocks or num_blocks}
        kv_layers, dims = io.kv_layout(manifest.model.spec, kv.num_kv_heads, kv.head_dim)  # Gemma 4: io.py "Shared KV"
        shapes = [io.paged_pool_shape(blocks[g], dims[i][0], kv.block_size, dims[i][1],
                                      io.DType(kv.dtype).numpy_name) for i, g in enumerate(layer_groups)]
        # [K_0, V_0, K_1, V_1, ...], each [kv_heads, num_blocks (of the layer's group), block_size, head_dim]
        # K, V per layer; MLA: one latent pool per layer (io.pool_names)
        self.pools = [torch.zeros(shapes[i], dtype=pool_dtype, device="cuda")
                      for i in io.pool_layers(kv.num_layers, kv.latent, kv_layers)]
        pool_names = io.pool_names(kv.num_layers, kv.latent, kv_layers)
        self.stream = torch.cuda.Stream()
        self.phases = {p: _Phase(self._runtime, self.build_dir / e.file, e.profile, pool_names, self.pools,
                                 self.stream)
                       for p, e in entry.engines.items()}
        # one scratch allocation for every context of both engines (they never run concurrently)
        size = max(ph.engine.device_memory_size_v2 for ph in self.phases.values())
        self._scratch = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
        for ph in self.phases.values():
            ph.context = ph.new_context(self._scratch)
        torch.cuda.synchronize()
        self._graph_sizes = sorted(set(cuda_graph_batch_sizes))
        if self._graph_sizes:
            self._capture()

    @property
    def pool_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools)

    def _capture(self) -> None:
        """Capture one decode graph per batch size, block tables padded to the full width.
        TensorRT asks for one run after a shape change before capturing (deferred updates)."""
        import torch

        dec = self.phases[io.Phase.DECODE.value]
        width = self.limits.max_blocks_per_seq
        none: np.ndarray = np.zeros(0, np.int64)
        empty = ModelInput(none, none, np.zeros(1, np.int64), none, np.zeros((0, 1), np.int64), none,
                           tuple((g, np.zeros((0, 1), np.int64), none) for g in self.groups))
        with torch.cuda.stream(self.stream):
            for b in self._graph_sizes:
                ctx = dec.new_context(self._scratch)
                dec.load(pad_decode(empty, b, width), ctx)  # all padding: stores nothing
                dec.run(ctx)
                self.stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self.stream):
                    dec.run(ctx)
                dec.graphs[b] = (ctx, graph)
        self.stream.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self._graph_sizes)

    def _check_limits(self, inp: ModelInput) -> None:
        s, t, w = len(inp.seq_lens), len(inp.token_ids), inp.block_tables.shape[1]
        lim = self.limits
        max_t = lim.max_num_seqs if inp.is_decode else lim.max_num_batched_tokens
        if s > lim.max_num_seqs or t > max_t or w > lim.max_blocks_per_seq:
            raise KvExportError(f"a step of {s} sequences, {t} tokens, {w} blocks per sequence exceeds the engines' "
                                f"limits {lim}; configure the engine's max_num_seqs / max_num_batched_tokens / "
                                f"max_model_len within them, or rebuild the engines with larger ones")

    def execute(self, inp: ModelInput, all_tokens: bool = False) -> np.ndarray:
        """Run one step (the plugin stores its K/V in the pools); logits [S, vocab] float32,
        or [T, vocab] with `all_tokens` (an --all-logits build's prefill)."""
        import torch

        self._check_limits(inp)
        s = len(inp.seq_lens)
        phase = self.phases[(io.Phase.DECODE if inp.is_decode else io.Phase.PREFILL).value]
        takes = io.LOGITS_INDICES in phase.buffers
        if takes:  # the step's logits rows spelled out (ModelInput.rows)
            inp = dataclasses.replace(inp, logits_indices=inp.rows(all_tokens))
        graph_b = next((b for b in self._graph_sizes if b >= s), None) if inp.is_decode else None
        with torch.cuda.stream(self.stream):
            if graph_b is not None:
                ctx, graph = phase.graphs[graph_b]
                phase.load(pad_decode(inp, graph_b, self.limits.max_blocks_per_seq), ctx)
                graph.replay()
            else:
                assert phase.context is not None  # created in __init__
                phase.load(inp, phase.context)
                phase.run(phase.context)
            graph_rows = "indices" if takes else "tokens" if self.manifest.all_logits and not inp.is_decode else "last"
            rows = {"indices": len(inp.rows()), "tokens": len(inp.token_ids), "last": s}[graph_rows]
            logits = phase.logits[:rows * phase.vocab].view(rows, phase.vocab).float().cpu().numpy()
        return select_rows(logits, inp, all_tokens, graph_rows)
