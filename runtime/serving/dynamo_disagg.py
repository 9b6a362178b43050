"""Disaggregated prefill and decode for `kvexport dynamo --mode prefill|decode` (issue 26 §3), in
Dynamo 1.6.1's protocol (the one its vLLM backend speaks): the frontend's prefill router sends a
request to a prefill worker first, takes the `disaggregated_params` of its response, and sends
the request on to a decode worker with them in `prefill_result`.

    frontend ──request (max_tokens 1)──▶ PrefillWorker.generate
                                           engine: the prompt's prefill, the first token
                                           on the engine thread, as the request finishes: the
                                           prompt's full blocks copied out of the pool (both
                                           KV cache groups; codes and scales as the pool holds
                                           them) into one buffer, registered with NIXL
             ◀──{token_ids, disaggregated_params: {kv_transfer_params: {"kvexport": offer}}}
    frontend ──request + prefill_result──▶ DecodeWorker.generate
                                           the blocks it lacks (pool and KV tiers) READ over NIXL
                                           engine thread: fresh pool blocks, written, published
                                           under their prefix-cache keys and held until the
                                           request is admitted
                                           the request runs as usual: its prefix is a cache hit,
                                           so only the prompt's tail (< one block) is computed
             ◀──tokens, streamed (the first one too)

The decode side recomputes the prompt's tail as vLLM's NIXL connector does (the prefill
worker's first token is the frontend's to drop): the tokens are the ones an aggregated worker
with a prefix-cache hit computes, so greedy output is aggregated serving's. Only full blocks
move (a prefix-cache key names a full block); a prompt of L tokens moves (L - 1) // block_size
blocks per group (the local group: only those the window of the next token reaches).

Every block moves through the engine's KV connector (runtime/kv_connector.py: `prompt_blocks`,
`export_blocks` on the prefill side; `held`, `import_blocks`, `release` on the decode side); this
module never touches the pools. A block's bytes are the connector's payload (every pool tensor
of its group sliced at the block: K/V codes, and int4's in-row scales; int8's scales are the
build's, so the build identity guards them), and the two workers must serve the same build: the
offer carries the connector's `identity`, checked before anything is read. The bytes move
through NIXL (kv_transfer.py), or inline in the response (`kv_transfer="request-plane"`, for
machines without NIXL: base64 in the JSON the frontend relays).

NOTE: the prefill side copies the blocks while the pool is still as the finishing step left
it: `deliver` runs on the engine thread right after the step, before any allocation (so the
request's freed blocks are intact), and the copy holds the bytes until the decode side read
them or `kv_transfer_timeout_s` passed. The decode side's writes run on the engine thread
between steps (`EngineThread.call`), after saving any block the allocation evicted to a KV
tier (the tier ops run first, as the step's would).
"""

from __future__ import annotations

import asyncio
import base64
import gc
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.block_hash import BlockHash
from ..engine import LLMEngine
from ..kv_connector import BlockImport, BlockRef, KVConnector
from .dynamo_protocol import chunk, completion_usage, request_to_params
from .dynamo_worker import DynamoWorker, refusal
from .engine_thread import Event
from .requests import RequestError

log = logging.getLogger(__name__)

TRANSPORTS = ("nixl", "request-plane")  # --kv-transfer
PARAMS_KEY = "kvexport"  # our entry in kv_transfer_params (vLLM's connectors put theirs beside it)
FORMAT = 1  # the offer's format version
ENGINE_CALL_TIMEOUT_S = 300.0  # longest a copy waits for the engine thread (a long step ahead of it)

Key = BlockRef  # (KV cache group, block index in the prompt, prefix-cache key)


def offer_blocks(kv: KVConnector, keys: Sequence[BlockRef]) -> tuple[list[list], np.ndarray]:
    """The keys' blocks the engine holds -> ([[group, index, key hex, offset], ...], payload): the
    offer's entries (offsets into the payload) and the bytes (engine thread, before any allocation)."""
    refs, payload = kv.export_blocks(keys)
    entries, at = [], 0
    for g, i, h in refs:
        entries.append([g, i, h.hex(), at])
        at += kv.block_bytes[g]
    return entries, payload


