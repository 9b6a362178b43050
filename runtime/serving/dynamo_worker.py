"""`kvexport dynamo BUILD`: kvexport's engine as an NVIDIA Dynamo backend worker, behind Dynamo's
OpenAI frontend (`python -m dynamo.frontend`) and its KV-aware router.

    client ──HTTP──▶ dynamo.frontend (tokenizes with the build's tokenizer, routes) ──request plane──▶
      this process: DistributedRuntime ── endpoint NS.backend.generate ── generate(request, context)
        request_to_params ──▶ EngineThread.submit ──▶ LLMEngine (the one engine thread)
        Event ──call_soon_threadsafe──▶ asyncio.Queue ──▶ chunks {token_ids, finish_reason, usage}
      engine thread, after every step (on_tick):
        engine.pool.pop_events() ──kv_event_batch──▶ KvEventPublisher  (blocks stored / removed)
        engine.pool.num_used_blocks              ──▶ WorkerMetricsPublisher (the router's load signal)

This module owns the worker's life: importing Dynamo (an optional extra), loading the engine,
registering the build as a token-input model (the frontend reads config.json and the tokenizer
files at the build's root), serving the endpoint, cancelling a request whose client left
(`context.async_killed_or_stopped()`), raising the engine's errors as Dynamo errors
(InvalidArgument for a bad request, Unknown for an engine failure, EngineShutdown when the engine
thread has stopped) and shutting down on SIGTERM/SIGINT (in-flight requests finish; a second
signal ends them). The wire format itself is dynamo_protocol.py.

`--mode prefill` / `--mode decode` workers split a request between two workers (Dynamo's
disaggregated serving): runtime/serving/dynamo_disagg.py, the KV hand-off through NIXL in
runtime/serving/kv_transfer.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvexport.errors import ConfigError, KvExportError

from ..config import EngineConfig
from ..engine import LLMEngine
from . import metrics
from ..core.block_hash import request_salt
from .dynamo_protocol import chunk, completion_usage, kv_event_batch, request_cache_salt, request_to_params
from .engine_thread import EngineThread, Event
from .requests import RequestError, RequestParser

log = logging.getLogger(__name__)

MODES = ("agg", "prefill", "decode")  # --mode: aggregated, or one side of disaggregated serving (dynamo_disagg.py)
KV_TRANSFERS = ("nixl", "request-plane")  # --kv-transfer: how prefill workers hand KV blocks to decode workers
DISCOVERY_BACKENDS = ("etcd", "file", "kubernetes", "mem")
REQUEST_PLANES = ("tcp", "nats")
INSTALL_HINT = ('pip install "kvexport[dynamo]" && pip install --no-deps ai-dynamo==1.6.1 '
                "(ai-dynamo's own requirement `aisimulate` cannot be installed; docs/DEPLOYMENT.md)")
METRICS_EVERY_S = 1.0  # the load signal is re-sent at least this often even when it did not change
_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True, slots=True)
class DynamoWorkerOptions:
    engine: EngineConfig = EngineConfig()  # the runtime settings (as `kvexport serve` takes them)
    mode: str = "agg"  # disaggregation role: MODES
    namespace: str = "kvexport"  # Dynamo namespace; the frontend finds workers by it (its --namespace)
    component: str | None = None  # the endpoint is dyn://namespace.component.endpoint; None: "prefill" for
    # --mode prefill (as Dynamo's vLLM and SGLang prefill workers name it), else "backend"
    endpoint: str = "generate"
    served_model_name: str | None = None  # the model name clients send; None: the build directory's name
    discovery_backend: str | None = None  # DISCOVERY_BACKENDS; None: $DYN_DISCOVERY_BACKEND, else etcd
    request_plane: str | None = None  # REQUEST_PLANES; None: $DYN_REQUEST_PLANE, else tcp
    kv_transfer: str = "nixl"  # KV_TRANSFERS: NIXL (host memory over UCX), or inline in the prefill's response
    kv_transfer_timeout_s: float = 60.0  # seconds a prefill worker keeps a request's KV for its decode worker

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.kv_transfer not in KV_TRANSFERS:
            raise ConfigError(f"kv_transfer must be one of {', '.join(KV_TRANSFERS)}, got {self.kv_transfer!r}")
        t = self.kv_transfer_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise ConfigError(f"kv_transfer_timeout_s must be seconds in (0, 3600], got {t!r}")
        if self.mode != "agg" and not self.engine.enable_prefix_caching:
            raise ConfigError(f"--mode {self.mode}: disaggregated workers hand KV blocks over by their prefix-cache "
                              "keys: turn prefix caching on (enable_prefix_caching)")
        if self.component is None:
            object.__setattr__(self, "component", "prefill" if self.mode == "prefill" else "backend")
        for name in ("namespace", "component", "endpoint"):
            v = getattr(self, name)
            if not isinstance(v, str) or not _NAME.fullmatch(v):
                raise ConfigError(f"{name} must be letters, digits, '_' or '-' (it is one part of "
                                  f"dyn://namespace.component.endpoint), got {v!r}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("served_model_name must not be empty")
        for name, choices in (("discovery_backend", DISCOVERY_BACKENDS), ("request_plane", REQUEST_PLANES)):
            v = getattr(self, name)
            if v is not None and v not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {v!r}")

    @property
    def path(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"


def import_dynamo():
    """The `dynamo` package's modules this worker uses, or a ConfigError saying how to install it."""
    try:
        from dynamo import llm, runtime
        from dynamo.llm import exceptions
    except ImportError as e:
        raise ConfigError(f"`kvexport dynamo` needs NVIDIA Dynamo ({e}): {INSTALL_HINT}") from None
    return llm, runtime, exceptions


