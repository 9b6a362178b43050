"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `LLMEngine`: the app, its
routes, the engine thread and streaming. The wire format (request models, response and
chunk builders, error bodies) is runtime/serving/openai_protocol.py; prompt and parameter parsing
is runtime/serving/requests.py; the metrics table is runtime/serving/metrics.py.

    HTTP handlers ──(inbox: queue.Queue)──▶ engine thread ──(call_soon_threadsafe)──▶ asyncio.Queue per request

The engine is not thread-safe, so one background thread owns it (`engine_thread.py`): it
takes new requests and aborts from a thread-safe inbox, calls `engine.step()` while work
exists, and pushes an `Event` for each changed output to the asyncio queue of the HTTP
request that owns it. Handlers never step the engine nor reach its pool: they prepare requests in
worker threads with `LLMEngine.prep` alone (runtime/frontend.py: the tokenizer, the settings
checks, grammar compiles; read-only or thread-safe) and hand them to the engine thread. A client that disconnects (streaming
or not) aborts its request within DISCONNECT_POLL_S, so its KV blocks go back to the pool.
All prompts x n samples of one HTTP request form one group of the engine thread's fair
admission; more than `max_sequences_per_request` of them are refused.

`serve()` binds the port before loading the model (a port in use is a clear error at once),
reports readiness through `on_ready` once the app has started and the socket listens, and on
SIGTERM/SIGINT lets running requests finish for `shutdown_grace` seconds, then ends them
(HTTP 503, or an error event in a stream) and exits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import gc
import math
import socket
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncGenerator, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from kvexport.errors import ConfigError, KvExportError

from . import auth, bodies, echo, tools
from . import openapi as oas
from . import metrics as mx
from . import openai_protocol as proto
from ..core.block_hash import request_salt
from ..core.outputs import PromptLogprobs
from ..config import EngineConfig
from ..engine import LLMEngine
from .engine_thread import Deliver, EngineThread, Event
from .openai_protocol import ApiError, ChatCompletionRequest, CompletionRequest
from .cache_salts import SaltKey, accept_salt
from .requests import MAX_BODY_BYTES, RequestError, RequestParser
from .tool_parsers import tool_parser
from ..sampling_params import SamplingParams

DISCONNECT_POLL_S = 1.0  # how often a running request checks whether its client left (and the shutdown)
SHUTDOWN_GRACE_S = 10.0  # after SIGTERM/SIGINT, seconds running requests may take to finish before they are ended


class ServeError(KvExportError):
    """`kvexport serve` could not start: the address cannot be bound, or the app did not start."""


def _to_queue(loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> Deliver:
    """A sink for the engine thread: hands events to an asyncio queue on its own loop."""
    def deliver(ev: Event) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, ev)
        except RuntimeError:  # the event loop is closed
            pass

    return deliver


