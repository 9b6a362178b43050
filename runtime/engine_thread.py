"""One background thread that owns an `LLMEngine`, shared by the front ends that serve it
(`kvexport serve`'s HTTP server and the Triton Python-backend model).

    front end ──submit/abort (inbox: queue.Queue)──▶ engine thread ──deliver(Event)──▶ front end's sink

The engine is not thread-safe, so only this thread touches it: it takes new requests and
aborts from a thread-safe inbox, calls `engine.step()` while work exists, and hands each
changed output (a new object every step: safe to pass on) as an `Event` to the `deliver`
callable of the request that owns it (called on
the engine thread: it must be quick and must not block). `on_tick`, when given, runs on
the engine thread after every step and at least every `IDLE_WAIT_S` while idle, so a front
end can poll for cancelled requests or publish metrics without another thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable

from kvexport.errors import KvExportError

from .engine import LLMEngine
from .sampling import SamplingParams

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # longest the idle thread sleeps on its inbox before ticking again


@dataclass(slots=True)
class Event:
    """What one step added to one request, for the front end that owns it."""
    index: int  # choice index within the front end's request
    new_text: str
    new_token_ids: list[int]
    num_tokens: int
    finished: bool
    finish_reason: str | None
    error: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


Deliver = Callable[[Event], None]


@dataclass(slots=True)
class _Sink:
    deliver: Deliver
    index: int


@dataclass(slots=True)
class _Add:
    request_ids: list[str]  # one per sample; samples after the first share the first's prompt blocks
    prompt: list[int]
    params: SamplingParams
    sinks: list[_Sink]


@dataclass
class Counters:
    """Figures the front ends publish; written by the engine thread only."""
    running: int = 0
    waiting: int = 0
    kv: dict = field(default_factory=dict)
    generation_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    aborted: int = 0


class EngineThread:
    """Owns the engine; everything else talks to it through `submit` and `abort`."""

    def __init__(self, engine: LLMEngine, on_tick: Callable[[], None] | None = None):
        self.engine = engine
        self.counters = Counters(kv=engine.kv_stats())
        self._on_tick = on_tick
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvexport-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompt: list[int], params: SamplingParams, deliver: Deliver, first_index: int = 0,
               request_ids: list[str] | None = None) -> list[str]:
        """Queue `params.n` samples of one prompt; returns their engine request ids. Each
        sample's events go to `deliver` with index first_index + sample."""
        if request_ids is None:
            base = uuid.uuid4().hex
            request_ids = [f"{base}-{i}" for i in range(params.n)]
        assert len(request_ids) == params.n
        if not self._thread.is_alive() and self._thread.ident is not None:
            raise KvExportError("the engine thread has stopped (see the log); restart the server")
        self._inbox.put(_Add(list(request_ids), prompt, params,
                             [_Sink(deliver, first_index + i) for i in range(params.n)]))
        return list(request_ids)

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests and free their KV blocks; no further events are delivered."""
        self._inbox.put(("abort", list(request_ids)))

    # ---- engine thread ----------------------------------------------------------------
    def _push(self, rid: str, ev: Event) -> None:
        sink = self._sinks.get(rid)
        if sink is not None:
            self._push_to(sink, rid, ev)

    @staticmethod
    def _push_to(sink: _Sink, rid: str, ev: Event) -> None:
        try:
            sink.deliver(ev)
        except Exception:  # noqa: BLE001 - a broken sink must not stop the engine
            log.exception("delivering an event of request %s failed", rid)

    def _event(self, rid: str, o) -> Event:
        k = len(o.new_token_ids)
        return Event(self._sinks[rid].index, o.new_text, o.new_token_ids, len(o.token_ids), o.finished,
                     o.finish_reason, o.error,
                     o.logprobs[-k:] if o.logprobs is not None and k else None,
                     o.top_logprobs[-k:] if o.top_logprobs is not None and k else None)

    def _finish(self, rid: str) -> None:
        self.engine.pop_output(rid)
        self._sinks.pop(rid, None)

    def _handle(self, msg) -> None:
        eng = self.engine
        if isinstance(msg, _Add):
            for i, (rid, sink) in enumerate(zip(msg.request_ids, msg.sinks)):
                self._sinks[rid] = sink
                try:
                    eng.add_request(msg.prompt, msg.params, request_id=rid, sample_index=i,
                                    share_prompt_with=msg.request_ids[0] if i else None)
                except Exception as e:  # noqa: BLE001 - report it to the request, keep serving
                    self._push(rid, Event(sink.index, "", [], 0, True, "error", str(e)))
                    self._sinks.pop(rid, None)
                    continue
                self.counters.requests += 1
                self.counters.prompt_tokens += len(msg.prompt)
                o = eng.output(rid)
                if o.finished:  # refused at admission
                    self._push(rid, self._event(rid, o))
                    self._finish(rid)
        elif isinstance(msg, tuple) and msg[0] == "abort":
            for rid in msg[1]:
                if rid in self._sinks:
                    eng.abort(rid)
                    self.counters.aborted += 1
                    self._finish(rid)

    def _drain(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
            while True:
                if msg is not None:
                    try:
                        self._handle(msg)
                    except Exception:  # noqa: BLE001 - one bad message must not stop the engine
                        log.exception("engine thread: handling %r failed", type(msg).__name__)
                msg = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._drain(block=not eng.has_unfinished())
            if self._stop.is_set():
                break
            if eng.has_unfinished():
                try:
                    changed = eng.step()
                except Exception as e:  # noqa: BLE001 - fail the running requests, keep serving
                    log.exception("engine step failed")
                    for rid in list(self._sinks):
                        sink = self._sinks.pop(rid)
                        self._push_to(sink, rid, Event(sink.index, "", [], 0, True, "error", f"engine error: {e}"))
                        try:
                            eng.abort(rid)
                            eng.pop_output(rid)
                        except Exception:  # noqa: BLE001 - keep failing the others
                            log.exception("engine thread: cleaning up request %s failed", rid)
                    changed = []
                for o in changed:
                    self.counters.generation_tokens += len(o.new_token_ids)
                    if o.request_id in self._sinks:
                        self._push(o.request_id, self._event(o.request_id, o))
                        if o.finished:
                            self._finish(o.request_id)
            c = self.counters
            c.running, c.waiting, c.kv = len(eng.scheduler.running), len(eng.scheduler.waiting), eng.kv_stats()
            if self._on_tick is not None:
                try:
                    self._on_tick()
                except Exception:  # noqa: BLE001 - a broken hook must not stop the engine
                    log.exception("engine thread tick hook failed")
