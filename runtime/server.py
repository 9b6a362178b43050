"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `LLMEngine`.

    HTTP handlers ──(inbox: queue.Queue)──▶ engine thread ──(call_soon_threadsafe)──▶ asyncio.Queue per request

The engine is not thread-safe, so one background thread owns it (`engine_thread.py`): it
takes new requests and aborts from a thread-safe inbox, calls `engine.step()` while work
exists, and pushes a copy of each changed output to the asyncio queue of the HTTP request
that owns it. Handlers never touch the engine. A client that disconnects mid-stream aborts its request,
so its KV blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvexport.errors import KvExportError

from .engine import EngineConfig, LLMEngine
from .engine_thread import Deliver, EngineThread, Event
from .sampling import SamplingError, SamplingParams

MAX_BODY_BYTES = 1 << 20


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _to_queue(loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> Deliver:
    """A sink for the engine thread: hands events to an asyncio queue on its own loop."""
    def deliver(ev: Event) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, ev)
        except RuntimeError:  # the event loop is closed
            pass

    return deliver


# ---- request parsing ----------------------------------------------------------------------
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens", "ignore_eos")


def _sampling_params(body: dict, prompt_len: int, max_model_len: int, default_max: int | None,
                     logprobs: int | None) -> SamplingParams:
    room = max_model_len - prompt_len
    if room < 1:
        raise ApiError(400, f"the prompt has {prompt_len} tokens but the context holds {max_model_len} "
                            f"(prompt + at least 1 output token)", param="prompt", code="context_length_exceeded")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max or room
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
    kw: dict[str, Any] = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list):
            raise ApiError(400, "stop must be a string or a list of strings", param="stop")
        kw["stop"] = tuple(stop)
    if body.get("stop_token_ids") is not None:
        kw["stop_token_ids"] = tuple(body["stop_token_ids"])
    try:
        return SamplingParams(max_tokens=min(max_tokens, room), n=body.get("n") or 1, logprobs=logprobs, **kw)
    except SamplingError as e:
        msg = str(e)
        name = msg.split(": ", 1)[-1].split(" ", 1)[0]
        raise ApiError(400, msg, param=name if name in body or name == "stop" else None) from None
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"invalid sampling parameters: {e}") from None


