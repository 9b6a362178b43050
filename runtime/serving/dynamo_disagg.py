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

A block's bytes are execution/kv_offload.py's payload (every pool tensor of its group sliced at
the block: K/V codes, and int4's in-row scales; int8's scales are the build's, so the build
identity guards them), and the two workers must serve the same build: the offer carries
`build_identity`, checked before anything is read. The bytes move through NIXL
(kv_transfer.py), or inline in the response (`kv_transfer="request-plane"`, for machines
without NIXL: base64 in the JSON the frontend relays).

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

from kvexport import io

from ..core.block_hash import BlockHash, hash_full_blocks, request_salt
from ..core.hybrid_kv_cache_manager import HybridKVCacheManager
from ..engine import LLMEngine
from ..execution.kv_offload import KVOffload
from .dynamo_protocol import chunk, completion_usage, request_cache_salt, request_to_params
from .dynamo_worker import DynamoWorker
from .engine_thread import Event
from .requests import RequestError

log = logging.getLogger(__name__)

TRANSPORTS = ("nixl", "request-plane")  # --kv-transfer
PARAMS_KEY = "kvexport"  # our entry in kv_transfer_params (vLLM's connectors put theirs beside it)
FORMAT = 1  # the offer's format version
ENGINE_CALL_TIMEOUT_S = 300.0  # longest a copy waits for the engine thread (a long step ahead of it)

Key = tuple[str, int, BlockHash]  # (KV cache group, block index in the prompt, prefix-cache key)


def prompt_keys(engine: LLMEngine, prompt: Sequence[int], salt: str | None) -> list[Key]:
    """The blocks a decode worker's prefix lookup can use for `prompt`: the full group's first
    (L - 1) // block_size blocks, and for a hybrid build the local group's blocks of those that
    the next token's window reaches (core/hybrid_kv_cache_manager.py)."""
    bs = engine.pool.block_size
    n = max(len(prompt) - 1, 0) // bs
    hashes = hash_full_blocks(prompt[:n * bs], bs, salt)
    keys = [(io.FULL_GROUP, i, hashes[i]) for i in range(n)]
    if isinstance(engine.kv, HybridKVCacheManager):
        keys += [(io.LOCAL_GROUP, i, hashes[i]) for i in range(engine.kv.first_needed_block(n * bs), n)]
    return keys


class PoolBlocks:
    """Copies whole blocks between an engine's pools and byte buffers (engine thread only)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        offload = engine.runner.offload or KVOffload(engine.backend, engine.manifest)
        self.copier = offload.copier
        self.block_bytes = dict(offload.block_bytes)  # group -> payload bytes of one block
        self.identity = offload.identity.hex()
        self.pools = {io.FULL_GROUP: engine.pool}
        if isinstance(engine.kv, HybridKVCacheManager):
            self.pools[io.LOCAL_GROUP] = engine.kv.local_pool

    def export(self, keys: Sequence[Key]) -> tuple[list[list], np.ndarray]:
        """The keys' blocks the pool holds -> ([[group, index, key hex, offset], ...], payload).
        The full group stops at its first missing block (the prefix ends there)."""
        entries, parts, at = [], [], 0
        stopped = set()
        for g, i, h in keys:
            b = None if g in stopped else self.pools[g].get_cached_block(h)
            if b is None:
                if g == io.FULL_GROUP:
                    stopped.add(g)
                continue
            part = self.copier.read(g, b)
            entries.append([g, i, h.hex(), at])
            parts.append(part)
            at += part.nbytes
        self.copier.synchronize()
        payload = np.concatenate(parts) if parts else np.empty(0, np.uint8)
        return entries, payload

    def held(self, keys: Sequence[tuple[str, BlockHash]]) -> set[tuple[str, BlockHash]]:
        """The keys this engine already holds, in its pool or a KV tier below it."""
        tiers = self.engine.tiers
        return {(g, h) for g, h in keys if self.pools[g].get_cached_block(h) is not None
                or (tiers is not None and tiers.where((g, h)) is not None)}

    def load(self, blocks: Sequence[tuple[str, BlockHash, int | None, int | None, list[int]]],
             payload: np.ndarray) -> list[tuple[str, list[int]]]:
        """Write pulled blocks into fresh pool blocks and publish them under their keys, each
        held (one reference) until `release`. `blocks`: (group, key, parent key, offset in
        payload, the block's tokens). Blocks whose key the pool got meanwhile are skipped; a
        group whose pool has too few free blocks is skipped whole (its prefix is recomputed)."""
        eng, out = self.engine, []
        for g, pool in self.pools.items():
            todo = [b for b in blocks if b[0] == g and pool.get_cached_block(b[1]) is None]
            if not todo:
                continue
            ids = pool.get_new_blocks(len(todo)) if len(todo) <= pool.num_free_blocks else None
            if ids is None:
                log.warning("disaggregated decode: %d %s blocks do not fit the pool now; recomputing them",
                            len(todo), g)
                continue
            if eng.tiers is not None:  # NOTE: a reused block's old KV goes to its tier before the write
                for block_id, block_hash in pool.pop_evicted():
                    eng.tiers.offer(g, block_id, block_hash)
                eng.runner.offload.run(eng.tiers.take_ops())
            size = self.block_bytes[g]
            for block_id, (_, _, _, off, _) in zip(ids, todo):
                self.copier.write(g, block_id, payload[off:off + size])
            self.copier.synchronize()
            pool.cache_full_blocks(ids, [b[1] for b in todo], parent_hashes=[b[2] for b in todo],
                                   block_tokens=[b[4] for b in todo])
            out.append((g, ids))
        return out

    def release(self, holds: list[tuple[str, list[int]]]) -> None:
        for g, ids in holds:
            self.pools[g].free_blocks(ids)
        holds.clear()


async def on_engine(worker: DynamoWorker, fn):
    """fn() run on the engine thread (between steps); its result here."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def run() -> None:
        try:
            r = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting handler
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, r, None)

    worker.thread.call(run)
    return await asyncio.wait_for(fut, ENGINE_CALL_TIMEOUT_S)


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