class BodyLimit:
    """ASGI middleware: refuses request bodies over `max_bytes` with 413 before any route
    reads them (by Content-Length, or by counting the chunks), then replays the body; a
    compressed body (a Content-Encoding other than identity) gets 415 without being read."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, scope, receive, send) -> None:
        err = ApiError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")
        await JSONResponse(err.body(), status_code=413)(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if (coding := headers.get(b"content-encoding", b"").strip().lower()) not in (b"", b"identity"):
            err = bodies.compressed_body_error(coding.decode("latin-1"))
            return await JSONResponse(err.body(), status_code=err.status, headers={"Accept-Encoding": "identity"})(
                scope, receive, send)
        size = headers.get(b"content-length", b"")
        if size.isdigit() and int(size) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        chunks, n = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left before sending its body
                return
            n += len(msg.get("body", b""))
            if n > self.max_bytes:
                return await self._refuse(scope, receive, send)
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later: http.disconnect when the client leaves

        await self.app(scope, replay, send)


class OpenAIServer:
    """What the routes share: the engine (read only: its tokenizer and limits), the thread
    that owns it, the request parser, the served name."""

    def __init__(self, engine: LLMEngine, model_name: str, worker: EngineThread | None = None,
                 salt_key: SaltKey | None = None, tool_call_parser: str | None = None):
        self.engine = engine  # NOTE: stepped by the engine thread only; handlers prepare requests with `prep`
        self.prep = engine.prep  # the engine's parts request preparation may use from any thread (runtime/frontend.py)
        self.salt_key = salt_key  # with one, only gateway-signed cache_salts are taken (cache_salts.py)
        # the tool-call format outputs are read in (--tool-call-parser; ConfigError unless registered);
        # None: the one the chat template tells (tools.py)
        self.tool_call_parser = tool_parser(tool_call_parser).name if tool_call_parser is not None else None
        if model_name in engine.prep.lora_names:  # NOTE: before the engine thread starts
            raise ConfigError(f"lora_modules: the adapter name {model_name!r} is the served model's name; give the "
                              f"adapter another name (a request's model picks the base by that name)")
        self.worker = worker or EngineThread(engine)
        self.parser = RequestParser.for_engine(engine)
        self.model_name = model_name
        # sequences one request may ask for (prompts x n); EngineConfig.max_sequences_per_request
        self.max_sequences: int = engine.config.max_sequences_per_request
        self.limits = bodies.SizeLimits(self.max_sequences, self.parser)  # checked before a body is validated
        self.parse_lock = asyncio.Lock()  # one body parsed at a time (bodies.py: the GIL is the event loop's too)
        self.created = int(time.time())
        self.cancelled = 0  # sequences stopped because their client went away (aborted unfinished); for /metrics
        self.shutdown_deadline: float | None = None  # time.monotonic() at which running requests are ended

    def begin_shutdown(self, grace: float) -> None:
        """The server is shutting down: requests still running in `grace` s are ended with 503."""
        self.shutdown_deadline = time.monotonic() + grace

    def decode(self, token_id: int) -> str:
        tok = self.prep.tokenizer
        return str(tok.decode([token_id])) if tok is not None else str(token_id)

    async def body(self, request: Request, model: type[proto.BaseModel]):
        """The POST body as `model`: decoded, size-checked and validated in a worker thread, one body
        at a time (bodies.py): a 1 MiB body can take a second, which /health and others must not wait for."""
        raw = await request.body()
        async with self.parse_lock:
            return await asyncio.to_thread(bodies.parse, model, raw, request.headers.get("content-type"), self.limits)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (runtime/lora.py; None: the base model, by its name or unset);
        404 naming `model` for one this server does not serve."""
        if model is None or model == self.model_name:
            return None
        if model in self.prep.lora_names:
            return model
        served = ", ".join(repr(m) for m in (self.model_name, *self.prep.lora_names))
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")

    async def events(self, request: Request, prompts: list[list[int]], params: SamplingParams,
                     group: str, salt: str | None = None) -> AsyncGenerator[Event, None]:
        """Submit every prompt x n samples (one fair-admission `group`); yield their events
        until all are finished. Aborts whatever is unfinished when the consumer stops early,
        the client goes away or the shutdown grace runs out (ApiError 503)."""
        loop, q = asyncio.get_running_loop(), asyncio.Queue[Event]()
        rids: list[str] = []
        for i, p in enumerate(prompts):
            try:
                rids += self.worker.submit(p, params, _to_queue(loop, q), first_index=i * params.n, group=group,
                                           salt=salt)
            except KvExportError as e:  # the engine thread is gone
                self.worker.abort(rids)
                raise ApiError(503, str(e), type="server_error") from None
        pending = set(range(len(rids)))
        failed = False  # a sample ended in an error (or the server ended it): not a client's cancellation
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while pending:
                # NOTE: checked by the clock, not only when no event came for a while: tokens
                # arrive every step, and a non-streaming request writes nothing that could fail
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + DISCONNECT_POLL_S
                    if self.shutdown_deadline is not None and now >= self.shutdown_deadline:
                        failed = True
                        raise ApiError(503, "the server is shutting down; the request was stopped",
                                       type="server_error", code="server_shutting_down")
                    if await request.is_disconnected():
                        return
                try:
                    ev = await asyncio.wait_for(q.get(), timeout=max(0.0, next_check - now))
                except asyncio.TimeoutError:
                    continue
                if ev.finished:
                    pending.discard(ev.index)
                failed = failed or ev.finish_reason == "error"
                yield ev
        finally:
            if pending:
                self.worker.abort([rids[i] for i in pending])
                self.cancelled += 0 if failed else len(pending)  # sequences, as requests_total counts them

    async def generate(self, request: Request, body: CompletionRequest | ChatCompletionRequest):
        """Both POST routes: a whole response, or a StreamingResponse of chunks."""
        self.check_model(body.model)
        proto.check_inert(body)
        # the prefix cache is shared only within a tenant (--api-keys) and a cache_salt, taken by cache_salts.py's
        # rule (the body's field is the only place: `nvext` is refused as an unknown field)
        salt = request_salt(auth.tenant_of(request.scope), accept_salt((("cache_salt", body.cache_salt),),
                                                                       self.salt_key))
        chat = isinstance(body, ChatCompletionRequest)
        # NOTE: the cheap limits first, on the event loop (counts as sent); tokenizing and the chat
        # template run in a worker thread, so a big request never holds up /health or other clients
        proto.check_fanout(body, proto.num_prompts(body), proto.samples_asked(body), self.max_sequences)
        prompts, params, plan = await asyncio.to_thread(self.prepare, body)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        prompt_tokens = sum(len(p) for p in prompts)  # counted once per prompt, as OpenAI does
        prompt = _PromptPart.of(body, prompts, params.n)
        prompt.tool_plan = plan
        if prompt.echo:  # NOTE: decoding token-id prompts is not for the event loop
            prompt.texts = await asyncio.to_thread(self.echo_texts, body, prompts)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self.stream(request, chat, prompts, params, rid, now, prompt_tokens, include_usage, prompt, salt)
            return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        n = len(prompts) * params.n
        texts, ntok, cached = [prompt.text(i) for i in range(n)], [0] * n, [0] * n
        reasons: list[str | None] = [None] * n
        lps: list[dict | None] = [None] * n
        scores: list[PromptLogprobs | None] = [None] * n
        async with aclosing(self.events(request, prompts, params, rid, salt)) as events:  # closing aborts the unfinished
            async for ev in events:
                if ev.finish_reason == "error":
                    raise proto.engine_failure(ev.error)
                lp = proto.logprobs_block(chat, ev.new_token_ids, ev.logprobs, ev.top_logprobs, len(texts[ev.index]),
                                          self.decode)
                lps[ev.index] = proto.merge_logprobs(lps[ev.index], lp, chat)
                texts[ev.index] += ev.new_text
                ntok[ev.index] = ev.num_tokens
                cached[ev.index] = max(cached[ev.index], ev.num_cached_prompt_tokens)
                if ev.prompt_logprobs is not None:  # NOTE: not `or`: a one-token prompt's scores are empty
                    scores[ev.index] = ev.prompt_logprobs
                if ev.finished:
                    reasons[ev.index] = ev.finish_reason
        if any(r is None for r in reasons):  # the client went away
            return JSONResponse(ApiError(499, "client disconnected").body(), status_code=499)
        vllm: list[list | None] = [None] * n
        if prompt.scored:
            parts = await asyncio.to_thread(lambda: [prompt.parts(self.prep.tokenizer, i, scores[i])
                                                     for i in range(n)])
            for i, (echo_lp, vllm[i]) in enumerate(parts):
                lps[i] = proto.merge_logprobs(echo_lp, lps[i], chat)  # the prompt's first
        choices = [proto.choice(chat, i, texts[i], lps[i], reasons[i], vllm[i]) for i in range(n)]
        if plan is not None:  # tool calls parsed from the text (tools.py)
            for c in choices:
                c["message"], called = tools.response_message(plan, c["message"]["content"])
                c["finish_reason"] = called if called and c["finish_reason"] == "stop" else c["finish_reason"]
        return proto.response(chat, rid, now, params.lora or self.model_name, choices,  # the adapter asked for, as vLLM
                              proto.usage(prompt_tokens, sum(ntok), proto.cached_tokens(cached, len(prompts), params.n)))

    def prepare(self, body: CompletionRequest | ChatCompletionRequest
                ) -> tuple[list[list[int]], SamplingParams, tools.ToolPlan | None]:
        """The body's checked prompts (token ids), SamplingParams and tool plan (tools.py): walks every
        string, tokenizes, renders the chat template (within RequestParser.template_timeout), compiles
        the output's grammar (cached; the engine then finds it): call it off the loop."""
        proto.check_unicode(body)
        plan = None
        if isinstance(body, ChatCompletionRequest):
            tools.check_messages([m.model_dump(exclude_none=True) for m in body.messages])
            plan = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls,
                              getattr(self.prep.tokenizer, "chat_template", None), functions=body.functions,
                              function_call=body.function_call, tool_call_parser=self.tool_call_parser)
        prompts = proto.prompts(body, self.parser, plan.prepare if plan is not None else None)
        spec, field_ = proto.structured(body)
        if plan is not None and plan.structured is not None:
            if spec is not None:
                raise ApiError(400, f"tool_choice: {plan.choice!r} constrains the output to a tool call; leave "
                                    f"response_format / structured_outputs unset", param="tool_choice")
            spec, field_ = plan.structured, "tools"
        params = proto.sampling_params(body, self.parser, max(len(p) for p in prompts), spec)
        if (adapter := self.check_model(body.model)) is not None:  # a LoRA adapter by name (runtime/lora.py)
            params = dataclasses.replace(params, lora=adapter)
        proto.check_fanout(body, len(prompts), params.n, self.max_sequences)
        self.prep.check_params(params)  # what the engine's settings refuse (RequestError: a 400 naming the field)
        if spec is not None:
            self.prep.compile(spec, field_)  # GrammarError: a 400 naming the field
        return prompts, params, plan

    def echo_texts(self, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """What `echo` repeats of each prompt (echo.prompt_text)."""
        tok = self.prep.tokenizer
        return [echo.prompt_text(tok, src, ids) for src, ids in zip(proto.prompt_sources(body), prompts)]

    async def stream(self, request: Request, chat: bool, prompts: list[list[int]], params: SamplingParams, rid: str,
                     now: int, prompt_tokens: int, include_usage: bool, prompt: "_PromptPart",
                     salt: str | None = None) -> AsyncIterator[str]:
        n = len(prompts) * params.n
        offsets, ntok, cached = [0] * n, [0] * n, [0] * n
        started = [not (prompt.echo or prompt.scored)] * n  # the prompt's part went out (or there is none)
        plan = prompt.tool_plan
        calls = [plan.stream() for _ in range(n)] if plan is not None else []  # content / tool_call deltas
        so_far = [""] * n

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            return proto.chunk(chat, rid, now, params.lora or self.model_name, choices, include_usage, usage)

        if chat:
            yield chunk(proto.role_chunk_choices(n))
        gen = self.events(request, prompts, params, rid, salt)
        try:
            async for ev in gen:
                i = ev.index
                if ev.finish_reason == "error":
                    yield proto.sse(proto.engine_failure(ev.error).body())
                    continue
                if started[i] and not ev.new_text and not ev.finished and ev.logprobs is None:
                    continue  # a token whose text is held back (partial UTF-8, possible stop string)
                head, head_lp, vllm = "", None, None
                if not started[i]:  # a choice's first chunk starts with the prompt's part
                    started[i], head = True, prompt.text(i)
                    if prompt.scored:
                        head_lp, vllm = await asyncio.to_thread(prompt.parts, self.prep.tokenizer, i,
                                                                ev.prompt_logprobs)
                    offsets[i] += len(head)
                lp = proto.logprobs_block(chat, ev.new_token_ids, ev.logprobs, ev.top_logprobs, offsets[i],
                                          self.decode)
                offsets[i] += len(ev.new_text)
                ntok[i] = ev.num_tokens
                cached[i] = max(cached[i], ev.num_cached_prompt_tokens)
                reason = ev.finish_reason if ev.finished else None
                if calls:  # chat with tools (tools.py)
                    so_far[i] += ev.new_text
                    yield chunk([tools.stream_choice(i, calls[i], so_far[i], reason, lp)])
                    continue
                yield chunk([proto.chunk_choice(chat, i, head + ev.new_text, proto.merge_logprobs(head_lp, lp, chat),
                                                reason, vllm)])
            if include_usage:
                yield chunk([], proto.usage(prompt_tokens, sum(ntok), proto.cached_tokens(cached, len(prompts), params.n)))
            yield proto.SSE_DONE
        except ApiError as e:  # the shutdown grace ran out: the stream ends with an error event
            yield proto.sse(e.body())
        finally:
            await gen.aclose()  # aborts unfinished requests (client disconnect)


@dataclass(slots=True)
class _PromptPart:
    """What a completions request asks of its prompts (runtime/serving/echo.py): `echo` (their
    text first), its logprobs (top `echo_k`) and vLLM's prompt_logprobs (top `vllm_k`)."""

    prompts: list[list[int]]
    n: int  # samples per prompt: choice i is of prompt i // n
    echo: bool
    echo_k: int | None
    vllm_k: int | None
    texts: list[str] = field(default_factory=list)  # each prompt's echoed text (when echo)
    tool_plan: tools.ToolPlan | None = None  # chat with tools: the output's calls are parsed (tools.py)

    @classmethod
    def of(cls, body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]], n: int) -> "_PromptPart":
        chat = isinstance(body, ChatCompletionRequest)
        return cls(prompts, n, not chat and bool(body.echo), proto.echo_top_k(body),
                   None if chat else body.prompt_logprobs)

    @property
    def scored(self) -> bool:
        return self.echo_k is not None or self.vllm_k is not None

    def text(self, choice: int) -> str:
        return self.texts[choice // self.n] if self.echo else ""

    def parts(self, tokenizer, choice: int, scores: PromptLogprobs | None) -> tuple[dict | None, list | None]:
        """(the echo's logprobs block, vLLM's prompt_logprobs) of a choice; decodes tokens: call it off the loop."""
        return echo.prompt_parts(tokenizer, self.prompts[choice // self.n], scores, self.echo_k, self.vllm_k)


# ---- routes: module-level functions; the state is request.app.state.server ------------------
def _server(request: Request) -> OpenAIServer:
    return request.app.state.server


# NOTE: the POST routes read their raw body and parse it off the event loop (OpenAIServer.body); the
# OpenAPI schema still describes it (openapi.py)
async def completions(request: Request):
    s = _server(request)
    return await s.generate(request, await s.body(request, CompletionRequest))


async def chat_completions(request: Request):
    s = _server(request)
    return await s.generate(request, await s.body(request, ChatCompletionRequest))


async def models(request: Request):
    s = _server(request)
    base = {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "kvexport",
            "max_model_len": s.prep.max_model_len}
    # LoRA adapters as vLLM lists them: each its own model, `parent` the base it runs on (runtime/lora.py)
    return {"object": "list", "data": [base, *({**base, "id": name, "root": name, "parent": s.model_name}
                                               for name in s.prep.lora_names)]}


async def _on_engine(s: "OpenAIServer", fn: Callable[[], None], timeout: float = 60.0) -> None:
    """Run `fn` on the engine thread between two steps and wait for it (its exception raised here)."""
    try:
        await s.worker.run(fn, timeout)
    except asyncio.TimeoutError:
        raise ApiError(503, "the engine thread did not take the change in time; retry", type="server_error") from None


def _lora_error(e: KvExportError) -> ApiError:
    msg = str(e)
    return ApiError(400, msg, param="lora_path" if msg.startswith("lora_path") else "lora_name")


async def load_lora_adapter(request: Request):
    """vLLM's runtime adapter loading (`--allow-runtime-lora`): read and check the PEFT folder off the event loop,
    then swap the factors in on the engine thread between two steps; the adapter is a model from then on."""
    from kvexport import lora_adapters

    s = _server(request)
    body = await s.body(request, proto.LoadLoraAdapterRequest)
    name = body.lora_name
    if not name.strip() or name == s.model_name:
        raise ApiError(400, f"lora_name: {name!r} cannot name an adapter (empty, or the served model's name)",
                       param="lora_name")
    if name in s.prep.lora_names:
        raise ApiError(400, f"lora_name: an adapter named {name!r} is loaded; unload it first or pick another name",
                       param="lora_name")
    try:
        adapter = await asyncio.to_thread(lora_adapters.read, Path(body.lora_path).expanduser(), "lora_path")
        await _on_engine(s, lambda: s.engine.load_lora(name, adapter))
    except KvExportError as e:
        raise _lora_error(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request):
    s = _server(request)
    body = await s.body(request, proto.UnloadLoraAdapterRequest)
    if body.lora_name not in s.prep.lora_names:
        raise ApiError(404, f"lora_name: no adapter {body.lora_name!r} is loaded", param="lora_name",
                       code="model_not_found")
    try:
        await _on_engine(s, lambda: s.engine.unload_lora(body.lora_name))
    except KvExportError as e:  # NOTE: in use by unfinished requests: retry when they finish
        raise ApiError(409, str(e), param="lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def health(request: Request):
    why = _server(request).worker.health()  # None, or: stopped / stalled in a step (engine_thread.py)
    return JSONResponse({"status": why or "ok"}, status_code=503 if why else 200)


async def metrics(request: Request):
    server = _server(request)
    # cancellations are counted here, not by the engine thread: it also aborts the other
    # samples of a request that failed, which no client cancelled
    return PlainTextResponse(mx.prometheus_text(server.worker.counters, server.cancelled),
                             media_type="text/plain; version=0.0.4")


# ---- error handlers -------------------------------------------------------------------------
async def _api_error(request: Request, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status)


async def _request_error(request: Request, e: RequestError):
    err = ApiError.from_request_error(e)
    return JSONResponse(err.body(), status_code=err.status)


async def _validation_error(request: Request, e: RequestValidationError):
    err = proto.validation_error(list(e.errors()))
    return JSONResponse(err.body(), status_code=err.status)


async def _not_found(request: Request, e):
    return JSONResponse(ApiError(404, f"no route {request.url.path}", code="not_found").body(), status_code=404)


async def _bad_method(request: Request, e):
    return JSONResponse(ApiError(405, f"{request.method} is not allowed on {request.url.path}").body(),
                        status_code=405, headers=getattr(e, "headers", None))  # Allow: the methods it takes


async def _http_error(request: Request, e: HTTPException):
    # FastAPI's own 400 for a body its JSON parser gives up on (not UTF-8, compressed, nesting
    # too deep, a number with thousands of digits: its cause says which), and any other
    # HTTPException: in OpenAI's shape
    msg = str(e.detail)
    if e.status_code == 400 and msg == "There was an error parsing the body":
        msg = bodies.unparsed_body_reason(e.__cause__)
    return JSONResponse(ApiError(e.status_code, msg, type="invalid_request_error" if e.status_code < 500
                                 else "server_error").body(), status_code=e.status_code, headers=e.headers)


async def _internal_error(request: Request, e: Exception):
    # the traceback goes to the server's log (Starlette re-raises it to uvicorn), never to the client
    return JSONResponse(ApiError(500, "internal server error (see the server's log)", type="server_error").body(),
                        status_code=500)


def create_app(build_dir: str | Path, config: EngineConfig = EngineConfig(), served_model_name: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, api_keys: auth.ApiKeys | None = None,
               salt_key: SaltKey | None = None, tool_call_parser: str | None = None,
               allow_runtime_lora: bool = False) -> FastAPI:
    """The FastAPI app serving `build_dir` (named `served_model_name`, or the build folder's name); with
    `salt_key`, only cache_salts a gateway signed with it are taken (runtime/serving/cache_salts.py); with
    `tool_call_parser`, tool calls are read in that format (runtime/serving/tool_parsers/), not the template's;
    with `allow_runtime_lora`, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (a client names a folder on
    this machine: off by default, and refused with `api_keys`, which have no admin role yet)."""
    if allow_runtime_lora and api_keys is not None:
        raise ConfigError("--allow-runtime-lora with --api-keys: every key holder could load adapters from this "
                          "machine's disk, and keys have no admin role yet; serve adapters with --lora-modules")
    engine = LLMEngine(build_dir, config)
    if allow_runtime_lora and engine.loras is None:
        raise ConfigError(f"--allow-runtime-lora: {build_dir} takes no adapters (built without --lora-max-rank); "
                          f"rebuild it with `kvexport build MODEL --lora-max-rank R`")
    return build_app(OpenAIServer(engine, served_model_name or Path(build_dir).resolve().name, salt_key=salt_key,
                                  tool_call_parser=tool_call_parser), max_body_bytes, api_keys, allow_runtime_lora)


def build_app(server: OpenAIServer, max_body_bytes: int = MAX_BODY_BYTES,
              api_keys: auth.ApiKeys | None = None, allow_runtime_lora: bool = False) -> FastAPI:
    """The app's routes and error handlers over `server`; its engine thread runs while the
    app's lifespan does. With `api_keys`, every route but /health and /metrics needs a key
    (runtime/serving/auth.py), and each tenant's prefix cache is its own."""

    @asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        try:
            yield
        finally:
            server.worker.stop()

    # NOTE: strict_content_type=False: a body without a Content-Type is read as JSON, as
    # clients such as `curl --data-binary` send it
    app = FastAPI(title="kvexport", summary="OpenAI-compatible server of a kvexport build", lifespan=lifespan,
                  strict_content_type=False)
    app.state.server = server
    app.state.worker = server.worker
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_keys is not None:  # NOTE: added last, so it runs first: no body is read before the key is checked
        app.add_middleware(auth.ApiKeyAuth, keys=api_keys)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _bad_method)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_api_route("/v1/completions", completions, methods=["POST"],
                      openapi_extra=oas.request_body(CompletionRequest),
                      responses=oas.generation_responses(proto.CompletionResponse))
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"],
                      openapi_extra=oas.request_body(ChatCompletionRequest),
                      responses=oas.generation_responses(proto.ChatCompletionResponse))
    app.add_api_route("/v1/models", models, methods=["GET"], responses={200: {"model": proto.ModelList}})
    if allow_runtime_lora:  # vLLM's runtime adapter routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
        for path, route, model in (("/v1/load_lora_adapter", load_lora_adapter, proto.LoadLoraAdapterRequest),
                                   ("/v1/unload_lora_adapter", unload_lora_adapter, proto.UnloadLoraAdapterRequest)):
            app.add_api_route(path, route, methods=["POST"], response_class=PlainTextResponse,
                              openapi_extra=oas.request_body(model))
    app.add_api_route("/health", health, methods=["GET"],
                      responses={200: {"model": proto.Health}, 503: {"model": proto.Health,
                                                                      "description": "the engine thread stopped or stalled"}})
    app.add_api_route("/metrics", metrics, methods=["GET"], response_class=PlainTextResponse,
                      responses={200: {"description": "Prometheus text format",
                                       "content": {"text/plain": {"schema": {"type": "string"}}}}})
    app.openapi = oas.schema_of(app)  # type: ignore[method-assign]
    return app


class _Uvicorn(uvicorn.Server):
    """uvicorn's server with two hooks: `on_ready` once the app has started and the socket
    listens, and the OpenAI server's shutdown deadline, set when the shutdown begins."""

    def __init__(self, config: uvicorn.Config, server: OpenAIServer, grace: float, on_ready: Callable[[], None]):
        super().__init__(config)
        self.app_server, self.grace, self.on_ready = server, grace, on_ready

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            self.on_ready()

    async def shutdown(self, sockets=None) -> None:
        self.app_server.begin_shutdown(self.grace)
        await super().shutdown(sockets)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) (port 0: any free port), or ServeError saying why not."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port must be an integer in [0, 65535], got {port!r}")
    try:
        family, kind, proto_, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ServeError(f"cannot listen on --host {host!r}: {getattr(e, 'strerror', None) or e}") from None
    sock = socket.socket(family, kind, proto_)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = {errno.EADDRINUSE: ": another process listens there; pick another --port (0: any free port)",
                errno.EACCES: ": ports below 1024 need privileges; pick another --port",
                errno.EADDRNOTAVAIL: ": no interface of this machine has that address; check --host"}
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror}{hint.get(e.errno, '')}") from None
    return sock


