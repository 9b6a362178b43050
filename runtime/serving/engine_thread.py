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

Fair admission: the samples of each front-end request (`group`: every prompt x n of one
HTTP request, or one Triton request) wait in a queue of their own here, and the thread
moves them into the engine one per group in turn, only while the engine holds fewer than
`max_num_seqs` sequences (running + waiting). So a request with thousands of samples never
sits in front of a small one: the small one takes the next free batch slot.

    submit(group A: 40 prompts x 64) ─┐   queues: A ■■■■■■■■■…   ──round robin──▶ engine (≤ max_num_seqs)
    submit(group B: 1 prompt)       ──┘           B ■

`stop()` ends the thread without waiting for a long step: after `STOP_WAIT_S` every open
request gets a final error event from the caller's thread, and the engine thread, when
its step returns, delivers nothing more.

`health()` is what a probe reports (`/health`): None while the thread runs and has passed
through its loop within `stall_s` (STALL_S; it does at least every IDLE_WAIT_S while idle,
after every step while busy), else why not (stopped, or one step running that long).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from kvexport.errors import KvExportError

from ..core.outputs import PromptLogprobs
from ..core.stats import SchedulerStats
from ..engine import LLMEngine
from ..sampling_params import SamplingParams

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # longest the idle thread sleeps on its inbox before ticking again
STOP_WAIT_S = 2.0  # longest stop() waits for a step in progress before failing the open requests
STALL_S = 60.0  # a step running longer than this makes health() report the engine stalled (seconds)


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
    prompt_logprobs: PromptLogprobs | None = None  # once the prompt is computed (SamplingParams.prompt_logprobs)
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache (tokens)


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
    group: str  # the front-end request these samples belong to (fair admission)
    salt: str | None = None  # the prefix-cache salt (core/block_hash.request_salt)


@dataclass(slots=True)
class _Queued:
    """One sample waiting in the thread for its turn to enter the engine."""
    prompt: list[int]
    params: SamplingParams
    sample_index: int  # within its prompt (seeds its RNG)
    leader: str | None  # the request id of sample 0 of the same prompt (prompt blocks shared)
    salt: str | None = None  # the prefix-cache salt (core/block_hash.request_salt)


@dataclass
class Counters:
    """Figures the front ends publish; written by the engine thread only."""
    running: int = 0  # sequences being computed (sequences)
    waiting: int = 0  # sequences waiting: in the engine's queue + queued here (sequences)
    stats: SchedulerStats = SchedulerStats()  # the engine's statistics after the last step (core/stats.py)
    generation_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    aborted: int = 0