class _DisaggWorker(DynamoWorker):
    def __init__(self, engine: LLMEngine, exceptions, kv_publisher=None, metrics_publisher=None, *,
                 transport: str = "nixl", timeout_s: float = 60.0, role: str = "prefill"):
        super().__init__(engine, exceptions, kv_publisher, metrics_publisher)
        self.blocks = PoolBlocks(engine)
        self.transport = transport
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
                            ("kvexport_disagg_rooms_open", self.nixl.rooms if self.nixl else 0),
                            ("kvexport_disagg_rooms_expired_total", self.nixl.expired if self.nixl else 0)):
            lines.append(f"# TYPE {name} {'gauge' if name.endswith('_open') else 'counter'}\n{name} {value}")
        return "\n".join(lines) + "\n"

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
        E = self.errors
        if prefill and isinstance(request, dict):
            # the prompt and the first token only (Dynamo's prefill router asks for max_tokens 1 too)
            stop = dict(request.get("stop_conditions") or {})
            stop.update(max_tokens=1)
            stop.pop("min_tokens", None)
            request = {**request, "stop_conditions": stop}
        try:
            prompt, params = request_to_params(request, self.parser)
            # the client's cache_salt, as DynamoWorker.generate salts it (dynamo_protocol's NOTE on salts):
            # both sides must key the prompt's blocks alike
            salt = request_salt(None, request_cache_salt(request))
        except RequestError as e:
            raise E.InvalidArgument(str(e)) from None
        return prompt, params, salt