def serve(build_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, config: EngineConfig = EngineConfig(),
          served_model_name: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
          shutdown_grace: float = SHUTDOWN_GRACE_S, on_ready: Callable[[str], None] | None = None,
          api_keys: auth.ApiKeys | None = None, salt_key: SaltKey | None = None,
          tool_call_parser: str | None = None, allow_runtime_lora: bool = False) -> None:
    """Serve `build_dir` on host:port until SIGTERM/SIGINT (with `api_keys`: to their holders
    only; with `salt_key`: only cache_salts a gateway signed; with `tool_call_parser`: tool calls
    read in that registered format, not the chat template's). The port is bound first, then the
    model loaded; `on_ready(url)` is called once both are done and requests are taken (url:
    http://host:port, with the real port when `port` is 0). On shutdown, running requests have
    `shutdown_grace` s to finish; what is left is ended with 503. Raises ServeError (or the
    build's KvExportError) when the server cannot start."""
    if isinstance(shutdown_grace, bool) or not isinstance(shutdown_grace, (int, float)) or not 0 <= shutdown_grace:
        raise ConfigError(f"shutdown_grace must be a number of seconds >= 0, got {shutdown_grace!r}")
    sock = listen(host, port)
    try:
        app = create_app(build_dir, config, served_model_name, max_body_bytes, api_keys, salt_key, tool_call_parser,
                         allow_runtime_lora)
        # NOTE: what loading left (torch, transformers, the graphs: ~10^6 objects) is never garbage; frozen, the
        # collector no longer walks it, which took the GIL for 0.5 s whenever a big request triggered a full collection
        gc.freeze()
        bound = sock.getsockname()[1]
        url = f"http://{f'[{host}]' if ':' in host else host}:{bound}"
        # uvicorn's own limit is a backstop: our requests end at the grace, polled every DISCONNECT_POLL_S
        ucfg = uvicorn.Config(app, log_level="warning", lifespan="on",
                              timeout_graceful_shutdown=math.ceil(shutdown_grace + DISCONNECT_POLL_S + 5))
        server = _Uvicorn(ucfg, app.state.server, shutdown_grace, lambda: on_ready(url) if on_ready else None)
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:
        raise ServeError("the server did not start (see the log above)")
