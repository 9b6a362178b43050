"""The OpenAI wire format of `kvexport serve`: request bodies as pydantic models (wrong
types are refused at any depth, and FastAPI derives the OpenAPI schema from them), the
error body, and pure functions that turn a request into token ids + SamplingParams and
engine events into response objects and stream chunks. Nothing here holds state or
touches the engine; runtime/serving/server.py owns the app.

    CompletionRequest | ChatCompletionRequest ──prompts() / sampling_params()──▶ token ids, SamplingParams
                                              check_fanout(): prompts x n <= max_sequences_per_request
    engine events ──logprobs_block(), choice(), chunk()──▶ JSON bodies / SSE lines
    RequestError | RequestValidationError ──▶ ApiError ──▶ {"error": {message, type, param, code}}
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict

from . import requests as req
from . import tools
from .requests import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, RequestError, RequestParser
from ..sampling_params import SamplingParams, StructuredOutputs


# ---- errors ---------------------------------------------------------------------------------
class ApiError(Exception):
    """An error response: HTTP status + the OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_request_error(cls, e: RequestError) -> "ApiError":
        status = getattr(e, "status", 400)  # NOTE: a few refusals are the server's state, not the request (503)
        return cls(status, str(e), type="invalid_request_error" if status < 500 else "server_error", param=e.param,
                   code=e.code)


# ---- request bodies -------------------------------------------------------------------------
class _Body(BaseModel):
    # NOTE: strict: "5" is not an int, 1.0 is not an int, true is not an int (JSON ints are
    # still accepted as floats); NaN and Infinity (which Python's JSON parser reads) are
    # refused. Unknown fields are refused, not ignored: a field this server does not
    # implement (logit_bias, best_of, tools, ...) would silently change what the client gets.
    # The few OpenAI fields that change nothing in the output are declared and ignored; those
    # this server does not implement are taken at the values that change nothing (check_inert).
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = None  # a last chunk with the usage and no choices


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str  # system | developer | user | assistant | tool (the chat template decides)
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    # accepted when null: what an SDK sends back of an earlier assistant message
    refusal: None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (runtime/serving/tools.py)
    tool_call_id: str | None = None  # a tool result's call
    function_call: dict[str, Any] | None = None  # legacy: an assistant's earlier call (tools.legacy_messages)
    audio: None = None
    annotations: None = None


class _SamplingBody(_Body):
    model: str | None = None  # must be the served model's name when given
    max_tokens: int | None = None  # capped at what the context leaves
    n: int | None = None  # samples per prompt
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 = off
    min_p: float | None = None  # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    min_tokens: int | None = None  # extension
    ignore_eos: bool | None = None  # extension
    speculative: bool | None = None  # extension: false turns the server's --speculative off for this request
    kv_budget_tokens: int | None = None  # extension: a smaller KV budget (--kv-eviction snapkv / h2o)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # extension (vLLM): prefix-cache blocks are shared only with requests of the same salt (and tenant);
    # a non-empty string, kept secret (a random 256-bit value, e.g. 43 base64 characters); with --cache-salt-key
    # only one a gateway signed (cache_salts.py). The only place serve reads a salt from (`nvext` is refused)
    cache_salt: str | None = None
    logit_bias: dict[str, float] | None = None  # not implemented: only null, {} or zero biases (check_inert)
    # structured output (runtime/execution/structured.py): OpenAI's {"type": "text" | "json_object" |
    # "json_schema", "json_schema": {...}}, or vLLM's extra {"json" | "regex" | "choice" | "grammar" | "json_object"}
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # accepted and ignored: they change nothing in the output
    user: str | None = None  # the end user's id
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class CompletionRequest(_SamplingBody):
    """POST /v1/completions. `prompt`: a string, token ids, or a list of either (several prompts)."""
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # top logprobs per token (0 = the chosen token's only)
    # the prompt before the completion, and with logprobs its tokens' logprobs (needs an --all-logits build);
    # max_tokens 0 then answers the prompt only
    echo: bool | None = None
    prompt_logprobs: int | None = None  # extension (vLLM): each prompt token's logprob + the top-k (--all-logits)
    # not implemented, taken at their defaults only (check_inert)
    best_of: int | None = None  # only n (1 by default): every sample generated is returned
    suffix: str | None = None  # only null or ""


