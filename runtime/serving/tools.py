"""Tool calling (OpenAI `tools`, `tool_choice`, `parallel_tool_calls`): checking the tools,
rendering them through the chat template, constraining `required` / named calls with a grammar,
and parsing the model's output into OpenAI `tool_calls`, whole or as stream deltas.

    tools + tool_choice ──plan()──▶ ToolPlan
        .prepare(messages) -> (messages, tools) for apply_chat_template (the family's form)
        .structured        -> StructuredOutputs for "required" (a JSON array of calls) / a named tool (its arguments)
        .parse(text)       -> (content, [calls])             (a whole response)
        .stream()          -> ToolStream: text so far -> content and tool_call deltas

Template families (chosen from the chat template's text; each has its parser):
  hermes    `<tool_call>{"name", "arguments"}</tool_call>` (Hermes, Qwen 2.5/3, SmolLM3)
  llama3    `<|python_tag|>`? `{"name", "parameters"}` (Llama 3.1-3.3 JSON tool calling), `;`-separated
  mistral   `[TOOL_CALLS][{"name", "arguments"}, ...]` or `[TOOL_CALLS]name[ARGS]{...}` (v11+)
  deepseek  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>` (V3)
A template that does not render `tools` at all (SmolLM2's, most base models'): the tools go into a
system message in the hermes form (as Qwen's template writes them), calls in earlier assistant
turns as `<tool_call>` text and tool results as `<tool_response>` user turns; parsed as hermes.

NOTE: `required` and a named tool do not depend on the family's format: the output is constrained
to JSON (vLLM's way): `required` -> [{"name": N, "parameters": {...}}, ...] (anyOf over the tools;
one item without parallel_tool_calls), named -> the tool's parameters object, so every call is
valid JSON for its schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..execution.structured import check_json_schema
from ..request_checks import RequestError
from ..sampling_params import StructuredOutputs

MAX_TOOLS = 128  # tools per request
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function name rule (and '.')

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def check_tools(tools: Any, param: str = "tools") -> list[dict]:
    """The request's tools, checked: [{"type": "function", "function": {"name", "description"?,
    "parameters"? (a JSON schema), "strict"?}}]. RequestError naming the field."""
    if not isinstance(tools, list):
        raise RequestError(f"{param} must be a list of tools", param)
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"{param}: at most {MAX_TOOLS} tools per request, got {len(tools)}", param)
    out, names = [], set()
    for i, t in enumerate(tools):
        at = f"{param}[{i}]"
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(t.get("function"), Mapping):
            raise RequestError(f'{at} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                               at)
        f = t["function"]
        unknown = sorted(set(f) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise RequestError(f"{at}.function: unexpected field {unknown[0]!r}", f"{at}.function.{unknown[0]}")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise RequestError(f"{at}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                               f"{at}.function.name")
        if name in names:
            raise RequestError(f"{at}.function.name: {name!r} is given twice", f"{at}.function.name")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise RequestError(f"{at}.function.description must be a string", f"{at}.function.description")
        params = f.get("parameters", {"type": "object", "properties": {}})
        check_json_schema(params, f"{at}.function.parameters")
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise RequestError(f"{at}.function.parameters must be a JSON schema of an object", f"{at}.function.parameters")
        out.append({"type": "function", "function": {**f, "parameters": dict(params)}})
    return out


def _tool_choice(choice: Any, tools: list[dict]) -> str:
    """tool_choice -> "none" | "auto" | "required" | a tool's name (RequestError naming tool_choice)."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise RequestError('tool_choice: "required" needs tools', "tool_choice")
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise RequestError(f"tool_choice: names the function {name!r}, which is not among the request's tools",
                               "tool_choice.function.name")
        return name
    raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                       '{"name": ...}}', "tool_choice")


