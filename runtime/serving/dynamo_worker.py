"""`kvexport dynamo BUILD`: kvexport's engine as an NVIDIA Dynamo backend worker, behind Dynamo's
OpenAI frontend (`python -m dynamo.frontend`) and its KV-aware router.

    client ──HTTP──▶ dynamo.frontend (tokenizes with the build's tokenizer, routes) ──request plane──▶
      this process: DistributedRuntime ── endpoint NS.backend.generate ── generate(request, context)
        request_to_params ──▶ EngineThread.submit ──▶ LLMEngine (the one engine thread)
        Event ──call_soon_threadsafe──▶ asyncio.Queue ──▶ chunks {token_ids, finish_reason, usage}
      engine thread, after every step (on_tick), through the engine's KV connector (runtime/kv_connector.py):
        kv_connector.pop_events() ──kv_event_batch──▶ KvEventPublisher  (blocks stored / removed)
        kv_connector.usage()                     ──▶ WorkerMetricsPublisher (the router's load signal)

This module owns the aggregated worker: its options, importing Dynamo (an optional extra), the
model folder the frontend reads (config.json and the tokenizer files at the build's root), the
endpoint's handler, cancelling a request whose client left (`context.async_killed_or_stopped()`),
raising the engine's errors as Dynamo errors (InvalidArgument for a bad request, Unknown for an
engine failure, EngineShutdown when the engine thread has stopped) and the KV events and load it
publishes. The process (registration, serving, SIGTERM/SIGINT: in-flight requests finish, a
second signal ends them) is dynamo_serve.py; the wire format itself is dynamo_protocol.py.

`--mode prefill` / `--mode decode` workers split a request between two workers (Dynamo's
disaggregated serving): runtime/serving/dynamo_disagg.py, the KV hand-off through NIXL in
runtime/serving/kv_transfer.py.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from kvexport.errors import ConfigError, KvExportError

from ..config import EngineConfig
from ..engine import LLMEngine
from . import metrics
from ..core.block_hash import request_salt
from .cache_salts import SaltKey
from .dynamo_protocol import chunk, completion_usage, kv_event_batch, request_cache_salt, request_to_params
from .engine_thread import EngineThread, Event
from ..execution.structured import GrammarError
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
    # a file of salt keys (cache_salts.py): only salts a gateway signed with one are taken, and every request
    # needs one; None: $KVEXPORT_CACHE_SALT_KEY if set, else salts are taken as sent
    cache_salt_key: str | None = None
    # let Dynamo's direct ZMQ event plane bind its PUB sockets on every interface (dynamo_events.py); False:
    # the worker refuses to start on it unless $KVEXPORT_DYNAMO_PUBLIC_EVENT_PLANE is set (use a broker or NATS)
    public_event_plane: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.kv_transfer not in KV_TRANSFERS:
            raise ConfigError(f"kv_transfer must be one of {', '.join(KV_TRANSFERS)}, got {self.kv_transfer!r}")
        t = self.kv_transfer_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise ConfigError(f"kv_transfer_timeout_s must be seconds in (0, 3600], got {t!r}")
        if self.engine.lora_modules:  # NOTE: the frontend would route only the base model's name: adapters unused
            raise ConfigError("lora_modules: the Dynamo worker does not serve LoRA adapters yet (it registers the base "
                              "model only, so no request could reach one); serve adapters with `kvexport serve` or "
                              "`kvexport triton`, or merge one into a build with `kvexport build --lora`")
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

    def load_salt_key(self) -> SaltKey | None:
        """The salt key file (`cache_salt_key`, else $KVEXPORT_CACHE_SALT_KEY) loaded, or None: salts are
        then taken as sent. Raises SaltKeyError (a ConfigError) naming the file and line."""
        return SaltKey.load(self.cache_salt_key) if self.cache_salt_key else SaltKey.from_env()


def import_dynamo():
    """The `dynamo` package's modules this worker uses, or a ConfigError saying how to install it."""
    try:
        from dynamo import llm, runtime
        from dynamo.llm import exceptions
    except ImportError as e:
        raise ConfigError(f"`kvexport dynamo` needs NVIDIA Dynamo ({e}): {INSTALL_HINT}") from None
    return llm, runtime, exceptions