class ChatCompletionRequest(_SamplingBody):
    """POST /v1/chat/completions."""
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # tool calling (runtime/serving/tools.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # false: at most one call
    # deprecated names of tools and tool_choice (older clients): taken as those, answered with `function_call`
    functions: list[dict[str, Any]] | None = None  # [{"name", "description"?, "parameters"?}]
    function_call: str | dict[str, Any] | None = None  # "none" | "auto" | {"name": ...}


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for m in models:
        names |= set(m.model_fields)
    return frozenset(names)


class LoadLoraAdapterRequest(_Body):
    """vLLM's POST /v1/load_lora_adapter (kvexport serve --allow-runtime-lora)."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(_Body):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; taken and not used (adapters are named)


_FIELDS = _field_names(StreamOptions, TextContentPart, ChatMessage, CompletionRequest, ChatCompletionRequest,
                       LoadLoraAdapterRequest, UnloadLoraAdapterRequest)


# ---- response bodies (for the OpenAPI schema; the routes build plain dicts) ------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error: OpenAI's error body."""
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache (the pool, host or disk tier)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # null for the first token of an echoed prompt
    text_offset: list[int]
    top_logprobs: list[dict[str, float] | None] | None


class PromptLogprob(BaseModel):
    logprob: float
    rank: int  # 1 = the most likely token at its position
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # only when the request asks for prompt_logprobs: per prompt position (null for the first), token id -> ...
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None  # a LoRA adapter: its own name
    parent: str | None = None  # a LoRA adapter: the base model it runs on


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str  # "ok", or why not (HTTP 503)


def validation_error(errors: list[dict]) -> ApiError:
    """FastAPI's RequestValidationError.errors() -> a 400 naming the field, as
    `messages[0].content[1].text`. A union gives errors for each of its members: only
    those of the member that matched furthest are kept (the one the client meant), or,
    when none got past the type check, one error listing the accepted types."""
    found: list[tuple[str, int, str, str, str]] = []  # (union's path, depth, path, union member tag, message)
    tags: dict[str, list[str]] = {}  # path of a union -> the tags of its members, as 'list[int]'
    for e in errors:
        loc = list(e.get("loc", ()))
        if loc and loc[0] == "body":
            loc = loc[1:]
        extra = e.get("type") == "extra_forbidden"  # loc ends with the unknown field's name
        path, tag, upath, depth = "", "", "", len(loc)
        for k, x in enumerate(loc):
            if isinstance(x, int):
                path += f"[{x}]"
            elif x in _FIELDS or (extra and k == len(loc) - 1):
                path += f".{x}" if path else str(x)
            elif not tag:
                tag, upath = str(x), path
                if tag not in tags.setdefault(path, []):
                    tags[path].append(tag)
                if loc[-1] == x:  # the value is none of the union's types
                    depth = 0
        msg = e.get("msg", "invalid value")
        if extra:
            msg = "this server does not support this field"
        if e.get("type") == "json_invalid":
            path, msg = "", f"the request body is not valid JSON: {(e.get('ctx') or {}).get('error', msg)}"
        elif not loc and isinstance(e.get("input"), bytes):
            msg = "the request body must be a JSON object (send it as Content-Type: application/json)"
        elif not path:
            msg = f"the request body: {msg}" if loc or e.get("type") != "missing" else "the request body is required"
        else:
            msg = f"{path}: {msg}"
        found.append((upath, depth, path, tag, msg))
    member: dict[str, tuple[int, str]] = {}  # union's path -> (depth, tag) of its deepest error
    for upath, depth, _, tag, _ in found:
        if tag and depth > member.get(upath, (-1, ""))[0]:
            member[upath] = (depth, tag)
    kept: list[tuple[str, str]] = []  # (path, message)
    for upath, depth, path, tag, msg in found:
        if not tag:
            kept.append((path, msg))
        elif member[upath][0] == 0:  # no member got past the type check
            kept.append((upath, f"{upath}: expected {' or '.join(tags[upath])}"))
        elif tag == member[upath][1]:
            kept.append((path, msg))
    messages = list(dict.fromkeys(m for _, m in kept))
    text = "; ".join(messages[:3]) + (f" (and {len(messages) - 3} more)" if len(messages) > 3 else "")
    return ApiError(400, text or "invalid request", param=(kept[0][0] or None) if kept else None)


