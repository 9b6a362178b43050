"""The `kvexport dynamo BUILD` process: one engine loaded, served as an NVIDIA Dynamo worker
(aggregated: dynamo_worker.py; one side of disaggregated serving: dynamo_disagg.py) until
SIGTERM/SIGINT. This module owns the process's life: importing Dynamo (and NIXL for a
disaggregated worker) before the engine loads, registering the build as a token-input model
(`register_model`, with the KV block size and pool the router needs, read from the engine's KV
connector), serving the endpoint, and shutting down (the first signal lets in-flight requests
finish, a second ends them).

It sits above both worker modules, so neither imports the other's launcher (dynamo_disagg.py
builds on dynamo_worker.py; nothing imports back).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Callable

from kvexport.errors import ConfigError

from ..engine import LLMEngine
from .dynamo_disagg import DecodeWorker, PrefillWorker
from .cache_salts import SaltKey
from .dynamo_worker import DynamoWorker, DynamoWorkerOptions, import_dynamo, model_folder

log = logging.getLogger(__name__)


async def _serve(build_dir: Path, engine: LLMEngine, opts: DynamoWorkerOptions,
                 on_ready: Callable[[str, str], None] | None, salt_key: SaltKey | None = None) -> None:
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
    cfg, kv = engine.config, engine.kv_connector
    kv_publisher = None
    if cfg.enable_prefix_caching:
        kv_publisher = llm.KvEventPublisher(endpoint, kv_block_size=kv.block_size, enable_local_indexer=True)
    metrics_publisher = llm.WorkerMetricsPublisher()
    await metrics_publisher.create_endpoint(endpoint)
    worker_type = {"agg": llm.WorkerType.Aggregated, "prefill": llm.WorkerType.Prefill,
                   "decode": llm.WorkerType.Decode}[opts.mode]
    needs: list | None = None
    if opts.mode == "agg":
        worker = DynamoWorker(engine, exceptions, kv_publisher, metrics_publisher)
    else:  # disaggregated: each side needs the other (Dynamo's readiness gate)
        cls = PrefillWorker if opts.mode == "prefill" else DecodeWorker
        worker = cls(engine, exceptions, kv_publisher, metrics_publisher, transport=opts.kv_transfer,
                     timeout_s=opts.kv_transfer_timeout_s)
        needs = [[llm.WorkerType.Decode if opts.mode == "prefill" else llm.WorkerType.Prefill]]
    worker.salt_key = salt_key  # every mode takes salts by cache_salts.py's rule
    endpoint.metrics.register_prometheus_expfmt_callback(worker.prometheus_text)

    rc = llm.ModelRuntimeConfig()
    rc.total_kv_blocks = kv.usage().usable_blocks
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
                                 worker_type=worker_type, kv_cache_block_size=kv.block_size,
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
    salt_key = opts.load_salt_key()  # likewise a bad key file
    if opts.mode != "agg" and opts.kv_transfer == "nixl":
        from .kv_transfer import import_nixl

        import_nixl()
    build_dir = Path(build_dir)
    engine = LLMEngine(build_dir, opts.engine)
    model_folder(build_dir, engine)
    asyncio.run(_serve(build_dir, engine, opts, on_ready, salt_key))