def check_model_files(build_dir: Path) -> None:
    """Refuse a build without the side files Dynamo's frontend reads at its root (config.json and the
    tokenizer files: exporter/interop.py). Cheap: called before the engine loads, too."""
    missing = [n for n in ("config.json", "tokenizer.json", "tokenizer_config.json") if not (build_dir / n).is_file()]
    if missing:
        raise ConfigError(f"{build_dir} lacks {', '.join(missing)} at its root (Dynamo's frontend reads them): "
                          "rebuild it with this kvexport (`kvexport build ... --force`)")


def model_folder(build_dir: Path, engine: LLMEngine) -> Path:
    """The folder Dynamo's frontend loads the model card from: the build's root, which holds
    config.json, generation_config.json and the tokenizer files (exporter/interop.py). Refuses
    builds without a tokenizer (the frontend tokenizes) or without those side files."""
    if engine.tokenizer is None:
        raise ConfigError(f"{build_dir} has no tokenizer: Dynamo's frontend tokenizes the prompts, so build "
                          "from a model that has one")
    check_model_files(build_dir)
    return build_dir


class _Refusal:
    """An async iterator whose first step fails with `exc` (refusal)."""

    def __init__(self, exc: BaseException, loop: asyncio.AbstractEventLoop):
        self.exc, self.loop = exc, loop

    def __aiter__(self) -> "_Refusal":
        return self

    def __anext__(self) -> asyncio.Future:
        fut = self.loop.create_future()
        fut.set_exception(self.exc)
        return fut


class _AfterCompile:
    """An async iterator that first compiles a request's output grammar in a thread (neither on the
    event loop nor on the engine thread: a large schema takes seconds; the engine then finds it
    cached), then streams `start()`. A spec that cannot be served fails the first step with
    `refuse(message)` set on a future, as `refusal` does: one log line, no traceback."""

    def __init__(self, compile_, start, refuse, loop: asyncio.AbstractEventLoop):
        self.compile, self.start, self.refuse, self.loop = compile_, start, refuse, loop
        self.inner: AsyncIterator[dict] | None = None
        self.task: asyncio.Task | None = None  # NOTE: held, so the loop does not drop it half-way

    def __aiter__(self) -> "_AfterCompile":
        return self

    def __anext__(self):
        if self.inner is not None:
            return self.inner.__anext__()
        fut = self.loop.create_future()
        self.task = self.loop.create_task(self._first(fut))
        return fut

    async def _first(self, fut: asyncio.Future) -> None:
        try:
            await asyncio.to_thread(self.compile)
        except GrammarError as e:
            if not fut.done():
                fut.set_exception(self.refuse(str(e)))
            return
        except BaseException as e:  # noqa: BLE001 - an internal error: the stream fails with it
            if not fut.done():
                fut.set_exception(e)
            return
        self.inner = self.start()
        try:
            item = await self.inner.__anext__()
        except BaseException as e:  # noqa: BLE001 - StopAsyncIteration and the stream's own errors
            if not fut.done():
                fut.set_exception(e)
            return
        if not fut.done():
            fut.set_result(item)


def refusal(exc: BaseException, loop: asyncio.AbstractEventLoop | None) -> AsyncIterator[dict]:
    """A handler's stream for a request the worker refuses: its first step fails with `exc`.
    NOTE: Dynamo's binding prints every exception a handler's stream raises, with its traceback
    (PyErr_Display), so a client sending bad requests would write a traceback per request into the
    log. `exc` is set on a future here, never raised in a Python frame, so it carries no traceback
    and the log gets its one line ("dynamo._core.InvalidArgument: <message>"); errors of the engine
    itself are still raised, traceback and all. Without a `loop` (no running one when the worker
    was made) it is raised from a generator, as before."""
    if loop is not None:
        return _Refusal(exc, loop)

    async def raising():
        raise exc
        yield  # never reached: makes this an async generator

    return raising()