# ---- request -> token ids, SamplingParams -----------------------------------------------
def check_unicode(body: BaseModel) -> None:
    """Every string of the body must be encodable: JSON's "\\ud800" escape decodes to a lone
    surrogate, which no tokenizer (nor UTF-8) takes. ApiError 400 naming the field otherwise.
    O(body): call it off the event loop."""
    def walk(v: Any, path: str) -> None:
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"{path or 'the request body'}: not valid Unicode (a lone surrogate such as "
                                    f"\\ud800)", param=path or None) from None
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(k, path)
                walk(x, f"{path}.{k}" if path else str(k))
        elif isinstance(v, list):
            if v and type(v[0]) is int and all(type(x) is int for x in v):  # token ids: nothing to encode
                return
            for i, x in enumerate(v):
                walk(x, f"{path}[{i}]")

    walk(body.model_dump(exclude_none=True), "")


# OpenAI fields this server does not implement, taken at the values that change nothing (what
# SDKs, LangChain and vLLM's clients send as defaults): field -> (is the value inert, what is taken).
# null is always taken; any other value is refused naming the field.
_INERT: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "best_of": (lambda v, body: v == (body.n or 1), "best_of equal to n (1 by default)"),
    "logit_bias": (lambda v, body: all(b == 0 for b in v.values()), "{} (no bias)"),
    "suffix": (lambda v, body: v == "", '""'),
}


