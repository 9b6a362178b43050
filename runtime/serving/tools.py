"""Tool calling (OpenAI `tools`, `tool_choice`, `parallel_tool_calls`), the request's side: checking
the tools, rendering them through the chat template, constraining `required` / named calls with a
grammar, and parsing the model's output into OpenAI `tool_calls`, whole or as stream deltas. What
each model's calls look like is its format's parser (runtime/serving/tool_parsers/: one class per
format, registered by name).

    tools + tool_choice ──plan()──▶ ToolPlan
        .prepare(messages) -> (messages, tools) for apply_chat_template (the family's form)
        .structured        -> StructuredOutputs for "required" (a JSON array of calls) / a named tool (its arguments)
        .parse(text)       -> (content, [calls])             (a whole response)
        .stream()          -> ToolStream: text so far -> content and tool_call deltas

Formats (ToolPlan.family: a name of tool_parsers.TOOL_PARSERS): the one the chat template's text
tells (family(): the first registered parser whose template markers it has), or the one `kvexport
serve --tool-call-parser NAME` names (plan's `tool_call_parser`). TOOL_FAMILIES says which format
each model family of exporter/families.py gets. A template that does not render `tools` at all
(SmolLM2's, most base models'): the tools go into a system message in the hermes form (as Qwen's
template writes them), calls in earlier assistant turns as `<tool_call>` text and tool results as
`<tool_response>` user turns; parsed as hermes.

Streaming: content streams until a call may begin (the parser's content_end / holds_call); a call's
index, id and name go out once known, then its arguments as they are generated (several `arguments`
fragments, as OpenAI streams them: the parser's call_spans); calls its parser cannot stream
(qwen3_xml's) go out whole at the end.

Legacy `functions` / `function_call` (OpenAI's deprecated names): plan() takes them as tools /
tool_choice (at most one call) and the response carries `function_call` (finish_reason
"function_call") instead of `tool_calls`; earlier turns' `function_call` and `role: function`
messages become tool calls and tool results (legacy_messages).

NOTE: `required` and a named tool do not depend on the family's format: the output is constrained
to JSON (vLLM's way): `required` -> [{"name": N, "parameters": {...}}, ...] (anyOf over the tools;
one item without parallel_tool_calls; read by tool_parsers.REQUIRED_CALLS), named -> the tool's
parameters object, so every call is valid JSON for its schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..execution.structured import check_json_schema
from ..request_checks import RequestError
from ..sampling_params import StructuredOutputs
from .tool_parsers import DEFAULT_PARSER, REQUIRED_CALLS, TOOL_PARSERS, ToolCall, ToolParser, tool_parser

MAX_TOOLS = 128  # tools per request
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function name rule (and '.')

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


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
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise RequestError(f"{at}.function.strict must be true or false, got {f['strict']!r}",
                               f"{at}.function.strict")
        params = f.get("parameters", {"type": "object", "properties": {}})
        check_json_schema(params, f"{at}.function.parameters")
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise RequestError(f"{at}.function.parameters must be a JSON schema of an object", f"{at}.function.parameters")
        out.append({"type": "function", "function": {**f, "parameters": dict(params)}})
    return out


def _has_ref(schema: Any) -> bool:
    if isinstance(schema, Mapping):
        return isinstance(schema.get("$ref"), str) or any(_has_ref(v) for v in schema.values())
    return isinstance(schema, list) and any(_has_ref(v) for v in schema)


def _rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with every local `$ref` ("#...") moved under `base` (a JSON pointer such as "#/$defs/tool0")."""
    if isinstance(schema, Mapping):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase_refs(v, base))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


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
        if not isinstance(name, str):
            raise RequestError(f"tool_choice: the function's name must be a string, got {type(name).__name__}",
                               "tool_choice.function.name")
        if name not in {t["function"]["name"] for t in tools}:
            raise RequestError(f"tool_choice: names the function {name!r}, which is not among the request's tools",
                               "tool_choice.function.name")
        return name
    raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                       '{"name": ...}}', "tool_choice")


def family(template: str | None) -> tuple[str, bool]:
    """(the tool-call format of a chat template: the first registered parser whose template markers it
    has, else hermes; whether the template renders `tools` itself)."""
    t = template or ""
    for p in TOOL_PARSERS.values():
        if p.uses_template(t):
            return p.name, True
    return DEFAULT_PARSER, "tools" in t