class DynamoWorker:
    """One engine served on one Dynamo endpoint. `generate` is the endpoint's handler (asyncio);
    `tick` runs on the engine thread after every step and publishes the KV events and the load."""

    def __init__(self, engine: LLMEngine, exceptions, kv_publisher=None, metrics_publisher=None, *,
                 salt_key: SaltKey | None = None):
        self.engine = engine
        self.parser = RequestParser.for_engine(engine)
        self.errors = exceptions
        self.kv_publisher = kv_publisher
        self.metrics_publisher = metrics_publisher
        self.kv = engine.kv_connector  # blocks, events and load only through the engine's KV seam
        self.block_size = self.kv.block_size
        self.cancelled = 0  # requests whose client left (context stopped or killed)
        self.skipped_events = 0  # stored blocks the router was not told of (no tokens: kv_event_batch)
        self._last_used: int | None = None
        self._last_publish = 0.0
        if kv_publisher is not None:
            self.kv.record_events()  # the full group's: Dynamo's router keys one block table per worker
        self.salt_key = salt_key  # with one, only gateway-signed salts are taken (cache_salts.py)
        self.not_ready_reason: str | None = None  # why the worker says it is not ready (its deployment is wrong)
        self.set_health = None  # runtime.set_health_status (dynamo_serve.py): the system server's /health
        try:  # the loop the endpoint is served on (refusal's futures); None outside one (tests)
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self.thread = EngineThread(engine, on_tick=self.tick)

    # ---- engine thread --------------------------------------------------------------------
    def tick(self) -> None:
        if self.kv_publisher is not None:
            events = self.kv.pop_events()
            if events:
                batch, skipped = kv_event_batch(events, self.block_size)
                self.skipped_events += skipped
                if batch:
                    self.kv_publisher.publish_batch(batch)
        used, now = self.kv.usage().used_blocks, time.monotonic()
        if self.metrics_publisher is not None and (used != self._last_used or now - self._last_publish > METRICS_EVERY_S):
            self.metrics_publisher.publish(0, kv_used_blocks=used)
            self._last_used, self._last_publish = used, now

    def close(self) -> None:
        """Release what the worker holds beside the engine (disaggregated workers: their NIXL agent)."""

    def prometheus_text(self) -> str:
        """kvexport's metrics (metrics.py), for the Dynamo system server's /metrics (DYN_SYSTEM_PORT)."""
        return metrics.prometheus_text(self.thread.counters, self.cancelled)

    # ---- the endpoint -----------------------------------------------------------------------
    def request_salt(self, request: Any) -> str | None:
        """The request's prefix-cache salt: its one cache_salt by cache_salts.py's rule (with this
        worker's salt key: gateway-signed only), no tenant part (the frontend passes no API key;
        dynamo_protocol's NOTE). Every worker mode salts a request this way. Raises RequestError."""
        return request_salt(None, request_cache_salt(request, self.salt_key))

    def _decode(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id]) if self.engine.tokenizer is not None else f"token_id:{token_id}"

    def generate(self, request: Any, context) -> AsyncIterator[dict]:
        """The endpoint handler: a PreprocessedRequest in, response chunks out (streamed). A request the
        worker refuses (RequestError) fails at its first step with InvalidArgument, which the frontend
        answers with a 400 naming the field, and the log gets one line for it (`refusal`)."""
        try:
            prompt, params = request_to_params(request, self.parser)
            salt = self.request_salt(request)
        except RequestError as e:
            return refusal(self.errors.InvalidArgument(str(e)), self._loop)
        structured = getattr(params, "structured", None)
        if structured is not None and self._loop is not None:
            return _AfterCompile(lambda: self.engine.prep.compile(structured),
                                 lambda: self._generate(prompt, params, salt, context),
                                 self.errors.InvalidArgument, self._loop)
        return self._generate(prompt, params, salt, context)

    async def _generate(self, prompt: list[int], params, salt: str | None, context) -> AsyncIterator[dict]:
        E = self.errors
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
