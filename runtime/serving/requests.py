"""Request parsing shared by every front end (`LLM`, `kvexport serve`, the Triton model):
prompts (text, token ids, chat messages) -> checked token ids, and request fields ->
`SamplingParams`. Front ends turn `RequestError` into their own error form (an exception,
HTTP 400, a Triton error response); nothing here knows about HTTP or Triton.

    text ──tokenizer──┐
    token ids ────────┼──▶ check_token_ids (0 <= id < vocab_size) ──▶ list[int]
    chat messages ────┘ (chat template)
    fields {max_tokens, temperature, stop, ...} + prompt length ──▶ SamplingParams

`RequestParser` holds what parsing needs from an engine (tokenizer, vocabulary size,
context length); `RequestParser.for_engine(engine)` builds it. The limits every front end
applies (body size, stop strings, the chat template's time) are defined here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields as dc_fields
from typing import Any, Mapping, Sequence

from ..request_checks import RequestError, check_token_ids, prompt_logprobs_refusal
from ..sampling_params import SamplingError, SamplingParams, StructuredOutputs
from .time_limit import TimeLimitExceeded, time_limit

SAMPLING_FIELDS = frozenset(f.name for f in dc_fields(SamplingParams))

# Request limits every front end applies (`kvexport serve`, the Triton model), before anything is
# tokenized. NOTE: defined here, not in server.py (which needs FastAPI, absent from Triton's stub)
MAX_BODY_BYTES = 1 << 20  # request bodies (serve: 413 above it) and Triton's text_input, bytes
# NOTE: stop strings are searched for in every new token's text, so one request's long list
# would slow every engine step for everyone (OpenAI itself takes 4)
MAX_STOP_STRINGS = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids per request
CHAT_TEMPLATE_TIMEOUT_S = 5.0  # rendering a chat template longer than this stops it (runtime/serving/time_limit.py)


def chat_messages(messages: Any, param: str = "messages") -> list[dict[str, str]]:
    """OpenAI chat messages -> [{"role", "content"}] with string content, as chat templates
    take them. Content may be a string, null, or a list of text parts
    ({"type": "text", "text": ...}), which are joined."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise RequestError(f"{param} must be a non-empty list of messages", param)
    out = []
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RequestError(f"{where}: each message needs a string role and a content", where)
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, Sequence) and not isinstance(content, str):
            texts = []
            for j, part in enumerate(content):
                at = f"{where}.content[{j}]"
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise RequestError(f"{at}: this model reads text only; content parts must be "
                                       f'{{"type": "text", "text": ...}}, got {kind!r}', at)
                if not isinstance(part.get("text"), str):
                    raise RequestError(f"{at}.text must be a string", f"{at}.text")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        msg = {"role": m["role"], "content": content}
        # tool calling (runtime/serving/tools.py): an assistant's calls, a tool result's call id and name
        msg.update({k: m[k] for k in ("tool_calls", "tool_call_id") if m.get(k) is not None})
        if m["role"] == "tool" and isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


MAX_CACHE_SALT_CHARS = 1024  # characters of a request's cache_salt at most (256 random bits are 43 in base64)