# The model families of exporter/families.py whose templates do not render tools (the hermes system
# message, see the module's docstring).
NO_TOOL_TEMPLATES = ("gpt2", "olmo2", "olmo_hybrid", "gemma2", "gemma3_text", "gemma4_text",
                     # LFM2's pythonic calls (<|tool_call_start|>[name(k=v)]<|tool_call_end|>) have no parser yet
                     "lfm2")
# The tool-call format each model family gets from its instruct models' chat templates, from the
# parsers' own model_families (family() reads the template itself; this is what to expect, and a test
# holds every registered family to it): (format, the template text that tells it), or None for
# NO_TOOL_TEMPLATES.
TOOL_FAMILIES: dict[str, tuple[str, str] | None] = {
    **{fam: (p.name, p.template_example) for p in TOOL_PARSERS.values() for fam in p.model_families},
    **dict.fromkeys(NO_TOOL_TEMPLATES)}


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
    family: str  # the tool-call format: a name of tool_parsers.TOOL_PARSERS
    native: bool  # the template renders tools itself
    legacy: bool = False  # sent as `functions` / `function_call`: answered with `function_call`

    def __post_init__(self):
        assert self.family in TOOL_PARSERS, self.family  # plan() and --tool-call-parser take registered names

    @property
    def named(self) -> str | None:
        return self.choice if self.choice not in ("none", "auto", "required") else None

    @property
    def parser(self) -> ToolParser:
        """What reads the output: the format's parser, or for "required" the JSON array its grammar makes."""
        return REQUIRED_CALLS if self.choice == "required" else TOOL_PARSERS[self.family]

    @property
    def structured(self) -> StructuredOutputs | None:
        """The grammar of "required" / a named tool (None for auto and none)."""
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}
        if self.named is not None:
            return StructuredOutputs(json=by_name[self.named])
        if self.choice != "required":
            return None
        # NOTE: a tool's `$ref`s ("#", "#/$defs/X") point into its own parameters; nested in this array they would
        # resolve against the array (issue 48: {"$ref": "#"} took the server's wrapper): then each tool's schema
        # goes under the array's $defs, its references rebased there
        refs = any(_has_ref(p) for p in by_name.values())
        defs = {f"tool{i}": _rebase_refs(p, f"#/$defs/tool{i}") for i, p in enumerate(by_name.values())} if refs else {}
        items = [{"type": "object", "properties": {"name": {"const": n}, "parameters": {"$ref": f"#/$defs/tool{i}"}
                                                   if refs else p},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for i, (n, p) in enumerate(by_name.items())]
        arr = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        if defs:
            arr["$defs"] = defs
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
        return self.parser.parse(text)

    def stream(self) -> "ToolStream":
        return ToolStream(self)


def plan(tools: Any, tool_choice: Any, parallel_tool_calls: Any, template: str | None, *,
         functions: Any = None, function_call: Any = None, tool_call_parser: str | None = None) -> ToolPlan | None:
    """The request's tool plan, or None without tools (tool_choice then must be none/auto/absent).
    `functions` / `function_call`: OpenAI's deprecated names of tools / tool_choice, taken as those
    (at most one call; the response's `function_call`). The output is read in the format `template`
    tells (family()), or in `tool_call_parser`'s (a registered name: `kvexport serve --tool-call-parser`;
    ConfigError otherwise). NOTE: the override changes only how the output is read: tools a template does
    not render still go into the hermes system message (prepare)."""
    legacy = functions is not None or function_call is not None
    if legacy:
        if tools is not None or tool_choice is not None:
            what = "functions" if functions is not None else "function_call"
            raise RequestError(f"{what}: send either tools / tool_choice or the older functions / function_call, "
                               f"not both", what)
        if functions is not None and not isinstance(functions, list):
            raise RequestError("functions must be a list of functions", "functions")
        tools = [{"type": "function", "function": f} for f in functions] if functions else None
        if isinstance(function_call, Mapping):
            tool_choice = {"type": "function", "function": {"name": function_call.get("name")}}
        elif function_call is not None:
            if function_call not in ("none", "auto"):
                raise RequestError('function_call must be "none", "auto" or {"name": ...}', "function_call")
            tool_choice = function_call
        parallel_tool_calls = False
        try:
            checked = check_tools(tools, "functions") if tools is not None else []
            choice = _tool_choice(tool_choice, checked)
        except RequestError as e:  # named as the fields sent: functions[i].name, function_call.name
            param = "function_call.name" if (e.param or "").startswith("tool_choice") else \
                (e.param or "").replace(".function.", ".", 1)
            msg = str(e).replace(".function.", ".").replace("tool_choice", "function_call")
            raise RequestError(msg, param, code=e.code) from None
    else:
        checked = check_tools(tools) if tools is not None else []
        choice = _tool_choice(tool_choice, checked)
    if not checked:
        return None
    if parallel_tool_calls not in (None, True, False):
        raise RequestError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    fam, native = family(template)
    if tool_call_parser is not None:
        fam = tool_parser(tool_call_parser).name
    return ToolPlan(checked, choice, parallel_tool_calls is not False, fam, native, legacy)


def legacy_messages(messages: list[dict]) -> list[dict]:
    """Earlier turns in the deprecated form as tool calling's: an assistant's `function_call` ->
    one tool call, a `role: function` result -> a tool result answering the function's last call."""
    out: list[dict] = []
    last: dict[str, str] = {}  # a function's name -> its last call's id
    for i, m in enumerate(messages):
        fc = m.get("function_call") if isinstance(m, Mapping) else None
        if not isinstance(m, Mapping):
            pass
        elif isinstance(fc, Mapping) and not m.get("tool_calls"):
            cid = f"call_legacy_{i}"
            last[fc.get("name")] = cid
            m = {k: v for k, v in m.items() if k != "function_call"}
            m["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": fc.get("name"),
                                                                            "arguments": fc.get("arguments", "{}")}}]
        elif m.get("role") == "function":
            m = {**{k: v for k, v in m.items() if k != "role"}, "role": "tool",
                 "tool_call_id": last.get(m.get("name"), "call_legacy")}
        out.append(m)
    return out