def check_inert(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse (400 naming the field) a value of a field this server does not implement that
    would change the result; its default values are taken (_INERT)."""
    for name, (inert, taken) in _INERT.items():
        v = getattr(body, name, None)
        if v is not None and not inert(v, body):
            refuse_inert(name, v)


def refuse_inert(name: str, value: Any) -> None:
    """ApiError 400: `value` of the unimplemented field `name` would change the result (_INERT)."""
    raise ApiError(400, f"{name}: this server does not support {name}; it takes only {_INERT[name][1]}, got "
                        f"{json.dumps(value)[:200]}", param=name, code="unsupported_value")


def _several(p: Any) -> bool:
    """Whether a completions `prompt` is a list of prompts (of texts or of token-id lists).
    NOTE: the body model holds homogeneous lists only, so the first item tells."""
    return isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))


def num_prompts(body: CompletionRequest | ChatCompletionRequest) -> int:
    """How many prompts the request holds, without reading them (check_fanout before tokenizing)."""
    return len(body.prompt) if isinstance(body, CompletionRequest) and _several(body.prompt) else 1


def samples_asked(body: CompletionRequest | ChatCompletionRequest) -> int:
    """`n` as sent when it is a valid count, else 1 (SamplingParams refuses it later, naming it)."""
    return body.n if body.n is not None and body.n >= 1 else 1


def prompts(body: CompletionRequest | ChatCompletionRequest, parser: RequestParser,
            prepare: Callable | None = None) -> list[list[int]]:
    """The request's prompts as checked token ids (one for chat, one or more for completions),
    each non-empty and leaving room for an output token. Tokenizes and renders the chat
    template (`prepare`: a tool plan's, tools.ToolPlan.prepare): call it off the event loop."""
    if isinstance(body, ChatCompletionRequest):
        out = [parser.chat(tools.legacy_messages([m.model_dump(exclude_none=True) for m in body.messages]),
                           prepare=prepare)]
    else:
        p = body.prompt
        raw, names = (p, [f"prompt[{i}]" for i in range(len(p))]) if _several(p) else ([p], ["prompt"])
        out = []
        for x, name in zip(raw, names):
            if not isinstance(x, str):  # token ids: the length first, before every id is checked
                parser.check_length(len(x), name, outputs(body))
            out.append(parser.prompt(x, name))
    for i, ids in enumerate(out):
        parser.check_length(len(ids), "messages" if isinstance(body, ChatCompletionRequest)
                            else "prompt" if len(out) == 1 else f"prompt[{i}]", outputs(body))
    return out


def outputs(body: CompletionRequest | ChatCompletionRequest) -> int:
    """Tokens the context must leave after a prompt: none for `echo` with max_tokens 0 (it scores the prompt)."""
    return 0 if isinstance(body, CompletionRequest) and body.echo and body.max_tokens == 0 else 1


def check_fanout(body: CompletionRequest | ChatCompletionRequest | None, num_prompts: int, n: int, limit: int) -> None:
    """Refuse a request for more than `limit` sequences (prompts x n): one request must not
    fill the engine's queue for minutes (EngineConfig.max_sequences_per_request)."""
    if num_prompts * n > limit:
        param = "n" if num_prompts == 1 or n > 1 else "prompt"
        what = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        raise ApiError(400, f"{param}: the request asks for {num_prompts * n} sequences ({what}); this server "
                            f"takes at most {limit} per request (max_sequences_per_request): split it", param=param,
                       code="too_many_sequences")


def check_stops(stop: str | list | None, stop_token_ids: list | None) -> None:
    """ApiError 400 for more (or longer) stop strings, or more stop_token_ids, than taken."""
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP_STRINGS or any(isinstance(x, str) and len(x) > MAX_STOP_CHARS for x in stops):
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters",
                       param="stop")
    if stop_token_ids is not None and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids", param="stop_token_ids")


def structured(body: CompletionRequest | ChatCompletionRequest) -> tuple[StructuredOutputs | None, str]:
    """The body's structured output (response_format or structured_outputs, not both) and the field
    a compile error names."""
    if body.structured_outputs is not None:
        if body.response_format is not None and body.response_format.get("type") != "text":
            raise ApiError(400, "structured_outputs: give either response_format or structured_outputs, not both",
                           param="structured_outputs")
        spec = req.structured_outputs(body.structured_outputs)
        return spec, f"structured_outputs.{spec.field}" if spec is not None else "structured_outputs"
    return req.response_format(body.response_format)


def sampling_params(body: CompletionRequest | ChatCompletionRequest, parser: RequestParser,
                    prompt_len: int, structured: StructuredOutputs | None = None) -> SamplingParams:
    """The body's sampling fields -> SamplingParams (max_tokens capped by the context left
    after the longest prompt, `prompt_len`). Completions default to 16 tokens, chat to all
    the room left, as OpenAI does. `structured`: the output's grammar (structured(), or a tool plan's)."""
    chat = isinstance(body, ChatCompletionRequest)
    names: dict[str, str] = {}
    check_stops(body.stop, body.stop_token_ids)
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: set logprobs to true to get top_logprobs", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        names["logprobs"] = "top_logprobs"
        max_tokens = body.max_tokens
        if body.max_completion_tokens is not None:
            max_tokens, names["max_tokens"] = body.max_completion_tokens, "max_completion_tokens"
    else:
        logprobs, max_tokens = body.logprobs, body.max_tokens
    values = {"max_tokens": max_tokens, "n": body.n, "logprobs": logprobs, "stop": body.stop,
              "stop_token_ids": body.stop_token_ids, "structured": structured}
    for k in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "min_tokens", "ignore_eos", "speculative", "kv_budget_tokens"):
        values[k] = getattr(body, k)
    zero = (False, "")
    if not chat:  # echo with logprobs scores the prompt with top-`logprobs`; prompt_logprobs with its own k
        echo_k = echo_top_k(body)
        values["prompt_logprobs"] = max((k for k in (echo_k, body.prompt_logprobs) if k is not None), default=None)
        if body.prompt_logprobs is None and echo_k is not None:
            names["prompt_logprobs"] = "echo"
        zero = (bool(body.echo), "(0, the prompt only, needs echo: true)")
    return parser.sampling_params(values, prompt_len, default_max_tokens=None if chat else 16, names=names,
                                  zero_max_tokens=zero)