class EngineThread:
    """Owns the engine; everything else talks to it through `submit` and `abort`."""

    def __init__(self, engine: LLMEngine, on_tick: Callable[[], None] | None = None):
        self.engine = engine
        self.counters = Counters(stats=engine.stats())
        self._on_tick = on_tick
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}  # every open request: queued here or in the engine
        self._queued: OrderedDict[str, OrderedDict[str, _Queued]] = OrderedDict()  # group -> rid -> sample
        self._group_of: dict[str, str] = {}  # rid -> its group, while it is queued here
        # NOTE: held by the engine thread while it touches the sinks (not while it steps), and
        # by stop() while it fails them, so no event can follow a request's final one
        self._lock = threading.RLock()
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvexport-engine", daemon=True)
        self.stall_s = STALL_S  # seconds (health())
        self._beat = time.monotonic()  # when the engine thread last passed through its loop

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = STOP_WAIT_S, reason: str = "the server is shutting down") -> None:
        """Stop the thread and end every open request with an error event (`reason`). Waits
        up to `timeout` s for a step in progress, not for it to end: a step still running
        then finishes in the background and delivers nothing."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread.ident is not None:
            self._thread.join(timeout)
        # NOTE: not forever: a sink stuck in deliver() (a front end tearing down) holds the lock
        locked = self._lock.acquire(timeout=timeout)
        if not locked:
            log.warning("the engine thread is stuck delivering an event; failing the open requests anyway")
        try:
            self._closed = True
            left = list(self._sinks.items())
            self._sinks.clear()
            self._queued.clear()
            self._group_of.clear()
            while True:  # submitted, never handled
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(msg, _Add):
                    left += list(zip(msg.request_ids, msg.sinks))
        finally:
            if locked:
                self._lock.release()
        for rid, sink in left:
            self._push_to(sink, rid, Event(sink.index, "", [], 0, True, "error", reason))
        close = getattr(self.engine, "close", None)
        if close is not None and not self._thread.is_alive():  # NOTE: only once nothing steps the engine
            try:
                close()  # the pool's prefix-cache blocks to the disk tier (kv_offload_dir): a restart finds them
            except Exception:  # noqa: BLE001 - stopping must finish
                log.exception("writing the KV cache to the disk tier at shutdown failed")

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def health(self) -> str | None:
        """None while the engine thread serves; else why not: it stopped, or it has been inside
        one step for more than `stall_s` seconds (a stuck backend or I/O: a probe should fail)."""
        if not self._thread.is_alive():
            return "engine thread stopped"
        stuck = time.monotonic() - self._beat
        return f"engine stalled: no step has finished for {stuck:.0f} s" if stuck > self.stall_s else None

    def submit(self, prompt: list[int], params: SamplingParams, deliver: Deliver, first_index: int = 0,
               request_ids: list[str] | None = None, group: str | None = None,
               salt: str | None = None) -> list[str]:
        """Queue `params.n` samples of one prompt; returns their engine request ids. Each
        sample's events go to `deliver` with index first_index + sample. `group` names the
        front-end request they belong to (all its prompts pass the same one); groups enter
        the engine in turn. Default: a group of their own. `salt`: the prefix-cache salt
        (core/block_hash.request_salt; the tenant's and the request's cache_salt)."""
        if request_ids is None:
            base = uuid.uuid4().hex
            request_ids = [f"{base}-{i}" for i in range(params.n)]
        assert len(request_ids) == params.n
        with self._lock:
            if self._closed or (not self._thread.is_alive() and self._thread.ident is not None):
                raise KvExportError("the engine thread has stopped (see the log); restart the server")
            self._inbox.put(_Add(list(request_ids), prompt, params,
                                 [_Sink(deliver, first_index + i) for i in range(params.n)],
                                 group or request_ids[0], salt))
        return list(request_ids)

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests and free their KV blocks; no further events are delivered."""
        self._inbox.put(("abort", list(request_ids)))

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread between two steps, in order with `submit` and `abort`
        (a `call` before a `submit` runs before that request reaches the engine). It must be
        quick; an exception it raises is logged. (Disaggregated serving copies KV blocks into
        the pool this way: runtime/serving/dynamo_disagg.py.)"""
        self._inbox.put(("call", fn))

    async def run(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """fn() run on the engine thread between two steps (`call`), awaited on the caller's event loop: its
        result, or the exception it raised; asyncio.TimeoutError after `timeout_s`."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(result, error) -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result)

        def job() -> None:
            try:
                r = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                loop.call_soon_threadsafe(settle, None, e)
            else:
                loop.call_soon_threadsafe(settle, r, None)

        self.call(job)
        return await asyncio.wait_for(fut, timeout_s)

    # ---- engine thread ----------------------------------------------------------------
    def _update_counters(self) -> None:
        c, eng = self.counters, self.engine
        c.stats = st = eng.stats()
        c.running = st.num_running
        c.waiting = st.num_waiting + len(self._group_of)  # in the engine + queued here

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
                     o.top_logprobs[-k:] if o.top_logprobs is not None and k else None, o.prompt_logprobs,
                     o.num_cached_prompt_tokens)

    def _finish(self, rid: str) -> None:
        self._sinks.pop(rid, None)
        self.engine.pop_output(rid)

    def _handle(self, msg) -> None:
        if isinstance(msg, _Add):
            queue_ = self._queued.setdefault(msg.group, OrderedDict())
            for i, (rid, sink) in enumerate(zip(msg.request_ids, msg.sinks)):
                self._sinks[rid] = sink
                queue_[rid] = _Queued(msg.prompt, msg.params, i, msg.request_ids[0] if i else None, msg.salt)
                self._group_of[rid] = msg.group
        elif isinstance(msg, tuple) and msg[0] == "call":
            msg[1]()
        elif isinstance(msg, tuple) and msg[0] == "abort":
            for rid in msg[1]:
                if rid not in self._sinks:
                    continue
                self.counters.aborted += 1
                group = self._group_of.pop(rid, None)
                if group is None:  # in the engine
                    self.engine.abort(rid)
                    self._finish(rid)
                    continue
                self._sinks.pop(rid)  # still queued here: the engine never saw it
                queue_ = self._queued[group]
                del queue_[rid]
                if not queue_:
                    del self._queued[group]

    def _feed(self) -> None:
        """Move queued samples into the engine, one per group in turn, while the engine holds
        fewer than max_num_seqs sequences (running + waiting)."""
        while self._queued and self.engine.free_seq_slots() > 0:
            group, queue_ = next(iter(self._queued.items()))
            rid, q = queue_.popitem(last=False)
            if queue_:
                self._queued.move_to_end(group)  # round robin: the next group's turn
            else:
                del self._queued[group]
            del self._group_of[rid]
            self._admit(rid, q)

    def _admit(self, rid: str, q: _Queued) -> None:
        eng, sink = self.engine, self._sinks[rid]
        try:
            eng.add_request(q.prompt, q.params, request_id=rid, sample_index=q.sample_index,
                            share_prompt_with=q.leader, salt=q.salt)
        except Exception as e:  # noqa: BLE001 - report it to the request, keep serving
            self._push(rid, Event(sink.index, "", [], 0, True, "error", str(e)))
            self._sinks.pop(rid, None)
            return
        self.counters.requests += 1
        self.counters.prompt_tokens += len(q.prompt)
        o = eng.output(rid)
        if o.finished:  # refused at admission
            ev = self._event(rid, o)
            self._finish(rid)
            self._update_counters()
            self._push_to(sink, rid, ev)

    def _drain(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
            while True:
                if msg is not None:
                    with self._lock:
                        if self._closed:
                            return
                        try:
                            self._handle(msg)
                        except Exception:  # noqa: BLE001 - one bad message must not stop the engine
                            log.exception("engine thread: handling %r failed", type(msg).__name__)
                msg = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _fail_running(self, error: str) -> list[tuple[str, _Sink, Event]]:
        """A step failed: fail every request in the engine (not those still queued here); their
        KV blocks are freed. Returns the error events to deliver."""
        eng, events = self.engine, []
        for rid in [r for r in self._sinks if r not in self._group_of]:
            sink = self._sinks.pop(rid)
            events.append((rid, sink, Event(sink.index, "", [], 0, True, "error", error)))
            try:
                eng.abort(rid)
                eng.pop_output(rid)
            except Exception:  # noqa: BLE001 - keep failing the others
                log.exception("engine thread: cleaning up request %s failed", rid)
        return events

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._beat = time.monotonic()
            self._drain(block=not (eng.has_unfinished() or self._queued))
            with self._lock:
                if self._stop.is_set() or self._closed:
                    break
                self._feed()
            if eng.has_unfinished():
                try:
                    changed, error = eng.step(), None
                except Exception as e:  # noqa: BLE001 - fail the running requests, keep serving
                    log.exception("engine step failed")
                    changed, error = [], f"engine error: {e}"
                with self._lock:
                    if self._closed:  # stop() gave up waiting for this step and failed its requests
                        break
                    events = self._fail_running(error) if error is not None else []
                    for o in changed:
                        self.counters.generation_tokens += len(o.new_token_ids)
                        if o.request_id in self._sinks:
                            events.append((o.request_id, self._sinks[o.request_id], self._event(o.request_id, o)))
                            if o.finished:
                                try:
                                    self._finish(o.request_id)
                                except Exception:  # noqa: BLE001 - keep delivering the others
                                    log.exception("engine thread: finishing request %s failed", o.request_id)
                    # finished requests' blocks are free and counted before their clients hear
                    self._update_counters()
                    for rid, sink, ev in events:
                        self._push_to(sink, rid, ev)
            else:
                self._update_counters()  # no step: what _feed queued or admitted
            if self._stop.is_set():
                break
            if self._on_tick is not None:
                try:
                    self._on_tick()
                except Exception:  # noqa: BLE001 - a broken hook must not stop the engine
                    log.exception("engine thread tick hook failed")
