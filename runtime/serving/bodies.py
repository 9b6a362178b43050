"""Request bodies of `kvexport serve`'s POST routes, parsed off the event loop: JSON decoding and
pydantic validation of a 1 MiB body take up to seconds (a list of 130,000 one-token lists, a
list of 250,000 wrong items, each an error), so the routes take the raw body and call `parse`
in a worker thread, one body at a time (the GIL is shared with the event loop). The errors
are those FastAPI's own body parsing gives (same 400 shapes, built in the thread too).

    raw bytes ──json.loads──▶ dict ──check_sizes (lengths, no item read)──▶ model_validate ──▶ body

`check_sizes` refuses, by their lengths alone, lists that would be refused later anyway (more
prompts than a request may ask for, a prompt longer than the context, more stop strings than
taken): pydantic would otherwise walk (and for wrong items, report) every item first.
"""

from __future__ import annotations

import email.message
import json
import sys
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from . import openai_protocol as proto
from .openai_protocol import ApiError
from .requests import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, RequestError, RequestParser
from .tools import MAX_TOOLS


# magic bytes of compressed bodies sent without (or with a wrong) Content-Encoding
_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\x78\x9c", "zlib"), (b"\x78\xda", "zlib"),
               (b"\x78\x01", "zlib"))


def compressed_body_error(coding: str) -> ApiError:
    """A body sent with a Content-Encoding (gzip, br, ...): 415, this server reads plain JSON only."""
    return ApiError(415, f"Content-Encoding {coding!r}: this server does not take compressed request bodies; send "
                         f"the JSON uncompressed (UTF-8, no Content-Encoding)", code="unsupported_content_encoding")


def unparsed_body_reason(cause: BaseException | None) -> str:
    """Why the JSON parser gave up on a request body (`cause`: its exception), in words."""
    if isinstance(cause, UnicodeDecodeError):
        raw = bytes(cause.object)
        for magic, kind in _COMPRESSED:
            if raw.startswith(magic):
                return (f"the request body is {kind}-compressed; this server takes the JSON uncompressed "
                        f"(UTF-8, no Content-Encoding)")
        return (f"the request body is not UTF-8 text (byte {raw[cause.start:cause.start + 1]!r} at offset "
                f"{cause.start}: latin-1 or another encoding?); send the JSON encoded as UTF-8")
    if isinstance(cause, RecursionError):
        return "the request body could not be parsed as JSON: it is nested too deeply"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return (f"the request body could not be parsed as JSON: a number with too many digits (more than "
                f"{sys.get_int_max_str_digits()})")
    return "the request body could not be parsed as JSON"


@dataclass(frozen=True, slots=True)
class SizeLimits:
    """What `check_sizes` compares list lengths with."""

    max_sequences: int  # prompts x n per request (EngineConfig.max_sequences_per_request)
    parser: RequestParser  # its max_model_len (tokens per sequence) and check_length's errors


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI would read a body of this Content-Type as JSON (none at all: yes, as
    server.py's app takes it: strict_content_type=False)."""
    if not content_type:
        return True
    m = email.message.Message()
    m["content-type"] = content_type
    sub = m.get_content_subtype()
    return m.get_content_maintype() == "application" and (sub == "json" or sub.endswith("+json"))


def check_sizes(obj: Any, limits: SizeLimits) -> None:
    """Refuse, by list lengths only, what a later check would refuse after pydantic walked every
    item: more prompts than max_sequences_per_request, a token-id prompt (or more messages) than
    the context holds, more stop strings or stop_token_ids than taken, more tools than taken, any functions, a
    logit_bias that is not all zeros.
    Items are not looked at (their types are pydantic's, later). ApiError 400 naming the field."""
    if not isinstance(obj, dict):
        return
    n = obj.get("n")
    n = n if type(n) is int and n >= 1 else 1
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], (list, str)):  # several prompts
            proto.check_fanout(None, len(prompt), n, limits.max_sequences)
            for i, p in enumerate(prompt):
                if isinstance(p, list) and len(p) > limits.parser.max_model_len:
                    limits.parser.check_length(len(p), f"prompt[{i}]")
        elif len(prompt) > limits.parser.max_model_len:
            limits.parser.check_length(len(prompt), "prompt")
    messages = obj.get("messages")
    if isinstance(messages, list) and len(messages) > limits.parser.max_model_len:
        raise ApiError(400, f"messages: {len(messages)} messages, but the context holds "
                            f"{limits.parser.max_model_len} tokens (each message is at least one)",
                       param="messages", code="context_length_exceeded")
    stop = obj.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        proto.check_stops(stop, None)
    ids = obj.get("stop_token_ids")
    if isinstance(ids, list) and len(ids) > MAX_STOP_TOKEN_IDS:
        proto.check_stops(None, ids)
    for name in ("tools", "functions"):  # functions: the deprecated name of tools (tools.plan)
        if isinstance(obj.get(name), list) and len(obj[name]) > MAX_TOOLS:
            raise ApiError(400, f"{name}: at most {MAX_TOOLS} tools per request, got {len(obj[name])}", param=name)
    bias = obj.get("logit_bias")  # only zero biases are taken: any other value is refused, not each one reported
    if isinstance(bias, dict) and any(type(v) not in (int, float) or v != 0 for v in bias.values()):
        proto.refuse_inert("logit_bias", bias)


def parse(model: type[BaseModel], raw: bytes, content_type: str | None, limits: SizeLimits) -> BaseModel:
    """A POST body -> `model`, or ApiError 400 as FastAPI's parsing gives it (the message of
    openai_protocol.validation_error / unparsed_body_reason). O(body): call it off the loop."""
    if not raw:
        raise proto.validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    if not _is_json(content_type):
        obj: Any = raw
    else:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise proto.validation_error([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                           "ctx": {"error": e.msg}}]) from None
        except Exception as e:  # noqa: BLE001 - not UTF-8, nested too deeply, too many digits: the reason in words
            raise ApiError(400, unparsed_body_reason(e)) from None
        try:
            check_sizes(obj, limits)
        except RequestError as e:
            raise ApiError.from_request_error(e) from None
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        raise proto.validation_error([{**x, "loc": ("body", *x["loc"])} for x in errors]) from None