def echo_top_k(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The top-k of the echoed prompt's logprobs (`logprobs` with `echo`); None: no prompt logprobs
    in the echo."""
    if isinstance(body, ChatCompletionRequest) or not body.echo:
        return None
    return body.logprobs


def prompt_sources(body: CompletionRequest) -> list[str | None]:
    """Each prompt as sent when it was text (what `echo` repeats), None where it was token ids."""
    p = body.prompt
    return [x if isinstance(x, str) else None for x in p] if _several(p) else [p if isinstance(p, str) else None]


# ---- responses ----------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache (the pool or a
    KV tier below it, runtime/core/kv_tiers.py), as OpenAI's prompt_tokens_details.cached_tokens."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_tokens(per_choice: list[int], num_prompts: int, n: int) -> int:
    """Prompt tokens served from cache, counted once per prompt as prompt_tokens are (choices
    p*n .. p*n+n-1 share prompt p: the most any of them found)."""
    return sum(max(per_choice[p * n:(p + 1) * n], default=0) for p in range(num_prompts))


def logprobs_block(chat: bool, token_ids: list[int], logprobs: list[float] | None,
                   top_logprobs: list[list[tuple[int, float]]] | None, offset: int,
                   decode: Callable[[int], str]) -> dict | None:
    """The logprobs of some generated tokens, in the chat form ({"content": [...]}) or the
    completions form (tokens, token_logprobs, text_offset from `offset`, top_logprobs)."""
    if logprobs is None:
        return None
    toks = [decode(t) for t in token_ids]
    tops = top_logprobs or [[] for _ in toks]
    if chat:
        return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()),
                             "top_logprobs": [{"token": decode(t), "logprob": v, "bytes": list(decode(t).encode())}
                                              for t, v in top]}
                            for s, lp, top in zip(toks, logprobs, tops)]}
    offs = list(itertools.accumulate([offset] + [len(s) for s in toks[:-1]]))
    # NOTE: with the sampled token itself (up to k + 1 entries, as OpenAI's and vLLM's): a sampled token
    # is not always among the k most likely
    return {"tokens": toks, "token_logprobs": logprobs, "text_offset": offs,
            "top_logprobs": [{**{decode(t): v for t, v in top}, s: lp} for s, lp, top in zip(toks, logprobs, tops)]
            if top_logprobs else None}


def merge_logprobs(acc: dict | None, new: dict | None, chat: bool) -> dict | None:
    """Append the block `new` to `acc` (in place where acc exists)."""
    if new is None:
        return acc
    if acc is None:
        return new
    for k in (["content"] if chat else ["tokens", "token_logprobs", "text_offset"]):
        acc[k] = acc[k] + new[k]
    if not chat and new.get("top_logprobs") is not None:
        acc["top_logprobs"] = (acc.get("top_logprobs") or []) + new["top_logprobs"]
    return acc


def choice(chat: bool, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
           prompt_logprobs: list | None = None, message: dict | None = None) -> dict:
    """One choice of a whole response (`prompt_logprobs`: vLLM's, when the request asked; `message`:
    a chat message other than the text, e.g. with tool_calls)."""
    if chat:
        return {"index": index, "message": message or {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
    return out


def chunk_choice(chat: bool, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                 prompt_logprobs: list | None = None) -> dict:
    """One choice of a stream chunk: the text added (chat: a delta, empty once nothing is added);
    `prompt_logprobs` (vLLM's) in a choice's first chunk, when the request asked."""
    if chat:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return choice(False, index, text, logprobs, finish_reason, prompt_logprobs)


def role_chunk_choices(n: int) -> list[dict]:
    """The first chunk of a chat stream: the assistant's role for every choice."""
    return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(n)]


def response(chat: bool, rid: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage_}


def chunk(chat: bool, rid: str, created: int, model: str, choices: list[dict], include_usage: bool,
          usage_: dict | None = None) -> str:
    """One server-sent event of a stream; with include_usage every chunk carries `usage`
    (null but on the last one), as OpenAI's stream_options.include_usage asks."""
    d: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": model, "choices": choices}
    if include_usage:
        d["usage"] = usage_
    return sse(d)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# an absolute file-system path (two parts at least): the server's, never shown to a client
_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.@+~-]+/)+[\w.@+~-]*")


def engine_failure(error: str | None) -> ApiError:
    """A request the engine finished with an error: the client's fault (400) when it is
    about the prompt, the server's (500) otherwise. The server's paths (a backend's error
    naming a graph file, the build folder) become "<server path>": the log has them."""
    msg = _PATH.sub("<server path>", error or "the request failed")
    client = "prompt" in msg
    return ApiError(400 if client else 500, msg, type="invalid_request_error" if client else "server_error")
