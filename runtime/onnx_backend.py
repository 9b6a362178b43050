"""The onnxruntime backend: runs a `paged` build's prefill/decode graphs on one step's
model input and keeps the KV block pool.

NOTE: the `onnx` attention graphs read the pool but never write it (see kvexport/io.py);
after each run this backend stores the step's new K/V at `slot_mapping`. `plugin` graphs
store it themselves: with the native CPU op the pools are updated in place (each bound as
input and aliased output). Both sessions get the weights as shared, memory-mapped
initializers, so the weights are in memory once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from kvexport import io
from kvexport.errors import KvExportError
from kvexport.manifest import Manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelInput:
    """One step of the packed batch, as the graphs' paged inputs want it."""

    token_ids: np.ndarray  # [T] int64, sequence after sequence
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [S+1] int64
    seq_lens: np.ndarray  # [S] int64, KV length after this step
    block_tables: np.ndarray  # [S, max_blocks] int64, padded with io.PAD_BLOCK_ID
    slot_mapping: np.ndarray  # [T] int64

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == len(self.seq_lens)


class Backend(Protocol):
    """What the model runner needs from an execution backend (onnxruntime, TensorRT)."""

    num_blocks: int
    full_block_tables: bool  # plugin attention: tables cover this step's blocks too (kvexport/io.py)
    pads_queries: bool  # a call costs its longest query chunk times its sequences (`onnx` attention)

    def execute(self, inp: ModelInput) -> np.ndarray:
        """Run one step; store its K/V in the pool; return logits [S, vocab] (float32)."""
        ...


