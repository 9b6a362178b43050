"""The engine: requests in, `RequestOutput`s out. One `step()` is three lines:

    schedule ──SchedulerOutput──▶ run ──ModelRunnerOutput──▶ postprocess
    Scheduler.schedule()          ModelRunner.execute()      Scheduler.update_from_output() -> OutputProcessor.process()

    Scheduler ⇄ KVCacheManager ⇄ BlockPool        (token counts, block ids)
    ModelRunner: pack() -> ModelInput -> Backend.execute() -> logits -> sample()
    OutputProcessor: detokenize, stop strings, RequestOutput (new objects each step)

This module owns wiring the parts together for one build (`LLMEngine`) and the public
request calls (add, abort, step, outputs). A request that fails — token ids outside the
vocabulary, a backend error it caused — fails alone; the engine keeps serving the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvexport import io, manifest as mf
from kvexport.errors import ConfigError, KvExportError

from .execution.backends import create_backend
from .core.block_pool import BlockPool
from .config import EngineConfig
from .core.hybrid_kv_cache_manager import HybridKVCacheManager
from .core.kv_cache_interface import KVCacheManagerProtocol
from .core.kv_cache_manager import KVCacheManager
from .core.memory import kv_pool_sizes, parse_budget, physical_memory
from .execution.model_input import Backend
from .execution.model_runner import ModelRunner
from .execution.output_processor import OutputProcessor, RequestOutput
from .serving.requests import RequestError, check_token_ids, prompt_logprobs_refusal
from .sampling_params import SamplerState, SamplingParams
from .core.scheduler import Scheduler, SchedulerConfig, Status

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput"]


class LLMEngine:
    def __init__(self, build_dir: str | Path, config: EngineConfig = EngineConfig(), backend: Backend | None = None):
        self.build_dir = Path(build_dir)
        self.manifest = mf.load(self.build_dir)
        kv = self.manifest.kv
        if kv.layout != io.KVLayout.PAGED.value:
            raise KvExportError(f"the runtime serves paged builds; {self.build_dir} has layout {kv.layout!r}: "
                                f"rebuild it with `kvexport build MODEL --layout paged`")
        budget = parse_budget(config.kv_cache_memory)
        if budget < 1:
            raise ConfigError(f"kv_cache_memory {config.kv_cache_memory!r} is 0 bytes: give a size such as 2GiB, or a "
                              f"share of the free memory such as 30%")
        if config.backend == "onnxruntime" and budget > physical_memory():  # the pool is host memory
            raise ConfigError(f"kv_cache_memory {config.kv_cache_memory!r} ({budget / 2**30:.4g} GiB) is more than "
                              f"this machine's memory ({physical_memory() / 2**30:.1f} GiB): give a smaller size, or "
                              f"a share of the free memory such as 30%")
        # the pad block is counted inside the budget
        groups = self.manifest.layer_groups  # None: one KV cache group
        # NOTE: the one pool sizing (`kvexport plan` calls it too): with a local group, the windowed
        # layers' group gets what its window needs, the full group the rest
        per_token = io.kv_bytes_per_token_by_group(groups or (io.FULL_GROUP,) * kv.num_layers, kv.num_kv_heads,
                                                   kv.head_dim, io.DType(kv.dtype))
        sizes = kv_pool_sizes(budget, kv.block_size, per_token, kv.local_window, config.max_num_seqs,
                              config.max_num_batched_tokens)
        num_blocks, local_blocks = sizes.num_blocks, sizes.local_num_blocks
        if backend is None:
            backend, config = create_backend(self.build_dir, self.manifest, config, num_blocks,
                                             local_num_blocks=local_blocks)
        self.config = config
        model = self.manifest.model
        self.vocab_size: int = model.vocab_size
        eos = model.eos_token_ids
        window = model.uniform_window
        self.pool = BlockPool(backend.num_blocks, kv.block_size, enable_prefix_caching=config.enable_prefix_caching)
        self.kv: KVCacheManagerProtocol[Any] = KVCacheManager(self.pool)
        if groups is not None:  # two KV cache groups (kvexport/io.py): windowed layers freed behind the window
            local = BlockPool(getattr(backend, "local_num_blocks", None) or backend.num_blocks, kv.block_size,
                              enable_prefix_caching=config.enable_prefix_caching)
            window = kv.local_window
            self.kv = HybridKVCacheManager(self.pool, local, window)
        max_model_len = min(config.max_model_len or kv.max_seq_len, kv.max_seq_len)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                                                   window, eos), self.kv)
        self.runner = ModelRunner(backend, kv.block_size, eos)
        self.tokenizer = None
        if self.manifest.tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.build_dir / self.manifest.tokenizer)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = 0

    @property
    def backend(self) -> Backend:
        """The execution backend (the model runner owns it)."""
        return self.runner.backend

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) served: the build's context, capped by the pool."""
        return self.scheduler.max_model_len

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    sample_index: int = 0, share_prompt_with: str | None = None) -> str:
        """Queue a request; returns its id. Token ids outside the vocabulary raise
        RequestError before anything is queued. A prompt the context cannot hold is
        accepted and finished at once with an error output (see `output()`)."""
        if not isinstance(params, SamplingParams):
            raise KvExportError("params must be a SamplingParams")
        prompt = check_token_ids(prompt, self.vocab_size)
        check_token_ids(list(params.stop_token_ids), self.vocab_size, "stop_token_ids")
        if params.prompt_logprobs is not None and not self.manifest.all_logits:
            raise RequestError(prompt_logprobs_refusal(self.build_dir), "prompt_logprobs")
        rid = request_id or f"req-{self._ids}"
        self._ids += 1
        if rid in self.outputs:
            raise RequestError(f"request id {rid!r} is already in use; pick a unique id", "request_id")
        req = self.scheduler.new_request(rid, prompt, params, SamplerState.create(params, sample_index, prompt),
                                         share_prompt_with=share_prompt_with)
        self.outputs.add_request(rid, prompt, params)
        if req.status is Status.FINISHED:  # refused at admission (too long, empty)
            self.outputs.finish(rid, req.finish_reason or "error", req.error)
        return rid

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.outputs.finish(request_id, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs that changed (new tokens or finished)."""
        scheduled = self.scheduler.schedule()
        result = self.runner.execute(scheduled) if scheduled.scheduled else None
        return self._postprocess(scheduled, result) if result is not None else []

    def _postprocess(self, scheduled, result) -> list[RequestOutput]:
        changed, stopped = self.outputs.process(self.scheduler.update_from_output(scheduled, result))
        self.scheduler.finish_requests(stopped, "stop")
        return changed

    def output(self, request_id: str) -> RequestOutput:
        return self.outputs.output(request_id)

    def pop_output(self, request_id: str) -> RequestOutput:
        """The request's last output; forgets the request (aborting it if unfinished)."""
        self.abort(request_id)
        self.scheduler.remove(request_id)
        return self.outputs.pop(request_id)

    def kv_stats(self) -> dict:
        st = self.pool.stats
        return {"blocks_total": self.pool.num_usable_blocks, "blocks_used": self.pool.num_used_blocks,
                "usage": self.pool.usage, "prefix_queries": st.queries, "prefix_hits": st.hits,
                "preemptions": self.scheduler.num_preemptions}

