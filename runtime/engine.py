"""The engine: requests in, tokens out. One `step()` = schedule -> run the model on the
packed batch -> sample -> detokenize and check stops -> update the scheduler.

    Scheduler ⇄ KVCacheManager ⇄ BlockPool        (token counts, block ids)
        │ SchedulerOutput
        ▼
    ModelRunner.prepare() -> ModelInput -> Backend.execute() -> logits -> sample()
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from kvexport import io, manifest as mf
from kvexport.errors import KvExportError

from .block_pool import BlockPool
from .detokenizer import IncrementalDetokenizer
from .kv_cache_manager import KVCacheManager
from .memory import num_blocks_for_budget, parse_budget
from .onnx_backend import Backend, ModelInput, OnnxRuntimeBackend
from .sampling import SamplerState, SamplingParams, sample
from .scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput, Status


@dataclass(frozen=True, slots=True)
class EngineConfig:
    kv_cache_memory: str | int = "512MiB"  # KV pool budget: "2GiB", bytes, or "30%" of available memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the build's max_seq_len
    enable_prefix_caching: bool = True
    threads: int | None = None  # onnxruntime intra-op threads (default: all cores)
    backend: str = "onnxruntime"  # or "tensorrt": the build's engines (runtime/trt_backend.py)
    cuda_graph_batch_sizes: tuple[int, ...] = ()  # tensorrt: decode batch sizes captured as CUDA graphs

    def __post_init__(self) -> None:
        if self.backend not in ("onnxruntime", "tensorrt"):
            raise KvExportError(f"backend must be onnxruntime or tensorrt, got {self.backend!r}")


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    error: str | None = None
    new_text: str = ""  # text added by the latest step (streaming)
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_prompt_tokens: int = 0


def prepare(scheduled: Sequence[ScheduledRequest], block_size: int, full_tables: bool = False) -> ModelInput:
    """Scheduled requests -> the graphs' packed inputs. Block tables become a padded int64
    tensor only here, padded with io.PAD_BLOCK_ID.

    NOTE: the `onnx` attention reads from the pool only the KV of tokens computed in earlier
    steps (this step's keys come from the step itself), so the tables are cut to the blocks
    holding those: a fresh prompt passes a table of width 0 and attends to nothing stale.
    The `plugin` attention stores this step's KV first and reads it back (`full_tables`):
    its tables cover every block up to seq_lens."""
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    end = (lambda s: s.start_pos + len(s.token_ids)) if full_tables else (lambda s: s.start_pos)
    width = max(-(-end(s) // block_size) for s in scheduled)
    tables = np.full((len(scheduled), width), io.PAD_BLOCK_ID, np.int64)
    for r, s in enumerate(scheduled):
        ids.extend(s.token_ids)
        pos.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
        slots.extend(s.slot_mapping)
        qsl.append(qsl[-1] + len(s.token_ids))
        lens.append(s.start_pos + len(s.token_ids))
        used = -(-end(s) // block_size)
        tables[r, :used] = s.block_table[:used]
    a = lambda x: np.asarray(x, np.int64)  # noqa: E731
    return ModelInput(a(ids), a(pos), a(qsl), a(lens), tables, a(slots))


def _pack(rows: list[int], size: dict[int, int], slack: float) -> list[list[int]]:
    """Split rows into groups whose padded size (rows x largest size) stays within `slack`
    of their real size."""
    order = sorted(rows, key=lambda i: -size[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and (len(g) + 1) * size[g[0]] <= slack * (sum(size[j] for j in g) + size[i]):
            g.append(i)
        else:
            groups.append([i])
    return groups


def execute(backend: Backend, out: SchedulerOutput, block_size: int) -> np.ndarray:
    """Logits [num_scheduled, vocab], one row per scheduled request, in order.

    A backend whose attention works on the packed tokens (the PagedAttention op) runs the
    step as one call. NOTE: the `onnx` attention pads every sequence of a call to the
    call's longest query chunk. So there a step runs as several graph calls: 1-token
    decodes apart from prompt chunks, and prompt chunks of very different lengths apart
    (padding <= 25%). Each extra call re-reads the weights (~20 ms here) but computes no
    extra tokens; on the mixed-64 trace this cut prefill time from 32.6 s to ~25-29 s. Splitting decodes by context
    length the same way (slack 1.5, <= 3 groups) measured no better, so decodes stay one call."""
    rows = out.scheduled
    full = getattr(backend, "full_block_tables", False)
    if not getattr(backend, "pads_queries", True):
        return backend.execute(prepare(rows, block_size, full))
    q_len = {i: len(s.token_ids) for i, s in enumerate(rows)}
    single = [i for i in q_len if q_len[i] == 1]
    multi = [i for i in q_len if q_len[i] > 1]
    groups = _pack(multi, q_len, 1.25) + ([single] if single else [])
    if len(groups) == 1:
        return backend.execute(prepare(rows, block_size, full))
    logits = None
    for group in groups:
        part = backend.execute(prepare([rows[i] for i in group], block_size, full))
        if logits is None:
            logits = np.empty((len(rows), part.shape[1]), part.dtype)
        logits[group] = part
    return logits


class LLMEngine:
    def __init__(self, build_dir: str | Path, config: EngineConfig = EngineConfig(), backend: Backend | None = None):
        self.build_dir = Path(build_dir)
        self.manifest = mf.load(self.build_dir)
        kv = self.manifest.kv
        if kv.layout != io.KVLayout.PAGED.value:
            raise KvExportError(f"the runtime serves paged builds; {self.build_dir} has layout {kv.layout!r}: "
                                f"rebuild it with `kvexport build MODEL --layout paged`")
        max_model_len = min(config.max_model_len or kv.max_seq_len, kv.max_seq_len)
        # the pad block is counted inside the budget
        num_blocks = num_blocks_for_budget(parse_budget(config.kv_cache_memory), kv.bytes_per_token, kv.block_size)
        if backend is None and config.backend == "tensorrt":
            backend, config, max_model_len = self._tensorrt_backend(config, num_blocks, max_model_len)
        self.backend = backend or OnnxRuntimeBackend(self.build_dir, self.manifest, num_blocks, threads=config.threads)
        self.pool = BlockPool(self.backend.num_blocks, kv.block_size, enable_prefix_caching=config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   max_model_len, self.manifest.model["sliding_window"]), self.kv)
        self.tokenizer = None
        if self.manifest.tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.build_dir / self.manifest.tokenizer)
        self.eos_ids = tuple(self.manifest.model["eos_token_ids"])
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._outputs: dict[str, RequestOutput] = {}
        self._ids = 0
        self._changed: list[RequestOutput] = []  # outputs whose new_* fields the last step set

    def _tensorrt_backend(self, config: EngineConfig, num_blocks: int, max_model_len: int):
        """The TensorRT backend, with the scheduler's limits clamped to what the engines'
        optimization profiles accept (manifest engines.limits)."""
        from dataclasses import replace

        from .trt_backend import TensorRTBackend

        if not self.manifest.engines:
            raise KvExportError(f"{self.build_dir} has no TensorRT engines: build them with "
                                f"`kvexport engines {self.build_dir}` (needs TensorRT and a GPU)")
        lim = self.manifest.engines["limits"]
        config = replace(config, max_num_seqs=min(config.max_num_seqs, lim["max_num_seqs"]),
                         max_num_batched_tokens=min(config.max_num_batched_tokens, lim["max_num_batched_tokens"]))
        backend = TensorRTBackend(self.build_dir, self.manifest, min(num_blocks, lim["max_num_blocks"]),
                                  cuda_graph_batch_sizes=config.cuda_graph_batch_sizes)
        return backend, config, min(max_model_len, lim["max_seq_len"])

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) served: the build's context, capped by the pool."""
        return self.scheduler.max_model_len

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    sample_index: int = 0, share_prompt_with: str | None = None) -> str:
        if not isinstance(params, SamplingParams):
            raise KvExportError("params must be a SamplingParams")
        rid = request_id or f"req-{self._ids}"
        self._ids += 1
        req = self.scheduler.new_request(rid, prompt, params, SamplerState.create(params, sample_index, prompt),
                                         share_prompt_with=share_prompt_with)
        self._detok[rid] = IncrementalDetokenizer(self.tokenizer, params.stop)
        self._outputs[rid] = RequestOutput(rid, list(prompt), [], "", False, None, arrival_time=time.perf_counter(),
                                           logprobs=[] if params.logprobs is not None else None,
                                           top_logprobs=[] if params.logprobs else None)
        if req.status is Status.FINISHED:  # refused at admission (too long, empty)
            o = self._outputs[rid]
            o.finished, o.finish_reason, o.error, o.finish_time = True, req.finish_reason, req.error, time.perf_counter()
        return rid

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        o = self._outputs.get(request_id)
        if o and not o.finished:
            o.finished, o.finish_reason, o.finish_time = True, "abort", time.perf_counter()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs that changed (new tokens or finished)."""
        for o in self._changed:
            o.new_text, o.new_token_ids = "", []
        self._changed = []
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        logits = execute(self.backend, out, self.pool.block_size)
        sampled: dict[str, int] = {}
        changed = []
        for row, s in enumerate(out.scheduled):
            if not s.samples:
                continue
            req = self.scheduler.requests[s.request_id]
            tok, lp, top = sample(logits[row], req.sampler, req.sampler.prompt_tokens, req.num_output_tokens,
                                  self.eos_ids)
            sampled[s.request_id] = tok
            o = self._outputs[s.request_id]
            if lp is not None:
                o.logprobs.append(lp)
                if o.top_logprobs is not None:
                    o.top_logprobs.append(top)
        self.scheduler.update(out, sampled)
        now = time.perf_counter()
        for rid, tok in sampled.items():
            req, o = self.scheduler.requests[rid], self._outputs[rid]
            o.first_token_time = o.first_token_time or now
            o.num_cached_prompt_tokens = req.num_cached_prompt_tokens
            p = req.params
            new_text, stop_hit = self._detok[rid].add(tok)
            o.token_ids.append(tok)
            o.new_token_ids.append(tok)
            o.text += new_text
            o.new_text += new_text
            n = req.num_output_tokens
            reason = None
            if stop_hit:
                reason = "stop"
            elif n >= p.min_tokens and ((tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids):
                reason = "stop"
            elif n >= p.max_tokens or req.num_tokens >= self.scheduler.max_model_len:
                reason = "length"
            if reason:
                if reason == "length" or stop_hit:
                    tail = self._detok[rid].flush()
                    o.text += tail
                    o.new_text += tail
                self.scheduler.finish(rid, reason)
                o.finished, o.finish_reason, o.finish_time = True, reason, now
            changed.append(o)
        self._changed = changed
        return changed

    def output(self, request_id: str) -> RequestOutput:
        return self._outputs[request_id]

    def pop_output(self, request_id: str) -> RequestOutput:
        self._detok.pop(request_id, None)
        self.scheduler.requests.pop(request_id, None)
        return self._outputs.pop(request_id)

    def kv_stats(self) -> dict:
        st = self.pool.stats
        return {"blocks_total": self.pool.num_usable_blocks, "blocks_used": self.pool.num_used_blocks,
                "usage": self.pool.usage, "prefix_queries": st.queries, "prefix_hits": st.hits,
                "preemptions": self.scheduler.num_preemptions}