def _providers() -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def _shared_initializers(build_dir: Path, graph_file: str, weights: np.memmap) -> dict:
    """name -> OrtValue viewing the memory-mapped weights file, for every external weight."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(build_dir / graph_file), load_external_data=False)
    out = {}
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        meta = {e.key: e.value for e in t.external_data}
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        start, length = int(meta["offset"]), int(meta["length"])
        arr = weights[start:start + length].view(dtype).reshape(tuple(t.dims))
        out[t.name] = ort.OrtValue.ortvalue_from_numpy(arr)
    return out


class OnnxRuntimeBackend:
    def __init__(self, build_dir: str | Path, manifest: Manifest, num_blocks: int,
                 threads: int | None = None, providers: list[str] | None = None):
        import onnxruntime as ort

        if manifest.kv.layout != io.KVLayout.PAGED.value:
            raise KvExportError(f"the runtime serves paged builds; {build_dir} has layout "
                                f"{manifest.kv.layout!r}: rebuild with `--layout paged`")
        if num_blocks < 2:
            raise KvExportError(f"the KV pool needs at least 2 blocks (one is the pad block), got {num_blocks}")
        self.build_dir, self.manifest, self.num_blocks = Path(build_dir), manifest, num_blocks
        kv = manifest.kv
        self.kv = kv
        # plugin graphs: the native CPU PagedAttention (plugins/paged_attention/native.py) when
        # it is built and covers the dtypes; otherwise the float64 reference as a PyOp (ort.py:
        # slow, it copies the pools; it proves the plugin path anywhere). Production GPUs run
        # plugin graphs as TensorRT engines (runtime/trt_backend.py).
        self.plugin = kv.attention == io.Attention.PLUGIN.value
        self.full_block_tables = self.plugin
        self.native_op = None
        self.pads_queries = not self.plugin  # see engine.execute()
        if self.plugin:
            from kvexport.plugins.paged_attention import native

            self.native_op, why_not = native.library_for(manifest)
            if self.native_op is None:
                log.warning("running the plugin graphs of %s with the reference PagedAttention (slow): %s",
                            build_dir, why_not)
        self._weights = np.memmap(self.build_dir / manifest.weights["file"], dtype=np.uint8, mode="r")
        init = _shared_initializers(self.build_dir, manifest.graphs["prefill"].file, self._weights)
        self._init = init  # NOTE: the OrtValues view the memmap; keep both alive with the sessions
        providers = providers or _providers()
        self.sessions = {}
        for phase, entry in manifest.graphs.items():
            if self.plugin and self.native_op is None:
                from kvexport.plugins.paged_attention.ort import plugin_session

                self.sessions[phase] = plugin_session(self.build_dir / entry.file, threads, init)
                continue
            so = ort.SessionOptions()
            so.log_severity_level = 3
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            so.intra_op_num_threads = threads or (os.cpu_count() or 1)
            so.inter_op_num_threads = 1
            for name, value in init.items():
                so.add_initializer(name, value)
            if self.native_op is not None:
                so.register_custom_ops_library(str(self.native_op))
                providers = ["CPUExecutionProvider"]  # the op is a CPU kernel; the pools live here
            self.sessions[phase] = ort.InferenceSession(str(self.build_dir / entry.file), so, providers=providers)
        dtype = np.dtype(io.DType(kv.dtype).numpy_name)
        shape = io.paged_pool_shape(num_blocks, kv.num_kv_heads, kv.block_size, kv.head_dim)
        # [K_0, V_0, K_1, V_1, ...], each [kv_heads, num_blocks, block_size, head_dim]
        self.pools = [np.zeros(shape, dtype) for _ in range(2 * kv.num_layers)]
        self._pool_names = [n for i in range(kv.num_layers) for n in (io.key_cache(i), io.value_cache(i))]
        kv_outs = (io.key_cache_out, io.value_cache_out) if self.plugin else (io.new_key, io.new_value)
        self._out_names = [io.LOGITS] + [f(i) for i in range(kv.num_layers) for f in kv_outs]
        # native op: one IOBinding per session, made once, with each pool bound as both its
        # input and its aliased output (updated in place); a step binds only its metadata
        self._pool_values = [ort.OrtValue.ortvalue_from_numpy(p) for p in self.pools] if self.native_op else []
        self._bindings = {phase: self.in_place_binding(sess) for phase, sess in self.sessions.items()
                          if self.native_op is not None}

    def in_place_binding(self, sess):
        """An IOBinding of `sess` (a plugin graph) with every pool bound as both its input and
        its aliased output; logits are output 0."""
        b = sess.io_binding()
        b.bind_output(io.LOGITS)
        for name, out_name, value in zip(self._pool_names, self._out_names[1:], self._pool_values):
            b.bind_ortvalue_input(name, value)
            b.bind_ortvalue_output(out_name, value)
        return b

    @property
    def pool_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def execute(self, inp: ModelInput) -> np.ndarray:
        feeds = {io.INPUT_IDS: inp.token_ids, io.POSITIONS: inp.positions,
                 io.QUERY_START_LOC: inp.query_start_loc, io.SEQ_LENS: inp.seq_lens,
                 io.BLOCK_TABLES: inp.block_tables, io.SLOT_MAPPING: inp.slot_mapping}
        phase = io.Phase.DECODE.value if inp.is_decode else io.Phase.PREFILL.value
        sess = self.sessions[phase]
        if self.native_op is not None:
            logits = self._run_in_place(sess, self._bindings[phase], feeds)
        else:
            feeds.update(zip(self._pool_names, self.pools))
            outs = sess.run(self._out_names, feeds)
            if self.plugin:  # the graph returns the updated pools
                self.pools = list(outs[1:])
            else:
                for pool, new in zip(self.pools, outs[1:]):
                    io.store_paged_kv(pool, inp.slot_mapping, new)
            logits = outs[0]
        if self.manifest.all_logits and not inp.is_decode:
            logits = logits[inp.query_start_loc[1:] - 1]
        return logits.astype(np.float32, copy=False)

    @staticmethod
    def _run_in_place(sess, binding, feeds: dict) -> np.ndarray:
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(arr, dtype=np.int64))
        binding.bind_output(io.LOGITS)  # rebound (still output 0): allocated at this step's shape
        sess.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()