def family(template: str | None) -> tuple[str, bool]:
    """(the tool-call family of a chat template, whether the template renders `tools` itself)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral", True
    if "tool▁call" in t:
        return "deepseek", True
    if "<tool_call>" in t:
        return "hermes", True
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3", True
    return "hermes", "tools" in t


def _arguments_dict(call: Mapping) -> dict:
    f = call.get("function") or {}
    args = f.get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else dict(args)
    except ValueError:
        return {"_raw": args}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict]
    choice: str  # "none" | "auto" | "required" | a tool's name
    parallel: bool
    family: str
    native: bool  # the template renders tools itself

    @property
    def named(self) -> str | None:
        return self.choice if self.choice not in ("none", "auto", "required") else None

    @property
    def structured(self) -> StructuredOutputs | None:
        """The grammar of "required" / a named tool (None for auto and none)."""
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}
        if self.named is not None:
            return StructuredOutputs(json=by_name[self.named])
        if self.choice != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                  "required": ["name", "parameters"], "additionalProperties": False} for n, p in by_name.items()]
        arr = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        if not self.parallel:
            arr["maxItems"] = 1
        return StructuredOutputs(json=arr)

    def prepare(self, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """Messages and tools as the chat template takes them (see the module's docstring)."""
        render = self.choice != "none"
        if self.native:
            out = []
            for m in messages:
                if m.get("tool_calls"):  # HF templates take arguments as objects
                    m = {**m, "tool_calls": [{**c, "function": {**c.get("function", {}),
                                                                "arguments": _arguments_dict(c)}}
                                             for c in m["tool_calls"]]}
                out.append(m)
            return out, (self.tools if render else None)
        out = []
        for m in messages:
            if m.get("tool_calls"):
                calls = "\n".join("<tool_call>\n" + json.dumps({"name": c.get("function", {}).get("name"),
                                                               "arguments": _arguments_dict(c)}) + "\n</tool_call>"
                                  for c in m["tool_calls"])
                m = {"role": m["role"], "content": (m["content"] + "\n" if m["content"] else "") + calls}
            elif m["role"] == "tool":
                m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            else:
                m = {"role": m["role"], "content": m["content"]}
            out.append(m)
        if render and self.tools:
            text = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in self.tools))
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
            else:
                out.insert(0, {"role": "system", "content": text})
        return out, None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output -> (content or None, calls)."""
        if self.choice == "none":
            return text, []
        if self.named is not None:
            return None, [ToolCall(self.named, text.strip())]
        if self.choice == "required":
            try:
                items = json.loads(text)
                return None, [ToolCall(c["name"], json.dumps(c["parameters"])) for c in items]
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens: the text as it is
                return text, []
        return PARSERS[self.family](text)

    def stream(self) -> "ToolStream":
        return ToolStream(self)


def plan(tools: Any, tool_choice: Any, parallel_tool_calls: Any, template: str | None) -> ToolPlan | None:
    """The request's tool plan, or None without tools (tool_choice then must be none/auto/absent)."""
    checked = check_tools(tools) if tools is not None else []
    choice = _tool_choice(tool_choice, checked)
    if not checked:
        return None
    if parallel_tool_calls not in (None, True, False):
        raise RequestError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    fam, native = family(template)
    return ToolPlan(checked, choice, parallel_tool_calls is not False, fam, native)


