"""The `kvexport dynamo BUILD` process: one engine loaded, served as an NVIDIA Dynamo worker
(aggregated: dynamo_worker.py; one side of disaggregated serving: dynamo_disagg.py) until
SIGTERM/SIGINT. This module owns the process's life: importing Dynamo (and NIXL for a
disaggregated worker) before the engine loads, registering the build as a token-input model
(`register_model`, with the KV block size and pool the router needs, read from the engine's KV
connector), serving the endpoint, its readiness (the system server's /health: ready once
discovery lists the worker), and shutting down (the first signal lets in-flight requests
finish, a second ends them; a worker whose discovery registration expired exits non-zero:
`_watch_registration`).

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

from kvexport.errors import ConfigError, KvExportError

from ..engine import LLMEngine
from .dynamo_disagg import DecodeWorker, PrefillWorker
from .dynamo_events import check_event_plane, loopback_defaults
from .cache_salts import SaltKey
from .dynamo_worker import DynamoWorker, DynamoWorkerOptions, check_model_files, import_dynamo, model_folder

log = logging.getLogger(__name__)

WATCH_EVERY_S = 1.0  # how often the worker checks that discovery still lists it
LOST_AFTER_S = 3.0  # unlisted this long (after being listed): the registration is lost (`_watch_registration`)


class RegistrationLost(KvExportError):
    """The worker's discovery registration expired and Dynamo 1.6.1 does not renew it: the process
    exits non-zero (2, the CLI's error status) so that its supervisor starts it again."""


async def _watch_registration(endpoint, on_listed: Callable[[], None], on_lost: Callable[[str], None]) -> None:
    """Call `on_listed()` when discovery first lists this worker's instance (it serves: the system
    server's /health says ready from then on; Dynamo 1.6.1 starts it "notready", a 503, and leaves
    it so), and `on_lost(why)` once it has been missing for LOST_AFTER_S after that.
    NOTE: a process paused past its discovery lease (SIGSTOP, a long GC or disk stall, a throttled
    container; file discovery's lease is about 10 s) finds its entries gone when it resumes:
    Dynamo 1.6.1's keep-alive then fails for good (`FileStore::keep_alive failed opening owned
    file`, every few seconds) and nothing registers the instance, the model card or the KV event
    source again (`Endpoint.register_endpoint_instance` re-adds the instance only), so the worker
    would sit unlisted, alive and idle, forever. Exiting is the one way back its API gives."""
    client = await endpoint.client()
    me = endpoint.connection_id()
    seen, missing_since = False, None
    while True:
        await asyncio.sleep(WATCH_EVERY_S)
        listed = me in client.instance_ids()
        now = asyncio.get_running_loop().time()
        if listed:
            if not seen:
                on_listed()
            seen, missing_since = True, None
        elif seen:
            missing_since = now if missing_since is None else missing_since
            if now - missing_since >= LOST_AFTER_S:
                on_lost(f"instance {me:x} is no longer listed in discovery (its lease expired: the process was "
                        f"paused or cut off longer than the lease) and Dynamo 1.6.1 does not register it again")
                return


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
    worker.set_health = runtime.set_health_status  # a deployment found inconsistent: not ready (/health)

    async def status(body: dict) -> dict:  # GET /engine/kvexport/status (system server): why not ready
        return {"ready": worker.not_ready_reason is None, "reason": worker.not_ready_reason}

    runtime.register_engine_route("kvexport/status", status)
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
    lost: list[str] = []

    def on_listed() -> None:
        if worker.not_ready_reason is None:  # a worker found misconfigured stays not ready
            runtime.set_health_status(True)

    def on_lost(why: str) -> None:
        if stops:  # stopping on a signal: the worker left discovery itself
            return
        lost.append(why)
        worker.not_ready_reason = why
        runtime.set_health_status(False)
        log.error("exiting so that a supervisor restarts this worker: %s", why)
        worker.thread.stop(reason="the worker lost its discovery registration")  # in-flight streams: an error
        runtime.shutdown()

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
        watch = asyncio.ensure_future(_watch_registration(endpoint, on_listed, on_lost))
        try:
            await endpoint.serve_endpoint(worker.generate, graceful_shutdown=True)
        finally:
            watch.cancel()
        if lost:
            raise RegistrationLost(f"this Dynamo worker lost its registration: {lost[0]}")
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
    discovery = opts.discovery_backend or os.environ.get("DYN_DISCOVERY_BACKEND", "etcd")
    loopback_defaults(discovery)  # one machine: listen on loopback unless told otherwise
    log.info("event plane: %s", check_event_plane(discovery, opts.public_event_plane).where)  # or refuse
    if opts.mode != "agg" and opts.kv_transfer == "nixl":
        from .kv_transfer import import_nixl

        import_nixl()
    build_dir = Path(build_dir)
    if (build_dir / "kvexport.json").is_file():  # without one, LLMEngine says what the folder is not
        check_model_files(build_dir)  # before the load: a build the frontend cannot read fails in a second
    engine = LLMEngine(build_dir, opts.engine)
    model_folder(build_dir, engine)
    asyncio.run(_serve(build_dir, engine, opts, on_ready, salt_key))