class ToolStream:
    """Streaming: `add(text so far)` -> (content delta, tool_call deltas). Content streams until a
    call may begin (the parser's content_end: a marker, or text that may be one's start); once the
    rest holds a call's start (holds_call) the text is held back: each call goes out as it is
    generated, first its index, id and name, then its arguments as several fragments (the parser's
    call_spans); `finish(text)` sends what is left (the held text as content when it held no call;
    calls only the whole parse found, e.g. arguments given as a string or a format's calls that
    stream whole, whole). A named tool streams its arguments from the first token; "required"
    streams the calls of its array (tool_parsers.REQUIRED_CALLS: all of the output is calls)."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.parser, self.sent, self.held = plan, plan.parser, 0, False
        self.ids: list[str] = []  # the calls sent so far (their ids)
        self.args_sent: list[int] = []  # characters of each call's arguments sent
        self._named = ToolCall(plan.named, "") if plan.named else None

    def add(self, text: str) -> tuple[str, list[dict]]:
        if self.plan.choice == "none":
            delta, self.sent = text[self.sent:], len(text)
            return delta, []
        if self._named is not None:
            delta, first = text[self.sent:], self.sent == 0
            self.sent = len(text)
            if first:
                self.ids = [self._named.id]
                return "", [{"index": 0, "id": self._named.id, "type": "function",
                             "function": {"name": self._named.name, "arguments": delta}}]
            return "", [{"index": 0, "function": {"arguments": delta}}] if delta else []
        content = ""
        if not self.held:
            cut = self.parser.content_end(text)
            content, self.sent = text[self.sent:cut], cut
            self.held = cut < len(text) and self.parser.holds_call(text[cut:])
        return content, self._spans(text) if self.held else []

    def _spans(self, text: str) -> list[dict]:
        """Deltas for the calls begun in the held text: a new call's header, then its arguments' growth."""
        out = []
        for i, (name, start, end) in enumerate(self.parser.call_spans(text, self.sent)):
            if i == len(self.ids):
                call = ToolCall(name, "")
                self.ids.append(call.id)
                self.args_sent.append(0)
                out.append({"index": i, "id": call.id, "type": "function", "function": {"name": name,
                                                                                      "arguments": ""}})
            args = text[start:end if end is not None else len(text)]
            if len(args) > self.args_sent[i]:
                out.append({"index": i, "function": {"arguments": args[self.args_sent[i]:]}})
                self.args_sent[i] = len(args)
        return out

    def finish(self, text: str) -> tuple[str, list[dict]]:
        """The last deltas once the output is complete."""
        p = self.plan
        if p.choice == "none" or self._named is not None:
            return self.add(text)
        content, deltas = self.add(text)
        whole, calls = p.parse(text)
        if not self.ids and not calls:  # nothing was a call: the held text is content (harmony: the final channel's)
            done, whole = text[:self.sent], whole or ""
            delta, self.sent = whole[len(done):] if whole.startswith(done) else whole, len(text)
            return content + delta, []
        for i, c in enumerate(calls[len(self.ids):], len(self.ids)):  # what the spans did not see
            self.ids.append(c.id)
            deltas.append(c.openai(i))
        return content, deltas

    @property
    def called(self) -> bool:
        return bool(self.ids) or self._named is not None


def _legacy_delta(d: dict) -> dict:
    """A tool_call delta as a legacy `function_call` delta ({"name"?, "arguments"})."""
    f = d.get("function", {})
    return {k: f[k] for k in ("name", "arguments") if k in f}


def stream_choice(index: int, stream: ToolStream, text: str, finish_reason: str | None,
                  logprobs: dict | None) -> dict:
    """One choice of a chat stream chunk with tools: the content and tool_call deltas of the output
    so far (`text`); finish_reason "tool_calls" when it called tools (not for a named tool;
    "function_call" for legacy functions, whose deltas are `function_call` and the first call's only)."""
    content, calls = stream.finish(text) if finish_reason is not None else stream.add(text)
    delta: dict = {}
    if content:
        delta["content"] = content
    if calls and stream.plan.legacy:
        parts = [_legacy_delta(d) for d in calls if d["index"] == 0]
        if parts:
            delta["function_call"] = {"name": "".join(x.get("name", "") for x in parts) or None,
                                      "arguments": "".join(x.get("arguments", "") for x in parts)}
            if delta["function_call"]["name"] is None:
                del delta["function_call"]["name"]
    elif calls:
        delta["tool_calls"] = calls
    if finish_reason == "stop" and stream.called and stream.plan.named is None:
        finish_reason = "function_call" if stream.plan.legacy else "tool_calls"
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def response_message(plan: ToolPlan | None, text: str) -> tuple[dict, str | None]:
    """A whole chat response's message and the finish_reason its calls give: "tool_calls" (None for a
    named tool, as OpenAI answers a forced function: "stop" stays), "function_call" for legacy
    functions (the message's `function_call`, the first call)."""
    if plan is None:
        return {"role": "assistant", "content": text}, None
    content, calls = plan.parse(text)
    msg: dict = {"role": "assistant", "content": content}
    if calls and plan.legacy:
        msg["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        return msg, "function_call" if plan.named is None else None
    if calls:
        msg["tool_calls"] = [c.openai() for c in calls]
    return msg, "tool_calls" if calls and plan.named is None else None


def check_messages(messages: Sequence[Any]) -> None:
    """Assistant tool_calls (or a legacy function_call) in the request's messages, checked
    (RequestError naming the field)."""
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            continue
        fc = m.get("function_call")
        items = [(f"messages[{i}].function_call", fc)] if fc is not None else []
        items += [(f"messages[{i}].tool_calls[{j}].function", c.get("function") if isinstance(c, Mapping) else None)
                  for j, c in enumerate(m.get("tool_calls") or [])]
        for at, f in items:
            if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
                raise RequestError(f"{at}.name must be a string", f"{at}.name")
            args = f.get("arguments")
            if isinstance(args, str):
                try:
                    json.loads(args)
                except ValueError:
                    raise RequestError(f"{at}.arguments is not valid JSON", f"{at}.arguments") from None
            elif not isinstance(args, Mapping):
                raise RequestError(f"{at}.arguments must be a JSON object's text", f"{at}.arguments")


__all__ = ["ToolCall", "ToolPlan", "ToolStream", "check_messages", "check_tools", "family", "legacy_messages",
           "plan", "response_message", "stream_choice", "NO_TOOL_TEMPLATES", "TOOL_FAMILIES", "TOOL_PARSERS"]