class PrefillWorker(_DisaggWorker):
    """`--mode prefill`: the prompt's prefill and first token; the blocks offered to a decode worker."""

    def __init__(self, *a, **kw):
        super().__init__(*a, role="prefill", **kw)
        self._poller: asyncio.Task | None = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(0.02 if self.nixl.rooms else 0.25)
            self.nixl.poll()

    async def generate(self, request: Any, context):
        E = self.errors
        if self.nixl is not None and self._poller is None:
            self._poller = asyncio.ensure_future(self._poll())
        prompt, params, salt = self._parse(request, prefill=True)
        keys = prompt_keys(self.engine, prompt, salt)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(ev: Event) -> None:  # engine thread
            staged = None
            if ev.finished and ev.error is None:
                staged = self.blocks.export(keys)  # NOTE: before any allocation: the module's NOTE
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
                offer = {"format": FORMAT, "identity": self.blocks.identity, "block_size": self.block_size,
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

    async def _receive(self, offer: dict, prompt: list[int], salt: str | None) -> list:
        """Pull the offered blocks this engine lacks and write them into its pool; returns the
        holds to release once the request is admitted ([] when nothing was written)."""
        E = self.errors
        if offer.get("format") != FORMAT or offer.get("identity") != self.blocks.identity \
                or offer.get("block_size") != self.block_size:
            raise E.InvalidArgument(
                "the prefill worker serves another build (its KV blocks would not mean the same here): run "
                "`kvexport dynamo --mode prefill` and `--mode decode` on the same build directory")
        want = wanted(prompt_keys(self.engine, prompt, salt), offer.get("blocks") or ())
        held = await on_engine(self, lambda: self.blocks.held([(g, h) for g, _, h, _ in want]))
        missing = [w for w in want if (w[0], w[2]) not in held]
        self.stats.reused_blocks += len(want) - len(missing)
        ranges = [(off, self.blocks.block_bytes[g]) for g, _, _, off in missing]
        t0 = asyncio.get_running_loop().time()
        if "nixl" in offer:
            if self.nixl is None:
                raise E.InvalidArgument("the prefill worker offered its KV over NIXL; start this decode worker "
                                        "with --kv-transfer nixl")
            data = await asyncio.to_thread(self.nixl.pull, offer["nixl"], _merge(ranges))
        else:
            data = await asyncio.to_thread(_inline_ranges, offer.get("inline") or "", ranges)  # off the loop
        self.stats.pull_seconds += asyncio.get_running_loop().time() - t0
        if not missing:
            return []
        blocks = to_load(missing, want, prompt, self.block_size, self.blocks.block_bytes)
        holds = await on_engine(self, lambda: self.blocks.load(blocks, data))
        self.stats.pulled += 1
        self.stats.pulled_blocks += sum(len(ids) for _, ids in holds)
        return holds

    async def generate(self, request: Any, context):
        E = self.errors
        prompt, params, salt = self._parse(request, prefill=False)
        offer, details = self._offer(request)
        holds: list = []
        if offer is not None:
            try:
                holds = await self._receive(offer, prompt, salt)
            except E.InvalidArgument:
                raise
            except Exception as e:  # noqa: BLE001 - a failed pull is recomputed, not failed
                log.warning("disaggregated decode: the KV hand-off failed (%s); computing the prompt here", e)
                self.stats.recomputed += 1
        else:
            self.stats.recomputed += 1
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(ev: Event) -> None:  # engine thread: the request is admitted (holds its own refs)
            if holds:
                self.blocks.release(holds)
            loop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            rids = self.thread.submit(prompt, params, deliver, salt=salt)
        except Exception as e:  # noqa: BLE001 - the engine thread has stopped
            if holds:
                self.thread.call(lambda: self.blocks.release(holds))
            raise E.EngineShutdown(str(e)) from None
        stopped = asyncio.ensure_future(context.async_killed_or_stopped())
        state = {"finished": False, "aborted": False}
        self._abort_when_stopped(stopped, rids, state, then=lambda: self.thread.call(lambda: self.blocks.release(holds)))
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
                    self.thread.call(lambda: self.blocks.release(holds))
            if not stopped.done():
                stopped.cancel()


def wanted(keys: Sequence[Key], offered: Sequence[Sequence]) -> list[tuple[str, int, BlockHash, int]]:
    """The decode side's `prompt_keys` that the offer carries under the same key (a salt or a
    build that differs gives other keys: those blocks are not taken): (group, index, key, offset)."""
    by_place = {(g, int(i)): (h, int(off)) for g, i, h, off in offered}
    out = []
    for g, i, h in keys:
        o = by_place.get((g, i))
        if o is not None and o[0] == h.hex():
            out.append((g, i, h, o[1]))
    return out


def to_load(missing, want, prompt: Sequence[int], block_size: int, block_bytes: dict[str, int]) -> list:
    """`PoolBlocks.load`'s list for the pulled blocks `missing` (their bytes back to back in the
    order given): (group, key, parent key, offset in the pulled bytes, the block's tokens)."""
    hashes = {i: h for _, i, h, _ in want}
    out, at = [], 0
    for g, i, h, _ in missing:
        out.append((g, h, hashes.get(i - 1) if i else None, at, list(prompt[i * block_size:(i + 1) * block_size])))
        at += block_bytes[g]
    return out


def _inline_ranges(inline: str, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """The byte ranges wanted out of a request-plane offer's base64 payload, concatenated in order."""
    raw = np.frombuffer(base64.b64decode(inline), np.uint8)
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