async def on_engine(worker: DynamoWorker, fn):
    """fn() run on the engine thread (between steps); its result here."""
    return await worker.thread.run(fn, ENGINE_CALL_TIMEOUT_S)


@dataclass
class DisaggStats:
    """Figures of the hand-off since start (the worker's /metrics)."""

    offered: int = 0  # prefill: requests whose blocks were offered
    offered_blocks: int = 0
    pulled: int = 0  # decode: requests that received blocks
    pulled_blocks: int = 0  # blocks read from a prefill worker
    reused_blocks: int = 0  # blocks the decode worker already held (not read)
    pull_seconds: float = 0.0  # time spent reading
    recomputed: int = 0  # decode: requests that came without usable KV (computed here)
    mismatched: int = 0  # decode: offers of another build or transport (computed here; `misconfigured`)


class _DisaggWorker(DynamoWorker):
    def __init__(self, engine: LLMEngine, exceptions, kv_publisher=None, metrics_publisher=None, *,
                 transport: str = "nixl", timeout_s: float = 60.0, role: str = "prefill"):
        super().__init__(engine, exceptions, kv_publisher, metrics_publisher)
        # self.kv: the engine's KV connector (DynamoWorker); its calls run on the engine thread
        self.identity = self.kv.identity  # what this engine's block bytes mean (the offer's guard)
        self.block_bytes = self.kv.block_bytes  # group -> bytes of one block
        self.transport = transport
        self.role = role
        self.stats = DisaggStats()
        self.nixl = None
        if transport == "nixl":
            from .kv_transfer import NixlTransfer

            self.nixl = NixlTransfer(role, timeout_s)

    def close(self) -> None:
        if self.nixl is not None:
            self.nixl.close()
            self.nixl = None
            gc.collect()  # NOTE: the agent's own teardown now, not at the interpreter's exit (kv_transfer.close)

    def prometheus_text(self) -> str:
        s = self.stats
        lines = [super().prometheus_text().rstrip("\n")]
        for name, value in (("kvexport_disagg_offered_total", s.offered),
                            ("kvexport_disagg_offered_blocks_total", s.offered_blocks),
                            ("kvexport_disagg_pulled_total", s.pulled),
                            ("kvexport_disagg_pulled_blocks_total", s.pulled_blocks),
                            ("kvexport_disagg_reused_blocks_total", s.reused_blocks),
                            ("kvexport_disagg_pull_seconds_total", s.pull_seconds),
                            ("kvexport_disagg_recomputed_total", s.recomputed),
                            ("kvexport_disagg_mismatched_total", s.mismatched),
                            ("kvexport_disagg_misconfigured", int(self.not_ready_reason is not None)),
                            ("kvexport_disagg_rooms_open", self.nixl.rooms if self.nixl else 0),
                            ("kvexport_disagg_rooms_expired_total", self.nixl.expired if self.nixl else 0)):
            kind = "counter" if name.endswith("_total") else "gauge"
            lines.append(f"# TYPE {name} {kind}\n{name} {value}")
        return "\n".join(lines) + "\n"

    def misconfigured(self, reason: str) -> None:
        """The deployment is wrong (its two sides disagree), not the request: say so once in the
        log at ERROR, and from then on report not ready (the system server's /health, which a
        supervisor's readiness probe reads; kvexport_disagg_misconfigured 1 on /metrics)."""
        if self.not_ready_reason is None:
            self.not_ready_reason = reason
            log.error("disaggregated %s worker misconfigured, reporting not ready: %s", self.role, reason)
            if self.set_health is not None:
                self.set_health(False)

    def _abort_when_stopped(self, stopped: asyncio.Future, rids: list[str], state: dict, then=None) -> None:
        """Abort the request as soon as its context stops (the client left), even if Dynamo never
        resumes the handler (as DynamoWorker.generate does: a kill during a send ends the stream
        without closing the generator). `state["finished"]` says it ended already."""
        def cb(fut: asyncio.Future) -> None:
            if fut.cancelled() or state["finished"] or state["aborted"]:
                return
            state["aborted"] = True
            self.cancelled += 1
            self.thread.abort(rids)
            if then is not None:
                then()

        stopped.add_done_callback(cb)

    def _parse(self, request: Any, prefill: bool):
        """(prompt, params, salt) of a request; raises RequestError (`generate` refuses it)."""
        if prefill and isinstance(request, dict):
            # the prompt and the first token only (Dynamo's prefill router asks for max_tokens 1 too)
            stop = dict(request.get("stop_conditions") or {})
            stop.update(max_tokens=1)
            stop.pop("min_tokens", None)
            request = {**request, "stop_conditions": stop}
        prompt, params = request_to_params(request, self.parser)
        # salted as DynamoWorker.generate salts it (cache_salts.py's rule): both sides must key the
        # prompt's blocks alike
        return prompt, params, self.request_salt(request)