def _chat_tokens(tok, messages: Any) -> list[int]:
    if tok is None or not getattr(tok, "chat_template", None):
        raise ApiError(400, "this build's tokenizer has no chat template; use /v1/completions with token ids",
                       param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    msgs = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message needs a role and content", param="messages")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise ApiError(400, "message content must be a string or a list of text parts", param="messages")
        msgs.append({"role": m["role"], "content": content})
    try:
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # noqa: BLE001 - templates raise on e.g. unsupported roles
        raise ApiError(400, f"the chat template refused the messages: {e}", param="messages") from None
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _completion_prompts(tok, prompt: Any) -> list[list[int]]:
    """A string, a list of token ids, or a list of either (several prompts)."""
    def one(p: Any) -> list[int]:
        if isinstance(p, str):
            if tok is None:
                raise ApiError(400, "this build has no tokenizer; send the prompt as a list of token ids",
                               param="prompt")
            return list(tok(p)["input_ids"])
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return list(p)
        raise ApiError(400, "prompt must be a string, a non-empty list of token ids, or a list of those",
                       param="prompt")

    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [one(p) for p in prompt]
    return [one(prompt)]


# ---- the app --------------------------------------------------------------------------------
def create_app(build_dir: str | Path, config: EngineConfig = EngineConfig(), served_model_name: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES):
    from contextlib import asynccontextmanager

    engine = LLMEngine(build_dir, config)
    worker = EngineThread(engine)
    tok = engine.tokenizer
    model_name = served_model_name or Path(build_dir).resolve().name
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="kvexport", lifespan=lifespan)
    app.state.worker = worker

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(404)
    async def _not_found(request, e):
        return JSONResponse(ApiError(404, f"no route {request.url.path}", code="not_found").body(), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(request, e):
        return JSONResponse(ApiError(405, f"{request.method} is not allowed on {request.url.path}").body(),
                            status_code=405)

    async def read_json(request: Request) -> dict:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            raise ApiError(413, f"request body exceeds {max_body_bytes} bytes", code="request_too_large")
        chunks, n = [], 0
        async for c in request.stream():
            n += len(c)
            if n > max_body_bytes:
                raise ApiError(413, f"request body exceeds {max_body_bytes} bytes", code="request_too_large")
            chunks.append(c)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                           type="invalid_request_error", param="model", code="model_not_found")
        return body

    def logprobs_arg(body: dict, chat: bool) -> int | None:
        if chat:
            if not body.get("logprobs"):
                return None
            return int(body.get("top_logprobs") or 0)
        lp = body.get("logprobs")
        if lp is None or lp is False:
            return None
        if not isinstance(lp, int):
            raise ApiError(400, "logprobs must be an integer", param="logprobs")
        return int(lp)

    async def events(request: Request, prompts: list[list[int]], params: SamplingParams) -> AsyncIterator[Event]:
        """Submit every prompt x n samples; yield their events until all are finished. Aborts
        whatever is unfinished when the consumer stops early or the client goes away."""
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        rids: list[str] = []
        for i, p in enumerate(prompts):
            try:
                rids += worker.submit(p, params, _to_queue(loop, q), first_index=i * params.n)
            except KvExportError as e:  # the engine thread is gone
                worker.abort(rids)
                raise ApiError(503, str(e), type="server_error") from None
        pending = set(range(len(rids)))
        try:
            while pending:
                try:
                    ev = await asyncio.wait_for(q.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if ev.finished:
                    pending.discard(ev.index)
                yield ev
        finally:
            if pending:
                worker.abort([rids[i] for i in pending])

    def lp_block(chat: bool, ev: Event, offset: int) -> dict | None:
        if ev.logprobs is None:
            return None
        toks = [tok.decode([t]) if tok is not None else str(t) for t in ev.new_token_ids]
        tops = ev.top_logprobs or [[] for _ in toks]
        dec = lambda t: tok.decode([t]) if tok is not None else str(t)  # noqa: E731
        if chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()),
                                 "top_logprobs": [{"token": dec(t), "logprob": v, "bytes": list(dec(t).encode())}
                                                  for t, v in top]}
                                for s, lp, top in zip(toks, ev.logprobs, tops)]}
        offs = list(itertools.accumulate([offset] + [len(s) for s in toks[:-1]]))
        return {"tokens": toks, "token_logprobs": ev.logprobs, "text_offset": offs,
                "top_logprobs": [{dec(t): v for t, v in top} for top in tops] if ev.top_logprobs else None}

    def merge_lp(acc: dict | None, new: dict | None, chat: bool) -> dict | None:
        if new is None:
            return acc
        if acc is None:
            return new
        for k in (["content"] if chat else ["tokens", "token_logprobs", "text_offset"]):
            acc[k] = acc[k] + new[k]
        if not chat and new.get("top_logprobs") is not None:
            acc["top_logprobs"] = (acc.get("top_logprobs") or []) + new["top_logprobs"]
        return acc

    def engine_failure(ev: Event) -> ApiError:
        return ApiError(400 if ev.finish_reason == "error" and "prompt" in (ev.error or "") else 500,
                        ev.error or "the request failed", type="invalid_request_error"
                        if "prompt" in (ev.error or "") else "server_error")

    async def serve(request: Request, chat: bool):
        body = await read_json(request)
        if chat:
            prompts = [_chat_tokens(tok, body.get("messages"))]
        else:
            if "prompt" not in body:
                raise ApiError(400, "prompt is required", param="prompt")
            prompts = _completion_prompts(tok, body["prompt"])
        longest = max(len(p) for p in prompts)
        params = _sampling_params(body, longest, engine.max_model_len, None if chat else 16, logprobs_arg(body, chat))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        obj = "chat.completion" if chat else "text_completion"
        now = int(time.time())
        n_choices = len(prompts) * params.n
        prompt_tokens = sum(len(p) for p in prompts)  # counted once per prompt, as OpenAI does
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream(request, prompts, params, chat, rid, now, n_choices, prompt_tokens,
                                            include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        texts, reasons, ntok, lps = [""] * n_choices, [None] * n_choices, [0] * n_choices, [None] * n_choices
        async for ev in events(request, prompts, params):
            if ev.finish_reason == "error":
                raise engine_failure(ev)
            lps[ev.index] = merge_lp(lps[ev.index], lp_block(chat, ev, len(texts[ev.index])), chat)
            texts[ev.index] += ev.new_text
            ntok[ev.index] = ev.num_tokens
            if ev.finished:
                reasons[ev.index] = ev.finish_reason
        if any(r is None for r in reasons):  # the client went away
            return JSONResponse(ApiError(499, "client disconnected").body(), status_code=499)
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": lps[i],
                        "finish_reason": reasons[i]} for i in range(n_choices)]
        else:
            choices = [{"index": i, "text": texts[i], "logprobs": lps[i], "finish_reason": reasons[i]}
                       for i in range(n_choices)]
        return {"id": rid, "object": obj, "created": now, "model": model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": sum(ntok),
                          "total_tokens": prompt_tokens + sum(ntok)}}

    async def stream(request, prompts, params, chat, rid, now, n_choices, prompt_tokens, include_usage):
        obj = "chat.completion.chunk" if chat else "text_completion"
        offsets, ntok = [0] * n_choices, [0] * n_choices

        def chunk(choices, usage=None) -> str:
            d = {"id": rid, "object": obj, "created": now, "model": model_name, "choices": choices}
            if include_usage:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        if chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(n_choices)])
        gen = events(request, prompts, params)
        try:
            async for ev in gen:
                if ev.finish_reason == "error":
                    yield f"data: {json.dumps(engine_failure(ev).body())}\n\n"
                    continue
                if not ev.new_text and not ev.finished and ev.logprobs is None:
                    continue  # a token whose text is held back (partial UTF-8, possible stop string)
                lp = lp_block(chat, ev, offsets[ev.index])
                offsets[ev.index] += len(ev.new_text)
                ntok[ev.index] = ev.num_tokens
                reason = ev.finish_reason if ev.finished else None
                if chat:
                    c = {"index": ev.index, "delta": {"content": ev.new_text} if ev.new_text else {}, "logprobs": lp,
                         "finish_reason": reason}
                else:
                    c = {"index": ev.index, "text": ev.new_text, "logprobs": lp, "finish_reason": reason}
                yield chunk([c])
            if include_usage:
                yield chunk([], {"prompt_tokens": prompt_tokens, "completion_tokens": sum(ntok),
                                 "total_tokens": prompt_tokens + sum(ntok)})
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()  # aborts unfinished requests (client disconnect)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "kvexport", "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        alive = worker.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine thread stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        c = worker.counters
        kv = c.kv
        rate = kv["prefix_hits"] / kv["prefix_queries"] if kv.get("prefix_queries") else 0.0
        rows = [
            ("requests_running", "gauge", "Requests being computed", c.running),
            ("requests_waiting", "gauge", "Requests waiting for KV blocks or a batch slot", c.waiting),
            ("kv_blocks_used", "gauge", "KV-cache blocks held by requests", kv["blocks_used"]),
            ("kv_blocks_total", "gauge", "Usable KV-cache blocks", kv["blocks_total"]),
            ("kv_cache_usage", "gauge", "Fraction of KV-cache blocks in use", kv["usage"]),
            ("prefix_cache_queries_total", "counter", "Full blocks looked up in the prefix cache", kv["prefix_queries"]),
            ("prefix_cache_hits_total", "counter", "Full blocks found in the prefix cache", kv["prefix_hits"]),
            ("prefix_cache_hit_rate", "gauge", "Prefix-cache hits / queries", rate),
            ("preemptions_total", "counter", "Requests preempted for KV blocks", kv["preemptions"]),
            ("generation_tokens_total", "counter", "Tokens generated", c.generation_tokens),
            ("prompt_tokens_total", "counter", "Prompt tokens received", c.prompt_tokens),
            ("requests_total", "counter", "Sequences admitted (n samples count n)", c.requests),
            ("requests_aborted_total", "counter", "Sequences aborted (client went away)", c.aborted),
        ]
        text = "".join(f"# HELP kvexport_{n} {h}\n# TYPE kvexport_{n} {t}\nkvexport_{n} {v}\n" for n, t, h, v in rows)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def serve(build_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, config: EngineConfig = EngineConfig(),
          served_model_name: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> None:
    import uvicorn

    app = create_app(build_dir, config, served_model_name, max_body_bytes)
    uvicorn.run(app, host=host, port=port, log_level="warning")