def check_cache_salt(value: Any, param: str = "cache_salt") -> str | None:
    """A request's `cache_salt` (vLLM's field: its prefix-cache blocks are shared only with
    requests of the same salt): None when absent, else a non-empty string of at most
    MAX_CACHE_SALT_CHARS characters, valid Unicode. Raises RequestError naming `param`.
    NOTE: the salt is a secret of its tenant: error messages never repeat it."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError(f"{param} must be a non-empty string if given (as vLLM takes it), got "
                           f"{'an empty string' if value == '' else type(value).__name__}", param)
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise RequestError(f"{param}: at most {MAX_CACHE_SALT_CHARS} characters, got {len(value)}", param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{param}: not valid Unicode (a lone surrogate such as \\ud800)", param) from None
    return value


@dataclass(frozen=True, slots=True)
class RequestParser:
    """Turns one engine's requests into token ids and SamplingParams."""

    tokenizer: Any  # a transformers tokenizer; None for builds without one
    vocab_size: int  # token ids must be in [0, vocab_size)
    max_model_len: int  # tokens per sequence, prompt + output
    # a build without --all-logits: how prompt_logprobs_refusal names it (no path: clients read it); None: served
    no_prompt_logprobs: str | None = None
    # --kv-eviction streaming: outputs go on past max_model_len, so max_tokens is neither capped nor refused by it
    unbounded_output: bool = False
    template_timeout: float | None = CHAT_TEMPLATE_TIMEOUT_S  # seconds a chat template may render; None: no limit

    @classmethod
    def for_engine(cls, engine) -> "RequestParser":
        # NOTE: "this build", not its folder: the refusal goes to HTTP clients, who never see the server's paths
        return cls(engine.tokenizer, engine.vocab_size, engine.max_model_len,
                   None if engine.manifest.scores_prompts else "this build", engine.streaming)

    # ---- prompts ----------------------------------------------------------------------
    def text(self, text: str, param: str = "prompt") -> list[int]:
        """Text -> token ids with the build's tokenizer (special tokens added as it does)."""
        if self.tokenizer is None:
            raise RequestError(f"{param}: this build has no tokenizer; send the prompt as token ids", param)
        return check_token_ids(self.tokenizer(text)["input_ids"], self.vocab_size, param)

    def prompt(self, prompt: Any, param: str = "prompt") -> list[int]:
        """A string or a list of token ids -> checked token ids (possibly empty: see check_length)."""
        if isinstance(prompt, str):
            return self.text(prompt, param)
        if isinstance(prompt, Sequence) or hasattr(prompt, "tolist"):
            ids = prompt.tolist() if hasattr(prompt, "tolist") else prompt
            return check_token_ids(ids, self.vocab_size, param)
        raise RequestError(f"{param} must be a string or a list of token ids, got {type(prompt).__name__}", param)

    def chat(self, messages: Any, param: str = "messages", prepare: Any = None) -> list[int]:
        """Chat messages -> token ids through the build's chat template, with the
        assistant's generation prompt appended. `prepare(messages) -> (messages, tools or None)`:
        tool calling's rendering (runtime/serving/tools.py ToolPlan.prepare), inside the time limit."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise RequestError(f"{param}: this build's tokenizer has no chat template; send a plain prompt "
                               f"(text or token ids) instead", param)
        msgs = chat_messages(messages, param)
        try:
            with time_limit(self.template_timeout):  # NOTE: a template that loops for minutes is stopped
                msgs, tools = prepare(msgs) if prepare is not None else (msgs, None)
                extra = {"tools": tools} if tools is not None else {}
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **extra)
        except TimeLimitExceeded:
            raise RequestError(f"{param}: rendering this build's chat template (in its tokenizer/ folder) took longer "
                               f"than {self.template_timeout:g} s on these messages, so it was stopped; fix the "
                               f"template, or send a plain prompt (text or token ids) instead", param,
                               code="chat_template_timeout") from None
        except RequestError:  # prepare()'s, naming its field
            raise
        except Exception as e:  # noqa: BLE001 - templates raise on e.g. unsupported roles
            raise RequestError(f"{param}: the chat template refused the messages: {e}", param) from None
        ids = ids["input_ids"] if isinstance(ids, Mapping) or hasattr(ids, "keys") else ids
        return check_token_ids(ids, self.vocab_size, param)

    def check_length(self, prompt_len: int, param: str = "prompt", outputs: int = 1) -> int:
        """Refuses an empty prompt or one that leaves no room for `outputs` tokens (0: a prompt
        scored only, `echo` with max_tokens 0, may fill the context); returns the room left
        (max_model_len - prompt_len >= outputs)."""
        if prompt_len == 0:
            raise RequestError(f"{param}: the prompt is empty", param)
        room = self.max_model_len - prompt_len
        if room < outputs:
            need = f"prompt + at least {outputs} output token" if outputs else "the prompt, scored only"
            raise RequestError(f"{param}: the prompt has {prompt_len} tokens but the context holds "
                               f"{self.max_model_len} ({need})", param, code="context_length_exceeded")
        return room

    # ---- sampling ---------------------------------------------------------------------
    def sampling_params(self, values: Mapping[str, Any], prompt_len: int, *, default_max_tokens: int | None = None,
                        strict_max_tokens: bool = False, names: Mapping[str, str] | None = None,
                        zero_max_tokens: tuple[bool, str] = (False, "")) -> SamplingParams:
        """Request fields named as SamplingParams' (None = absent) -> SamplingParams.

        max_tokens: absent -> `default_max_tokens`, or all the room the context leaves;
        beyond that room it is capped, not refused; with `strict_max_tokens` a value over
        max_model_len itself is refused; 0 (the prompt only) where `zero_max_tokens` is
        (True, ...), else refused with its note (e.g. "(0 needs echo)"). `names` maps a SamplingParams field to the
        request's own field name, for error messages (e.g. logprobs -> top_logprobs,
        prompt_logprobs -> echo). prompt_logprobs on a build that cannot score prompts is
        refused naming the field."""
        aliases = dict(names or {})

        def name(f: str) -> str:
            return aliases.get(f, f)

        assert set(values) <= SAMPLING_FIELDS, set(values) - SAMPLING_FIELDS
        kw = {k: v for k, v in values.items() if v is not None}
        max_tokens = kw.pop("max_tokens", None)
        zero_ok, note = zero_max_tokens
        room = self.check_length(prompt_len, outputs=0 if zero_ok and max_tokens == 0 else 1)
        if max_tokens is None:
            max_tokens = default_max_tokens or room
        bad_int = isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
        if strict_max_tokens and (bad_int or not 1 <= max_tokens <= (2**62 if self.unbounded_output
                                                                      else self.max_model_len)):
            raise RequestError(f"{name('max_tokens')} must be in [1, {self.max_model_len}] (this deployment's "
                               f"context), got {max_tokens!r}", name("max_tokens"))
        if bad_int or max_tokens < (0 if zero_ok else 1):
            least = "0" if zero_ok else f"1{' ' + note if note else ''}"
            raise RequestError(f"{name('max_tokens')} must be an integer >= {least}, got {max_tokens!r}",
                               name("max_tokens"))
        if kw.get("prompt_logprobs") is not None and self.no_prompt_logprobs is not None:
            raise RequestError(prompt_logprobs_refusal(self.no_prompt_logprobs, name("prompt_logprobs")),
                               name("prompt_logprobs"))
        if "stop" in kw:
            stop = kw["stop"]
            stop = [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, Sequence) or any(not isinstance(s, str) for s in stop):
                raise RequestError(f"{name('stop')} must be a string or a list of strings", name("stop"))
            kw["stop"] = tuple(stop)
        if "stop_token_ids" in kw:
            kw["stop_token_ids"] = tuple(check_token_ids(kw["stop_token_ids"], self.vocab_size,
                                                         name("stop_token_ids")))
        try:
            return SamplingParams(max_tokens=max_tokens if self.unbounded_output else min(max_tokens, room), **kw)
        except SamplingError as e:
            msg = str(e)
            field = msg.split(": ", 1)[-1].split(" ", 1)[0]
            raise RequestError(msg, name(field) if field in SAMPLING_FIELDS else None) from None
        except (TypeError, ValueError) as e:
            raise RequestError(f"invalid sampling parameters: {e}") from None


# ---- structured output ------------------------------------------------------------------------
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs(value: Any, param: str = "structured_outputs") -> StructuredOutputs | None:
    """vLLM's `structured_outputs` extra ({"json": schema} | {"regex": ...} | {"choice": [...]} |
    {"grammar": EBNF} | {"json_object": true}) -> StructuredOutputs; None when absent. Other keys
    (vLLM's structural_tag, whitespace_pattern, ...) are refused by name."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise RequestError(f"{param} must be an object such as {{\"json\": SCHEMA}}, got {type(value).__name__}", param)
    unknown = sorted(set(value) - set(_STRUCTURED_KEYS))
    if unknown:
        raise RequestError(f"{param}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not supported; "
                           f"give one of {', '.join(_STRUCTURED_KEYS)}", f"{param}.{unknown[0]}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    if len(given) != 1:
        raise RequestError(f"{param}: give exactly one of {', '.join(_STRUCTURED_KEYS)}, got "
                           f"{', '.join(given) or 'none'}", param)
    (k, v), = given.items()
    if k == "json" and not isinstance(v, (Mapping, str)):
        raise RequestError(f"{param}.json must be a JSON schema (an object, or its JSON text)", f"{param}.json")
    try:
        return StructuredOutputs(**{k: dict(v) if isinstance(v, Mapping) else v})
    except SamplingError as e:
        raise RequestError(f"{param}.{k}: {str(e).split(': ', 1)[-1]}", f"{param}.{k}") from None


def response_format(value: Any, param: str = "response_format") -> tuple[StructuredOutputs | None, str]:
    """OpenAI's `response_format` -> (StructuredOutputs or None for plain text, the field a compile
    error names): {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}."""
    if value is None:
        return None, param
    if not isinstance(value, Mapping) or value.get("type") not in ("text", "json_object", "json_schema"):
        got = value.get("type") if isinstance(value, Mapping) else type(value).__name__
        raise RequestError(f'{param}.type must be "text", "json_object" or "json_schema", got {got!r}',
                           f"{param}.type")
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in value):
        raise RequestError(f"{param}: unexpected field {(extra or ['json_schema'])[0]!r} for type {kind!r}",
                           f"{param}.{(extra or ['json_schema'])[0]}")
    if kind == "text":
        return None, param
    if kind == "json_object":
        return StructuredOutputs(json_object=True), param
    js = value.get("json_schema")
    where = f"{param}.json_schema"
    if not isinstance(js, Mapping):
        raise RequestError(f"{where} must be an object with name and schema", where)
    unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
    if unknown:
        raise RequestError(f"{where}: unexpected field {unknown[0]!r}", f"{where}.{unknown[0]}")
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise RequestError(f"{where}.name must be a non-empty string", f"{where}.name")
    if js.get("strict") not in (None, True, False):
        raise RequestError(f"{where}.strict must be true or false", f"{where}.strict")
    schema = js.get("schema", {"type": "object"})  # OpenAI: absent means any object
    if not isinstance(schema, Mapping):
        raise RequestError(f"{where}.schema must be a JSON schema (an object)", f"{where}.schema")
    return StructuredOutputs(json=dict(schema)), f"{where}.schema"