class PrefillWorker(_DisaggWorker):
    """`--mode prefill`: the prompt's prefill and first token; the blocks offered to a decode worker."""

    def __init__(self, *a, **kw):
        super().__init__(*a, role="prefill", **kw)
        self._poller: asyncio.Task | None = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(0.02 if self.nixl.rooms else 0.25)
            self.nixl.poll()

    def generate(self, request: Any, context):
        """The endpoint handler. A request the worker refuses fails at its first step with
        InvalidArgument (a 400), one line in the log (dynamo_worker.refusal). NOTE: Dynamo calls it
        on a thread of its own, not the event loop's: only the parse happens here."""
        try:
            prompt, params, salt = self._parse(request, prefill=True)
        except RequestError as e:
            return refusal(self.errors.InvalidArgument(str(e)), self._loop)
        return self._prefill(prompt, params, salt, context)

    async def _prefill(self, prompt: list[int], params, salt: str | None, context):
        E = self.errors
        if self.nixl is not None and self._poller is None:
            self._poller = asyncio.ensure_future(self._poll())
        keys = self.kv.prompt_blocks(prompt, salt)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(ev: Event) -> None:  # engine thread
            staged = None
            if ev.finished and ev.error is None:
                staged = offer_blocks(self.kv, keys)  # NOTE: before any allocation: the module's NOTE
            loop.call_soon_threadsafe(events.put_nowait, (ev, staged))

        try:
            rids = self.thread.submit(prompt, params, deliver, salt=salt)
        except Exception as e:  # noqa: BLE001 - the engine thread has stopped
            raise E.EngineShutdown(str(e)) from None
        stopped = asyncio.ensure_future(context.async_killed_or_stopped())
        state = {"finished": False, "aborted": False}
        self._abort_when_stopped(stopped, rids, state)
        try:
            while True:
                get = asyncio.ensure_future(events.get())
                await asyncio.wait((get, stopped), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # the callback aborted it
                    get.cancel()
                    return
                ev, staged = get.result()
                if ev.error is not None:
                    state["finished"] = True
                    raise E.Unknown(f"kvexport engine: {ev.error}")
                if not ev.finished:
                    continue
                state["finished"] = True
                entries, payload = staged
                offer = {"format": FORMAT, "identity": self.identity, "block_size": self.block_size,
                         "num_prompt_tokens": len(prompt), "blocks": entries}
                room = uuid.uuid4().hex
                if self.nixl is not None:
                    offer["nixl"] = self.nixl.offer(room, payload)
                else:
                    # NOTE: off the event loop: a prompt's blocks are megabytes
                    offer["inline"] = await asyncio.to_thread(lambda: base64.b64encode(payload.tobytes()).decode("ascii"))
                self.stats.offered += 1
                self.stats.offered_blocks += len(entries)
                usage = completion_usage(len(prompt), ev.num_tokens, ev.num_cached_prompt_tokens)
                yield {"token_ids": list(ev.new_token_ids),
                       "disaggregated_params": {"kv_transfer_params": {PARAMS_KEY: offer}},
                       "completion_usage": usage}
                return
        finally:
            if not state["finished"]:
                self.thread.abort(rids)
            if not stopped.done():
                stopped.cancel()


class DecodeWorker(_DisaggWorker):
    """`--mode decode`: pulls the prompt's blocks a prefill worker offered, then generates."""

    def __init__(self, *a, **kw):
        super().__init__(*a, role="decode", **kw)

    def _offer(self, request: Any) -> tuple[dict | None, dict | None]:
        pr = request.get("prefill_result") if isinstance(request, dict) else None
        if not isinstance(pr, dict):
            return None, None
        params = (pr.get("disaggregated_params") or {}).get("kv_transfer_params") or {}
        offer = params.get(PARAMS_KEY) if isinstance(params, dict) else None
        return (offer if isinstance(offer, dict) else None), pr.get("prompt_tokens_details")

    def mismatch(self, offer: dict) -> str | None:
        """Why this worker cannot take `offer` (the two workers are deployed inconsistently), or None."""
        if offer.get("format") != FORMAT or offer.get("identity") != self.identity \
                or offer.get("block_size") != self.block_size:
            return ("the prefill worker serves another build (its KV blocks would not mean the same here): run "
                    "`kvexport dynamo --mode prefill` and `--mode decode` on the same build directory and the "
                    "same kvexport")
        if "nixl" in offer and self.nixl is None:
            return ("the prefill worker offers its KV over NIXL but this decode worker runs --kv-transfer "
                    "request-plane: start both with the same --kv-transfer")
        return None

    async def _receive(self, offer: dict, prompt: list[int], salt: str | None) -> list:
        """Pull the offered blocks this engine lacks and write them into its pool; returns the
        holds to release once the request is admitted ([] when nothing was written). The offer
        passed `mismatch`."""
        want = wanted(self.kv.prompt_blocks(prompt, salt), offer.get("blocks") or ())
        held = await on_engine(self, lambda: self.kv.held([(g, h) for g, _, h, _ in want]))
        missing = [w for w in want if (w[0], w[2]) not in held]
        self.stats.reused_blocks += len(want) - len(missing)
        ranges = [(off, self.block_bytes[g]) for g, _, _, off in missing]
        t0 = asyncio.get_running_loop().time()
        if "nixl" in offer:
            data = await asyncio.to_thread(self.nixl.pull, offer["nixl"], _merge(ranges))
        else:
            data = await asyncio.to_thread(_inline_ranges, offer.get("inline") or "", ranges)  # off the loop
        self.stats.pull_seconds += asyncio.get_running_loop().time() - t0
        if not missing:
            return []
        blocks = to_load(missing, want, prompt, self.block_size, self.block_bytes)
        holds = await on_engine(self, lambda: self.kv.import_blocks(blocks, data))
        self.stats.pulled += 1
        self.stats.pulled_blocks += sum(len(ids) for _, ids in holds)
        return holds

    def generate(self, request: Any, context):
        """The endpoint handler. A request the worker refuses fails at its first step with
        InvalidArgument (a 400), one line in the log (dynamo_worker.refusal). An offer this worker
        cannot take because the deployment is wrong (`mismatch`: another build, another transport)
        is no client's fault: the prompt is computed here, the request served, and the worker says
        once that it is misconfigured and from then on not ready (`misconfigured`). NOTE: Dynamo
        calls it on a thread of its own, not the event loop's: only the parse happens here."""
        try:
            prompt, params, salt = self._parse(request, prefill=False)
        except RequestError as e:
            return refusal(self.errors.InvalidArgument(str(e)), self._loop)
        offer, details = self._offer(request)
        return self._decode_stream(prompt, params, salt, offer, details, context)

    async def _decode_stream(self, prompt: list[int], params, salt: str | None, offer: dict | None,
                             details: dict | None, context):
        E = self.errors
        holds: list = []
        why = self.mismatch(offer) if offer is not None else None
        if why is not None:
            self.misconfigured(why)
            self.stats.mismatched += 1
            offer = None
        if offer is not None:
            try:
                holds = await self._receive(offer, prompt, salt)
            except Exception as e:  # noqa: BLE001 - a failed pull is recomputed, not failed
                log.warning("disaggregated decode: the KV hand-off failed (%s); computing the prompt here", e)
                self.stats.recomputed += 1
        else:
            self.stats.recomputed += 1
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(ev: Event) -> None:  # engine thread: the request is admitted (holds its own refs)
            if holds:
                self.kv.release(holds)
            loop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            rids = self.thread.submit(prompt, params, deliver, salt=salt)
        except Exception as e:  # noqa: BLE001 - the engine thread has stopped
            if holds:
                self.thread.call(lambda: self.kv.release(holds))
            raise E.EngineShutdown(str(e)) from None
        stopped = asyncio.ensure_future(context.async_killed_or_stopped())
        state = {"finished": False, "aborted": False}
        self._abort_when_stopped(stopped, rids, state, then=lambda: self.thread.call(lambda: self.kv.release(holds)))
        try:
            while True:
                get = asyncio.ensure_future(events.get())
                await asyncio.wait((get, stopped), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # the callback aborted it (and released the held blocks)
                    get.cancel()
                    return
                ev = get.result()
                state["finished"] = ev.finished
                if ev.error is not None:
                    raise E.Unknown(f"kvexport engine: {ev.error}")
                out = chunk(ev, self._decode if params.logprobs else None)
                if ev.finished:
                    cached = (details or {}).get("cached_tokens") if isinstance(details, dict) else None
                    out["completion_usage"] = completion_usage(
                        len(prompt), ev.num_tokens, ev.num_cached_prompt_tokens if cached is None else int(cached))
                    yield out
                    return
                yield out
        finally:
            if not state["finished"]:
                self.thread.abort(rids)
                if holds:  # never admitted: nothing else frees them (release is idempotent)
                    self.thread.call(lambda: self.kv.release(holds))
            if not stopped.done():
                stopped.cancel()


def wanted(keys: Sequence[Key], offered: Sequence[Sequence]) -> list[tuple[str, int, BlockHash, int]]:
    """The decode side's `KVConnector.prompt_blocks` that the offer carries under the same key (a
    salt or a build that differs gives other keys: those blocks are not taken): (group, index,
    key, offset)."""
    by_place = {(g, int(i)): (h, int(off)) for g, i, h, off in offered}
    out = []
    for g, i, h in keys:
        o = by_place.get((g, i))
        if o is not None and o[0] == h.hex():
            out.append((g, i, h, o[1]))
    return out


def to_load(missing, want, prompt: Sequence[int], block_size: int, block_bytes: dict[str, int]) -> list[BlockImport]:
    """`KVConnector.import_blocks`' list for the pulled blocks `missing` (their bytes back to back
    in the order given): group, key, parent key, offset in the pulled bytes, the block's tokens."""
    hashes = {i: h for _, i, h, _ in want}
    out, at = [], 0
    for g, i, h, _ in missing:
        out.append(BlockImport(g, h, hashes.get(i - 1) if i else None, at,
                               list(prompt[i * block_size:(i + 1) * block_size])))
        at += block_bytes[g]
    return out


def _inline_ranges(inline: str, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """The byte ranges wanted out of a request-plane offer's base64 payload, concatenated in order; ValueError
    for a range the payload does not hold (NOTE: a negative offset would slice from the end: other bytes)."""
    raw = np.frombuffer(base64.b64decode(inline), np.uint8)
    for o, n in ranges:
        if not 0 <= o <= raw.size - n:
            raise ValueError(f"the offer's block at offset {o} ({n} bytes) lies outside its {raw.size}-byte payload")
    return np.concatenate([raw[o:o + n] for o, n in ranges]) if ranges else np.empty(0, np.uint8)


def _merge(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent byte ranges joined (one NIXL descriptor each run), order kept."""
    out: list[list[int]] = []
    for off, n in ranges:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += n
        else:
            out.append([off, n])
    return [(o, n) for o, n in out]