def model_folder(build_dir: Path, engine: LLMEngine) -> Path:
    """The folder Dynamo's frontend loads the model card from: the build's root, which holds
    config.json, generation_config.json and the tokenizer files (exporter/interop.py). Refuses
    builds without a tokenizer (the frontend tokenizes) or without those side files."""
    if engine.tokenizer is None:
        raise ConfigError(f"{build_dir} has no tokenizer: Dynamo's frontend tokenizes the prompts, so build "
                          "from a model that has one")
    missing = [n for n in ("config.json", "tokenizer.json", "tokenizer_config.json") if not (build_dir / n).is_file()]
    if missing:
        raise ConfigError(f"{build_dir} lacks {', '.join(missing)} at its root (Dynamo's frontend reads them): "
                          "rebuild it with this kvexport (`kvexport build ... --force`)")
    return build_dir


class DynamoWorker:
    """One engine served on one Dynamo endpoint. `generate` is the endpoint's handler (asyncio);
    `tick` runs on the engine thread after every step and publishes the KV events and the load."""

    def __init__(self, engine: LLMEngine, exceptions, kv_publisher=None, metrics_publisher=None):
        self.engine = engine
        self.parser = RequestParser.for_engine(engine)
        self.errors = exceptions
        self.kv_publisher = kv_publisher
        self.metrics_publisher = metrics_publisher
        self.block_size = engine.pool.block_size
        self.cancelled = 0  # requests whose client left (context stopped or killed)
        self.skipped_events = 0  # stored blocks the router was not told of (no tokens: kv_event_batch)
        self._last_used: int | None = None
        self._last_publish = 0.0
        if kv_publisher is not None:
            engine.pool.record_events()
        self.thread = EngineThread(engine, on_tick=self.tick)

    # ---- engine thread --------------------------------------------------------------------
    def tick(self) -> None:
        pool = self.engine.pool
        if self.kv_publisher is not None:
            events = pool.pop_events()
            if events:
                batch, skipped = kv_event_batch(events, self.block_size)
                self.skipped_events += skipped
                if batch:
                    self.kv_publisher.publish_batch(batch)
        used, now = pool.num_used_blocks, time.monotonic()
        if self.metrics_publisher is not None and (used != self._last_used or now - self._last_publish > METRICS_EVERY_S):
            self.metrics_publisher.publish(0, kv_used_blocks=used)
            self._last_used, self._last_publish = used, now

    def close(self) -> None:
        """Release what the worker holds beside the engine (disaggregated workers: their NIXL agent)."""

    def prometheus_text(self) -> str:
        """kvexport's metrics (metrics.py), for the Dynamo system server's /metrics (DYN_SYSTEM_PORT)."""
        return metrics.prometheus_text(self.thread.counters, self.cancelled)

    # ---- the endpoint -----------------------------------------------------------------------
    def _decode(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id]) if self.engine.tokenizer is not None else f"token_id:{token_id}"

    async def generate(self, request: Any, context):
        """The endpoint handler: a PreprocessedRequest in, response chunks out (streamed)."""
        E = self.errors
        try:
            prompt, params = request_to_params(request, self.parser)
            # the client's cache_salt (no tenant: the frontend passes no API key; dynamo_protocol's NOTE)
            salt = request_salt(None, request_cache_salt(request))
        except RequestError as e:
            raise E.InvalidArgument(str(e)) from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        try:
            rids = self.thread.submit(prompt, params, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                                      salt=salt)
        except KvExportError as e:  # the engine thread has stopped
            raise E.EngineShutdown(str(e)) from None
        stopped = asyncio.ensure_future(context.async_killed_or_stopped())
        finished = cancelled = False

        def cancel(fut: asyncio.Future | None = None) -> None:
            """The client left, or the frontend stopped the request (a stop string): abort it now.
            NOTE: a callback on the context, not only a branch of the loop below: a kill that
            lands while a chunk is being sent fails that send, and Dynamo then stops pulling
            this generator without closing it, so the loop may never run again."""
            nonlocal cancelled
            if (fut is not None and fut.cancelled()) or finished or cancelled:
                return
            cancelled = True
            self.cancelled += 1
            self.thread.abort(rids)

        stopped.add_done_callback(cancel)
        try:
            while True:
                get = asyncio.ensure_future(events.get())
                await asyncio.wait((get, stopped), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # the client left, or the frontend stopped it (a stop string)
                    get.cancel()
                    cancel()
                    return
                ev = get.result()
                if ev.finished:
                    finished = True
                if ev.error is not None:
                    if not self.thread.is_alive():  # stopped (a second signal): the frontend may migrate it
                        raise E.EngineShutdown(f"kvexport engine: {ev.error}")
                    raise E.Unknown(f"kvexport engine: {ev.error}")
                out = chunk(ev, self._decode if params.logprobs else None)
                if ev.finished:
                    out["completion_usage"] = completion_usage(len(prompt), ev.num_tokens, ev.num_cached_prompt_tokens)
                    yield out
                    return
                yield out
        except (GeneratorExit, asyncio.CancelledError):  # Dynamo closed the stream: the client is gone
            cancel()
            raise
        finally:
            if not finished:  # cancelled, or the generator was closed: free the request's blocks
                self.thread.abort(rids)
            if not stopped.done():
                stopped.cancel()


async def _serve(build_dir: Path, engine: LLMEngine, opts: DynamoWorkerOptions,
                 on_ready: Callable[[str, str], None] | None) -> None:
    llm, runtime_mod, exceptions = import_dynamo()
    folder = model_folder(build_dir, engine)
    name = opts.served_model_name or build_dir.name
    loop = asyncio.get_running_loop()
    discovery = opts.discovery_backend or os.environ.get("DYN_DISCOVERY_BACKEND", "etcd")
    plane = opts.request_plane or os.environ.get("DYN_REQUEST_PLANE", "tcp")
    try:
        runtime = runtime_mod.DistributedRuntime(loop, discovery, plane)
    except Exception as e:  # noqa: BLE001 - Dynamo raises a bare Exception for its settings ($DYN_*)
        raise ConfigError(f"the Dynamo runtime did not start ({discovery} discovery, {plane} request plane): {e}; "
                          "check the DYN_* environment variables (docs/DEPLOYMENT.md)") from None
    endpoint = runtime.endpoint(opts.path)
    cfg, pool = engine.config, engine.pool
    kv_publisher = None
    if cfg.enable_prefix_caching:
        kv_publisher = llm.KvEventPublisher(endpoint, kv_block_size=pool.block_size, enable_local_indexer=True)
    metrics_publisher = llm.WorkerMetricsPublisher()
    await metrics_publisher.create_endpoint(endpoint)
    worker_type = {"agg": llm.WorkerType.Aggregated, "prefill": llm.WorkerType.Prefill,
                   "decode": llm.WorkerType.Decode}[opts.mode]
    needs: list | None = None
    if opts.mode == "agg":
        worker = DynamoWorker(engine, exceptions, kv_publisher, metrics_publisher)
    else:  # disaggregated: each side needs the other (Dynamo's readiness gate)
        from .dynamo_disagg import DecodeWorker, PrefillWorker

        cls = PrefillWorker if opts.mode == "prefill" else DecodeWorker
        worker = cls(engine, exceptions, kv_publisher, metrics_publisher, transport=opts.kv_transfer,
                     timeout_s=opts.kv_transfer_timeout_s)
        needs = [[llm.WorkerType.Decode if opts.mode == "prefill" else llm.WorkerType.Prefill]]
    endpoint.metrics.register_prometheus_expfmt_callback(worker.prometheus_text)

    rc = llm.ModelRuntimeConfig()
    rc.total_kv_blocks = pool.num_usable_blocks
    rc.max_num_seqs = cfg.max_num_seqs
    rc.max_num_batched_tokens = cfg.max_num_batched_tokens
    rc.context_length = engine.max_model_len
    rc.enable_local_indexer = kv_publisher is not None
    rc.kv_event_publishing_enabled = kv_publisher is not None
    model_type = llm.ModelType.Completions
    if getattr(engine.tokenizer, "chat_template", None):
        model_type = llm.ModelType.Chat | llm.ModelType.Completions
    if opts.mode == "prefill":  # no OpenAI surface; the legacy Prefill bit, as Dynamo's vLLM prefill worker sends
        model_type = llm.ModelType.Prefill
    worker.thread.start()
    stops = 0

    def on_signal() -> None:
        nonlocal stops
        stops += 1
        if stops == 1:
            log.warning("stopping: requests in flight finish first (a second signal ends them)")
            runtime.shutdown()
        else:
            worker.thread.stop(reason="the worker is shutting down")

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await llm.register_model(llm.ModelInput.Tokens, model_type, endpoint, str(folder), name,
                                 worker_type=worker_type, kv_cache_block_size=pool.block_size,
                                 runtime_config=rc, needs=needs)
        if on_ready is not None:
            on_ready(name, f"dyn://{opts.path}")
        await endpoint.serve_endpoint(worker.generate, graceful_shutdown=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        worker.thread.stop(reason="the worker is shutting down")
        worker.close()
        if kv_publisher is not None:
            kv_publisher.shutdown()
        runtime.shutdown()


def serve_dynamo(build_dir: str | Path, opts: DynamoWorkerOptions = DynamoWorkerOptions(),
                 on_ready: Callable[[str, str], None] | None = None) -> None:
    """Serve `build_dir` as a Dynamo worker until SIGTERM/SIGINT. `on_ready(model name, endpoint
    path)` is called once the model is registered and the endpoint is about to serve."""
    import_dynamo()  # before loading the engine: a missing extra fails in a second, not after the load
    if opts.mode != "agg" and opts.kv_transfer == "nixl":
        from .kv_transfer import import_nixl

        import_nixl()
    build_dir = Path(build_dir)
    engine = LLMEngine(build_dir, opts.engine)
    model_folder(build_dir, engine)
    asyncio.run(_serve(build_dir, engine, opts, on_ready))
