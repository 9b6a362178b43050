"""The engine: requests in, `RequestOutput`s out. One `step()`:

    schedule ──SchedulerOutput──▶ run ──ModelRunnerOutput──▶ postprocess
    Scheduler.schedule()   ModelRunner.execute()   Scheduler.update_from_output() -> OutputProcessor.process()
    (speculative decoding: the runner's Drafter drafts after the forward, execution/proposers.py)

    Scheduler ⇄ KVCacheManager ⇄ BlockPool        (token counts, block ids)
    ModelRunner: pack() -> ModelInput -> Backend.execute() -> logits -> sample()
    OutputProcessor: detokenize, stop strings, RequestOutput (new objects each step)

This module owns wiring the parts together for one build (`LLMEngine`) and the public
request calls (add, abort, step, outputs). A request that fails — token ids outside the
vocabulary, a backend error it caused — fails alone; the engine keeps serving the rest.
KV blocks move in or out of the pools (tiers, disaggregated hand-off, persistence at `close()`,
router events) only through `LLMEngine.kv_connector` (runtime/kv_connector.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from kvexport import io, lora_adapters, manifest as mf, verify
from kvexport.errors import ConfigError, KvExportError

from .execution.backends import create_backend
from .core.block_pool import BlockPool
from .config import EngineConfig
from .core.windowed_kv_cache_manager import WindowedKVCacheManager
from .core.kv_cache_manager import KVCacheManager
from .core.kv_cache_coordinator import KVCacheCoordinator, coordinator_for
from .core.kv_connector import KVConnectorScheduler
from .core.kv_tiers import TierIndex
from .core.memory import kv_pool_sizes, parse_budget, parse_size, physical_memory
from .execution.kv_connector import KVConnectorWorker
from .execution.kv_offload import KVOffload
from .execution.model_input import Backend
from .execution.model_runner import ModelRunner
from .execution.output_processor import OutputProcessor, RequestOutput
from .execution.structured import StructuredOutputManager
from .kv_connector import KVConnector
from . import lora
from .frontend import RequestPrep
from .request_checks import RequestError, check_token_ids, prompt_logprobs_refusal
from .sampling_params import SamplerState, SamplingParams
from .tokenizer import load_build_tokenizer
from .core.importance import check_request_budget
from .core.scheduler import Scheduler, SchedulerConfig, Status
from .core.stats import SchedulerStats, SpecDecodingStats
from .policies import check_before_load, policies_for

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput"]

class LLMEngine:
    def __init__(self, build_dir: str | Path, config: EngineConfig = EngineConfig(), backend: Backend | None = None):
        self.build_dir = Path(build_dir)
        self.manifest = mf.load(self.build_dir)
        check_before_load(self.build_dir, self.manifest, config)  # before the sessions load (runtime/policies.py)
        backend, config = self._load(config, backend)
        self.config = config
        # LoRA adapters served beside the base model (runtime/lora.py), bound once; None: none
        self.loras = lora.load(self.build_dir, self.manifest, config)
        if self.loras is not None:
            backend.set_lora_factors(self.loras.factors)
        kv, model = self.manifest.kv, self.manifest.model
        self.vocab_size: int = model.vocab_size
        eos = model.eos_token_ids
        local = self.manifest.layer_groups is not None  # a windowed-layer KV cache group (kvexport/io.py)
        self.kv, pools, offload = self._kv_managers(config, backend)  # and self.pool, self.tiers
        # the one seam for moving KV blocks in or out (runtime/kv_connector.py): serving code uses only it
        self.kv_connector = KVConnector(KVConnectorScheduler(pools, self.tiers, kv.local_window if local else None),
                                        KVConnectorWorker(backend, self.manifest, offload))
        max_model_len = min(config.max_model_len or kv.max_seq_len, kv.max_seq_len)
        # eviction, speculation and its drafter (runtime/policies.py); None: off
        p = policies_for(self.build_dir, self.manifest, config, max_model_len=max_model_len,
                         pool_tokens=self.pool.num_usable_blocks * kv.block_size)
        self.importance, self.speculation, self.drafter = p.importance, p.speculation, p.drafter
        window = None if p.streaming else kv.local_window if local else model.uniform_window
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                                                   window, eos, streaming=p.streaming), self.kv,
                                   speculation=p.speculation, eviction=p.importance)
        self.runner = ModelRunner(backend, kv.block_size, eos, offload=offload, drafter=p.drafter)
        self.tokenizer = (load_build_tokenizer(self.build_dir, self.manifest.tokenizer) if self.manifest.tokenizer
                          else None)
        self.outputs = OutputProcessor(self.tokenizer)
        # structured output's grammars (execution/structured.py): compiled once per spec, one matcher per sequence
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, eos)
        # what front ends may use from their own threads to prepare requests (runtime/frontend.py)
        self.prep = RequestPrep(self.tokenizer, self.vocab_size, self.max_model_len, self.check_params,
                                self.structured.compile, lambda: self.loras.names if self.loras is not None else ())
        self._ids = 0

    def _load(self, config: EngineConfig, backend: Backend | None) -> tuple[Backend, EngineConfig]:
        """The backend (`backend`, or sessions made for the KV pool `config` budgets; create_backend
        returns the config it settled) and the config; the weights file is checked against its
        recorded sha256 (kvexport/verify.py) while the sessions load."""
        num_blocks, local_blocks = self._pool_blocks(config)
        checksum = verify.Verification.start(self.build_dir, self.manifest)
        try:
            if backend is None:
                backend, config = create_backend(self.build_dir, self.manifest, config, num_blocks,
                                                 local_num_blocks=local_blocks)
        except BaseException:
            checksum.cancel()
            raise
        checksum.wait()  # ChecksumError: a damaged weights file is refused, never served
        return backend, config

    def _pool_blocks(self, config: EngineConfig) -> tuple[int, int | None]:
        """KV blocks of the full-attention pool and of the windowed layers' (None: no such group)
        that config.kv_cache_memory holds (the pad block counted inside the budget)."""
        budget = parse_budget(config.kv_cache_memory)
        if budget < 1:
            raise ConfigError(f"kv_cache_memory {config.kv_cache_memory!r} is 0 bytes: give a size such as 2GiB, or a "
                              f"share of the free memory such as 30%")
        if config.backend == "onnxruntime" and budget > physical_memory():  # the pool is host memory
            raise ConfigError(f"kv_cache_memory {config.kv_cache_memory!r} ({budget / 2**30:.4g} GiB) is more than "
                              f"this machine's memory ({physical_memory() / 2**30:.1f} GiB): give a smaller size, or "
                              f"a share of the free memory such as 30%")
        kv, groups = self.manifest.kv, self.manifest.layer_groups  # groups None: one KV cache group
        # NOTE: the one pool sizing (`kvexport plan` calls it too): with a local group, the windowed
        # layers' group gets what its window needs, the full group the rest
        # Gemma 4: layers sharing KV hold no pools, layers may differ in KV shape (io.py "Shared KV")
        kv_layers, dims = io.kv_layout(self.manifest.model.spec, kv.num_kv_heads, kv.head_dim)
        per_token = io.kv_bytes_per_token_layers(groups or (io.FULL_GROUP,) * kv.num_layers, dims, kv_layers,
                                                 io.DType(kv.dtype), kv.latent)
        sizes = kv_pool_sizes(budget, kv.block_size, per_token, kv.local_window, config.max_num_seqs,
                              config.max_num_batched_tokens)
        return sizes.num_blocks, sizes.local_num_blocks

    def _kv_managers(self, config: EngineConfig,
                     backend: Backend) -> tuple[KVCacheCoordinator, dict[str, Any], KVOffload | None]:
        """The KV cache coordinator over the build's specs (core/kv_cache_coordinator.py: the attention
        groups' manager, and a hybrid's recurrent state; sets self.pool and self.tiers), the pools by KV
        cache group (what the connector moves), and the tiers' offload worker (None: no tiers)."""
        kv = self.manifest.kv
        self.pool = BlockPool(backend.num_blocks, kv.block_size, enable_prefix_caching=config.enable_prefix_caching)
        self.tiers, offload = self._kv_tiers(config, backend)  # KV tiers below the pool (core/kv_tiers.py)
        manager: Any = KVCacheManager(self.pool, self.tiers)  # the attention groups' manager
        pools: dict[str, Any] = {io.FULL_GROUP: self.pool}  # by KV cache group (io.py)
        if self.manifest.layer_groups is not None:  # two KV cache groups: windowed layers freed behind the window
            local = BlockPool(getattr(backend, "local_num_blocks", None) or backend.num_blocks, kv.block_size,
                              enable_prefix_caching=config.enable_prefix_caching)
            manager = WindowedKVCacheManager(self.pool, local, kv.local_window, self.tiers)
            pools[io.LOCAL_GROUP] = local
        coordinator = coordinator_for(manager, self.manifest.model.spec, config)  # hybrids: + the state's spec
        if coordinator.checkpoints is not None:  # state checkpoints move as blocks (io.STATE_GROUP)
            pools[io.STATE_GROUP] = coordinator.checkpoints
        return coordinator, pools, offload

    def _kv_tiers(self, config: EngineConfig, backend: Backend) -> tuple[TierIndex | None, KVOffload | None]:
        """The host and disk tiers below the pool (core/kv_tiers.py, execution/kv_offload.py), or
        (None, None) when both are off. The disk tier's index is rebuilt from its files (a restart)."""
        host = parse_size(config.kv_offload_memory)
        folder = config.kv_offload_dir
        if not host and not folder:
            return None, None
        if host > physical_memory():
            raise ConfigError(f"kv_offload_memory {config.kv_offload_memory!r} ({host / 2**30:.4g} GiB) is more than "
                              f"this machine's memory ({physical_memory() / 2**30:.1f} GiB): give a smaller size")
        disk = parse_size(config.kv_offload_disk) if folder else 0
        offload = KVOffload(backend, self.manifest, config.kv_offload_dtype)
        need = max(offload.block_bytes.values())  # NOTE: a hybrid's state checkpoint is one "block" too
        what = "KV block or state checkpoint" if io.STATE_GROUP in offload.block_bytes else "KV block"
        if host and host < need:
            raise ConfigError(f"kv_offload_memory {config.kv_offload_memory!r} holds no {what} (the largest of this "
                              f"build is {need} bytes): give at least {need} bytes, or 0 to turn the host tier off")
        if folder:
            at = Path(folder).expanduser().absolute()
            while not at.exists() and at != at.parent:
                at = at.parent
            total = shutil.disk_usage(at).total
            if not need <= disk <= total:
                raise ConfigError(f"kv_offload_disk {config.kv_offload_disk!r} must be between one {what} ({need} "
                                  f"bytes) and the size of the disk holding kv_offload_dir ({total} bytes)")
            offload.open_disk(folder)  # checks the folder (ConfigError naming kv_offload_dir)
        tiers = TierIndex(offload.block_bytes, host, disk, staged_cap=backend.num_blocks)
        tiers.add_disk_blocks(offload.disk_blocks())
        return tiers, offload

    @property
    def backend(self) -> Backend:
        """The execution backend (the model runner owns it)."""
        return self.runner.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        """Swap the backend the steps call (a wrapper around it, e.g. a benchmark's timer); the KV
        connector keeps reading the pools of the backend the engine was built with."""
        self.runner.backend = backend

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) served: the build's context, capped by the pool.
        With streaming eviction: the longest prompt + 1 (outputs go on past it)."""
        return self.scheduler.max_model_len

    @property
    def streaming(self) -> bool:
        """--kv-eviction streaming: max_tokens is not bounded by max_model_len."""
        return self.scheduler.streaming is not None

    def check_params(self, params: SamplingParams) -> None:
        """What a request's settings ask of this engine (prompt scores, speculation, a KV budget):
        RequestError naming the field. add_request checks it; a front end calls it before queueing
        so a refusal is its client's 400, not a failed request (it reads only the engine's settings:
        safe from any thread)."""
        if params.prompt_logprobs is not None and not self.manifest.scores_prompts:
            raise RequestError(prompt_logprobs_refusal(self.build_dir), "prompt_logprobs")
        if params.speculative and self.speculation is None:
            raise RequestError("speculative: this engine runs without speculative decoding; start it with "
                               "--speculative ngram (or draft --draft-model BUILD), or leave speculative unset",
                               "speculative")
        check_request_budget(params.kv_budget_tokens, self.importance.b if self.importance else None,
                             self.max_model_len)
        if params.lora is not None:
            if self.loras is None or not self.loras.names:
                raise RequestError(f"lora: this engine serves no adapters (asked for {params.lora!r}); start it with "
                                   f"--lora-modules NAME=PATH on a build made with --lora-max-rank", "lora")
            self.loras.slot(params.lora)

    def load_lora(self, name: str, adapter: "lora_adapters.LoraAdapter") -> None:
        """Serve `adapter` (a PEFT folder read and checked: kvexport.lora_adapters.read, in any thread) as `name`
        from the next step on (vLLM's /v1/load_lora_adapter). Call it where the engine steps (between steps).
        ConfigError naming lora_name / lora_path (runtime/lora.py LoraAdapters.add)."""
        if self.loras is None:
            raise ConfigError(f"lora_name: {self.build_dir} takes no adapters (built without --lora-max-rank); "
                              f"rebuild it with `kvexport build MODEL --lora-max-rank R`")
        self.loras.add(name, adapter)
        self.backend.set_lora_factors(self.loras.factors)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (vLLM's /v1/unload_lora_adapter); call it between steps. RequestError
        naming lora_name for a name not loaded, or while unfinished requests run under it (its slot would turn
        into the base model under them)."""
        if self.loras is None or name not in self.loras.names:
            raise RequestError(f"lora_name: no adapter {name!r} is loaded", "lora_name")
        slot = self.loras.slot(name)
        using = sum(1 for r in self.scheduler.requests.values()
                    if r.lora_slot == slot and r.status is not Status.FINISHED)
        if using:
            raise RequestError(f"lora_name: adapter {name!r} is in use by {using} unfinished request(s); unload it "
                               f"when they finish", "lora_name")
        self.loras.remove(name)
        self.backend.set_lora_factors(self.loras.factors)

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    sample_index: int = 0, share_prompt_with: str | None = None, salt: str | None = None) -> str:
        """Queue a request; returns its id. Token ids outside the vocabulary raise
        RequestError before anything is queued. A prompt the context cannot hold is
        accepted and finished at once with an error output (see `output()`). `salt`: its
        prefix-cache salt (core/block_hash.request_salt): it shares cached KV blocks only with
        requests of the same salt."""
        if not isinstance(params, SamplingParams):
            raise KvExportError("params must be a SamplingParams")
        prompt = check_token_ids(prompt, self.vocab_size)
        check_token_ids(list(params.stop_token_ids), self.vocab_size, "stop_token_ids")
        self.check_params(params)
        rid = request_id or f"req-{self._ids}"
        self._ids += 1
        if rid in self.outputs:
            raise RequestError(f"request id {rid!r} is already in use; pick a unique id", "request_id")
        grammar = self.structured.matcher(params.structured)  # GrammarError (400) before anything is queued
        if params.lora is not None:  # its adapter's slot; its identity kept apart in the prefix cache (lora.py)
            slot, salt = self.loras.slot(params.lora), self.loras.salt(params.lora, salt)
        else:
            slot = lora.BASE_SLOT
        req = self.scheduler.new_request(rid, prompt, params, SamplerState.create(params, sample_index, prompt,
                                                                                  grammar),
                                         salt=salt, share_prompt_with=share_prompt_with, lora_slot=slot)
        self.outputs.add_request(rid, prompt, params)
        if req.status is Status.FINISHED:  # refused at admission (too long, empty)
            self.outputs.finish(rid, req.finish_reason or "error", req.error)
        return rid

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.outputs.finish(request_id, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> SchedulerStats:
        """The engine's statistics now (core/stats.py SchedulerStats: queues, KV pool and prefix
        cache, preemptions, tiers, checkpoints, speculation): the one producer every reader
        (/metrics, Triton, Dynamo, the benches) takes its figures from."""
        return self.scheduler.stats(tiers=self.kv_connector.tier_stats(), state=self.kv.state_stats())

    def free_seq_slots(self) -> int:
        """How many more sequences add_request may queue now: max_num_seqs less those running and waiting."""
        s = self.scheduler
        return s.config.max_num_seqs - len(s.running) - len(s.waiting)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs that changed (new tokens or finished)."""
        scheduled = self.scheduler.schedule()
        # NOTE: a step with only KV tier transfers (or a disk read to wait for) still goes to the runner
        busy = scheduled.scheduled or scheduled.kv_ops or self.scheduler.tiers_loading
        result = self.runner.execute(scheduled) if busy else None
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

    def spec_stats(self) -> SpecDecodingStats | None:
        """Speculative decoding's figures (core/stats.py SpecDecodingStats), or None when it is off."""
        return self.speculation.stats() if self.speculation is not None else None

    def close(self, timeout_s: float = 30.0) -> None:
        """Before the process ends (a server stopping; call it from the thread that owns the engine,
        with no step running): write the prefix-cache blocks the pool and the host tier still hold
        to the disk tier (most recently used first, within its budget) and wait up to `timeout_s`
        for the writes, so a restart on the same kv_offload_dir finds them; then release the
        folder (its lock) and stop using the disk tier (no-op without one); and stop the grammar
        compiles' child processes."""
        self.kv_connector.persist(timeout_s)
        self.kv_connector.close()
        self.structured.close()