# ---- parsers: output text -> (content, calls) ---------------------------------------------------
def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters", obj.get("arguments", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _json_values(text: str) -> list[Any]:
    """Consecutive JSON values in text (separated by whitespace or ';'); stops at the first non-JSON."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i >= len(text):
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return out
        out.append(v)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        vals = _json_values(body)
        c = _call(vals[0]) if vals else None
        if c is not None:
            calls.append(c)
    if not calls:
        return text, []
    return text[:start].strip() or None, calls


def parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    if not body.startswith("{"):
        return text, []
    calls = [c for c in (_call(v, "parameters") for v in _json_values(body)) if c is not None]
    return (None, calls) if calls else (text, [])


_MISTRAL_V11 = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\]")


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    content = text[:start].strip() or None
    rest = text[start:]
    calls: list[ToolCall] = []
    for part in rest.split("[TOOL_CALLS]")[1:]:
        part = part.strip()
        m = _MISTRAL_V11.match(part)
        if m:  # v11+: name[ARGS]{...}
            vals = _json_values(part[m.end():])
            if vals:
                calls.append(ToolCall(m.group(1), json.dumps(vals[0])))
            continue
        vals = _json_values(part)
        for v in vals[:1]:
            for item in (v if isinstance(v, list) else [v]):
                c = _call(item)
                if c is not None:
                    calls.append(c)
    return (content, calls) if calls else (text, [])


_DEEPSEEK = re.compile(r"<｜tool▁call▁begin｜>\s*\w*\s*<｜tool▁sep｜>\s*([^\n]+)\n```(?:json)?\n(.*?)\n```\s*"
                       r"<｜tool▁call▁end｜>", re.S)


def parse_deepseek(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<｜tool▁calls▁begin｜>")
    if start < 0:
        return text, []
    calls = [ToolCall(name.strip(), args.strip()) for name, args in _DEEPSEEK.findall(text[start:])]
    return (text[:start].strip() or None, calls) if calls else (text, [])


PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral, "deepseek": parse_deepseek}
# where a call starts, per family: text from the first marker on is held back while streaming
MARKERS = {"hermes": ("<tool_call>",), "llama3": ("<|python_tag|>", "{"), "mistral": ("[TOOL_CALLS]",),
           "deepseek": ("<｜tool▁calls▁begin｜>",)}


class ToolStream:
    """Streaming: `add(text so far)` -> (content delta, tool_call deltas). Content streams until a
    call may begin (a family marker, or text that may be one's start); from there the text is
    held back and parsed: complete calls go out as deltas with their index as they appear;
    `finish(text)` sends what is left (the held text as content when it held no call).
    Named tools stream their arguments as they are generated."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.sent, self.calls_sent, self.held = plan, 0, 0, False
        self._named = ToolCall(plan.named, "") if plan.named else None

    def _cut(self, text: str) -> int:
        """How much of `text` is content for certain (before any marker or a marker's prefix)."""
        markers = MARKERS[self.plan.family]
        at = min((i for i in (text.find(m) for m in markers) if i >= 0), default=-1)
        if self.plan.family == "llama3":  # a JSON call only at the start of the output
            at = 0 if text.lstrip().startswith(("{", "<|python_tag|>")) or not text.strip() else -1
        if at >= 0:
            return at
        for m in markers:  # a marker's beginning at the end of the text: wait
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    return len(text) - k
        return len(text)

    def add(self, text: str) -> tuple[str, list[dict]]:
        p = self.plan
        if p.choice == "none":
            delta, self.sent = text[self.sent:], len(text)
            return delta, []
        if self._named is not None:
            delta, first = text[self.sent:], self.sent == 0
            self.sent = len(text)
            if first:
                return "", [{"index": 0, "id": self._named.id, "type": "function",
                             "function": {"name": self._named.name, "arguments": delta}}]
            return "", [{"index": 0, "function": {"arguments": delta}}] if delta else []
        if p.choice == "required":
            return "", []  # the array is parsed once whole (finish)
        cut = len(text) if self.held else self._cut(text)
        content = ""
        if not self.held:
            content, self.sent = text[self.sent:cut], cut
            self.held = cut < len(text) and any(m in text[cut:] for m in MARKERS[p.family]) or (
                p.family == "llama3" and cut < len(text) and text[cut:].lstrip()[:1] == "{")
        return content, self._new_calls(text) if self.held else []

    def _new_calls(self, text: str, final: bool = False) -> list[dict]:
        _, done = self.plan.parse(text)
        if not final:  # the last call may still grow; hermes: a call is complete once its tag closed
            done = done[:text.count("</tool_call>")] if self.plan.family == "hermes" else done[:-1]
        out = [c.openai(self.calls_sent + i) for i, c in enumerate(done[self.calls_sent:])]
        self.calls_sent = max(self.calls_sent, len(done))
        return out

    def finish(self, text: str) -> tuple[str, list[dict]]:
        """The last deltas once the output is complete."""
        p = self.plan
        if p.choice == "none" or self._named is not None:
            return self.add(text)
        if p.choice == "required":
            content, calls = p.parse(text)
            self.calls_sent = len(calls)
            return (content or "", [c.openai(i) for i, c in enumerate(calls)])
        content, calls = p.parse(text)
        if not calls:  # nothing was a call: the held text is content
            delta, self.sent = text[self.sent:], len(text)
            return delta, []
        return "", self._new_calls(text, final=True)

    @property
    def called(self) -> bool:
        return self.calls_sent > 0 or self._named is not None


def stream_choice(index: int, stream: ToolStream, text: str, finish_reason: str | None,
                  logprobs: dict | None) -> dict:
    """One choice of a chat stream chunk with tools: the content and tool_call deltas of the output
    so far (`text`); finish_reason "tool_calls" when it called tools (not for a named tool)."""
    content, calls = stream.finish(text) if finish_reason is not None else stream.add(text)
    delta: dict = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    if finish_reason == "stop" and stream.called and stream.plan.named is None:
        finish_reason = "tool_calls"
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def response_message(plan: ToolPlan | None, text: str) -> tuple[dict, bool]:
    """A whole chat response's message and whether it calls tools (finish_reason "tool_calls",
    but "stop" for a named tool, as OpenAI answers a forced function)."""
    if plan is None:
        return {"role": "assistant", "content": text}, False
    content, calls = plan.parse(text)
    msg: dict = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.openai() for c in calls]
    return msg, bool(calls) and plan.named is None


def check_messages(messages: Sequence[Any]) -> None:
    """Assistant tool_calls in the request's messages, checked (RequestError naming the field)."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, Mapping) else None
        if calls is None:
            continue
        for j, c in enumerate(calls):
            at = f"messages[{i}].tool_calls[{j}]"
            f = c.get("function") if isinstance(c, Mapping) else None
            if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
                raise RequestError(f"{at}.function.name must be a string", f"{at}.function.name")
            args = f.get("arguments")
            if isinstance(args, str):
                try:
                    json.loads(args)
                except ValueError:
                    raise RequestError(f"{at}.function.arguments is not valid JSON", f"{at}.function.arguments") from None
            elif not isinstance(args, Mapping):
                raise RequestError(f"{at}.function.arguments must be a JSON object's text", f"{at}.function.arguments")


__all__ = ["ToolCall", "ToolPlan", "ToolStream", "check_messages", "check_tools", "family", "plan",
           "response_message", "stream_choice", "PARSERS"]
