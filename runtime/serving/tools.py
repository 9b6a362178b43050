"""Tool calling (OpenAI `tools`, `tool_choice`, `parallel_tool_calls`): checking the tools,
rendering them through the chat template, constraining `required` / named calls with a grammar,
and parsing the model's output into OpenAI `tool_calls`, whole or as stream deltas.

    tools + tool_choice ──plan()──▶ ToolPlan
        .prepare(messages) -> (messages, tools) for apply_chat_template (the family's form)
        .structured        -> StructuredOutputs for "required" (a JSON array of calls) / a named tool (its arguments)
        .parse(text)       -> (content, [calls])             (a whole response)
        .stream()          -> ToolStream: text so far -> content and tool_call deltas

Template families (chosen from the chat template's text; each has its parser; TOOL_FAMILIES says
which one each model family of exporter/families.py gets):
  hermes    `<tool_call>{"name", "arguments"}</tool_call>` (Hermes, Qwen 2.5/3, SmolLM3; SmolLM2's own
            training form `<tool_call>[{...}, ...]</tool_call>` too)
  llama3    `<|python_tag|>`? `{"name", "parameters"}` (Llama 3.1-3.3 JSON tool calling), `;`-separated
  mistral   `[TOOL_CALLS][{"name", "arguments"}, ...]` or `[TOOL_CALLS]name[ARGS]{...}` (v11+)
  deepseek  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>` (V3)
  harmony   `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (GPT-OSS);
            the content is the `final` channel's message
  phi4      `<|tool_call|>[{"name", "arguments"}, ...]<|/tool_call|>` or `functools[...]` (Phi-4-mini)
  granite   `<|tool_call|>[{"name", "arguments"}, ...]` (Granite 3.x)
  qwen3_xml `<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>` (Qwen3-Coder,
            Qwen3.5): a value is JSON when it reads as JSON, else a string; its calls stream whole
A template that does not render `tools` at all (SmolLM2's, most base models'): the tools go into a
system message in the hermes form (as Qwen's template writes them), calls in earlier assistant
turns as `<tool_call>` text and tool results as `<tool_response>` user turns; parsed as hermes.

Streaming: content streams until a call may begin; a call's index, id and name go out once known, then
its arguments as they are generated (several `arguments` fragments, as OpenAI streams them): each
family's call start is a pattern (CALL_STARTS) after which the arguments object follows, cut where its
braces close (_json_end).

Legacy `functions` / `function_call` (OpenAI's deprecated names): plan() takes them as tools /
tool_choice (at most one call) and the response carries `function_call` (finish_reason
"function_call") instead of `tool_calls`; earlier turns' `function_call` and `role: function`
messages become tool calls and tool results (legacy_messages).

NOTE: the markers of harmony, phi4, granite and (tekken) mistral are special tokens in their tokenizers,
which the detokenizer drops (skip_special_tokens=True): the harmony and phi4/granite parsers also read
the text with the markers gone (`to=functions.NAME ... {...}`, a leading `[{"name": ...}]`).

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
    if "<|channel|>" in t or "to=functions." in t:
        return "harmony", True
    if "<function=" in t:
        return "qwen3_xml", True
    if "<|tool_call|>" in t or "<|tool|>" in t:
        return ("granite" if "<|start_of_role|>" in t else "phi4"), True
    if "<tool_call>" in t:
        return "hermes", True
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3", True
    return "hermes", "tools" in t


# The tool-call family each model family of exporter/families.py gets from its instruct models' chat
# templates (family() reads the template itself; this table is what to expect, and a test holds every
# registered family to it): (tool family, the template text that tells it) or None where the family's
# templates do not render tools (then the hermes system message, see the module's docstring).
TOOL_FAMILIES: dict[str, tuple[str, str] | None] = {
    "llama": ("llama3", "<|python_tag|>"),  # Llama 3.1-3.3 (SmolLM2's template renders no tools: None's path)
    "mistral": ("mistral", "[TOOL_CALLS]"),
    "mixtral": ("mistral", "[TOOL_CALLS]"),
    "qwen2": ("hermes", "<tool_call>"),
    "qwen2_moe": ("hermes", "<tool_call>"),
    "qwen3": ("hermes", "<tool_call>"),
    "qwen3_moe": ("hermes", "<tool_call>"),
    "qwen3_next": ("hermes", "<tool_call>"),
    "qwen3_5_text": ("qwen3_xml", "<tool_call>\n<function="),
    "qwen3_5_moe": ("qwen3_xml", "<tool_call>\n<function="),
    "smollm3": ("hermes", "<tool_call>"),
    "phi3": ("phi4", "<|tool_call|>"),  # Phi-4-mini (Phi-3's templates render no tools)
    "granite": ("granite", "<|start_of_role|><|tool_call|>"),  # Granite 3.x (no exporter family yet)
    "deepseek_v2": ("deepseek", "<｜tool▁calls▁begin｜>"),
    "deepseek_v3": ("deepseek", "<｜tool▁calls▁begin｜>"),
    "gpt_oss": ("harmony", "<|channel|>commentary to=functions."),
    "gpt2": None, "olmo2": None, "olmo_hybrid": None, "gemma2": None, "gemma3_text": None, "gemma4_text": None,
    # LFM2's pythonic calls (<|tool_call_start|>[name(k=v)]<|tool_call_end|>) have no parser yet: the hermes path
    "lfm2": None,
}


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
    legacy: bool = False  # sent as `functions` / `function_call`: answered with `function_call`

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


def plan(tools: Any, tool_choice: Any, parallel_tool_calls: Any, template: str | None, *,
         functions: Any = None, function_call: Any = None) -> ToolPlan | None:
    """The request's tool plan, or None without tools (tool_choice then must be none/auto/absent).
    `functions` / `function_call`: OpenAI's deprecated names of tools / tool_choice, taken as those
    (at most one call; the response's `function_call`)."""
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
        for item in (vals[0] if vals and isinstance(vals[0], list) else vals[:1]):  # SmolLM2's: a list in the tag
            c = _call(item)
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


_HARMONY = re.compile(r"to=functions\.([A-Za-z0-9_.-]+)")
_HARMONY_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.S)


def parse_harmony(text: str) -> tuple[str | None, list[ToolCall]]:
    """GPT-OSS: `... to=functions.NAME ... <|message|>{args}<|call|>` per call (with the markers, or
    without them when the detokenizer dropped the special tokens); the content is the final channel's."""
    calls, pos = [], 0
    while (m := _HARMONY.search(text, pos)) is not None:
        brace = text.find("{", m.end())
        if brace < 0:
            break
        try:
            args, end = json.JSONDecoder().raw_decode(text, brace)
        except ValueError:
            break
        calls.append(ToolCall(m.group(1), text[brace:end] if isinstance(args, dict) else json.dumps(args)))
        pos = end
    final = _HARMONY_FINAL.search(text)
    if not calls:
        return (final.group(1).strip() if final else text), []
    return (final.group(1).strip() or None) if final else None, calls


_FUNCTOOLS = ("<|tool_call|>", "functools")


def parse_tool_call_list(text: str) -> tuple[str | None, list[ToolCall]]:
    """Phi-4-mini / Granite: `<|tool_call|>[{"name", "arguments"}, ...]` (or `functools[...]`; or a
    leading `[{"name": ...` when the detokenizer dropped the marker)."""
    at = [i for i in (text.find(m) for m in _FUNCTOOLS) if i >= 0]
    start = min(at) if at else (0 if text.lstrip().startswith("[{") or text.lstrip().startswith("{") else -1)
    if start < 0:
        return text, []
    body = text[start:]
    for m in _FUNCTOOLS:
        body = body.replace(m, " ")
    calls: list[ToolCall] = []
    for v in _json_values(body.replace("<|/tool_call|>", " ")):
        for item in (v if isinstance(v, list) else [v]):
            c = _call(item)
            if c is not None:
                calls.append(c)
    return (text[:start].strip() or None, calls) if calls else (text, [])


_XML_FUNCTION = re.compile(r"<function=([A-Za-z0-9_.-]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def parse_qwen3_xml(text: str) -> tuple[str | None, list[ToolCall]]:
    """Qwen3-Coder / Qwen3.5: `<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>`."""
    start = text.find("<tool_call>")
    if start < 0:
        start = text.find("<function=")
    if start < 0:
        return text, []
    calls = []
    for name, body in _XML_FUNCTION.findall(text[start:]):
        args = {}
        for k, v in _XML_PARAMETER.findall(body):
            try:
                args[k] = json.loads(v)
            except ValueError:
                args[k] = v
        calls.append(ToolCall(name, json.dumps(args)))
    return (text[:start].strip() or None, calls) if calls else (text, [])


PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral, "deepseek": parse_deepseek,
           "harmony": parse_harmony, "phi4": parse_tool_call_list, "granite": parse_tool_call_list,
           "qwen3_xml": parse_qwen3_xml}
# where a call starts, per family: text from the first marker on is held back while streaming
MARKERS = {"hermes": ("<tool_call>",), "llama3": ("<|python_tag|>", "{"), "mistral": ("[TOOL_CALLS]",),
           "deepseek": ("<｜tool▁calls▁begin｜>",), "harmony": ("<|channel|>", "to=functions."),
           "phi4": ("<|tool_call|>", "functools["), "granite": ("<|tool_call|>",),
           "qwen3_xml": ("<tool_call>", "<function=")}
# a call's start up to its arguments object, per family (streaming: the name goes out, then the arguments
# as they grow): group 1 is the name; the arguments' "{" follows the match
_JSON_CALL = r'\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
CALL_STARTS = {
    "hermes": re.compile(_JSON_CALL), "llama3": re.compile(_JSON_CALL), "phi4": re.compile(_JSON_CALL),
    "granite": re.compile(_JSON_CALL), "required": re.compile(_JSON_CALL),
    "mistral": re.compile(_JSON_CALL + r"|([A-Za-z0-9_.-]+)\[ARGS\]\s*(?=\{)"),
    "deepseek": re.compile(r"<｜tool▁call▁begin｜>\s*\w*\s*<｜tool▁sep｜>\s*([^\n]+)\n```(?:json)?\n(?=\{)"),
    "qwen3_xml": re.compile(r"(?!x)x()"),  # no JSON arguments in the text: the calls go out whole (finish)
    "harmony": re.compile(r"to=functions\.([A-Za-z0-9_.-]+)(?:[^{<]|<\|[a-z_]+\|>)*?(?=\{)"),
}


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON object opening at text[start] ("{") ends (the index after its "}"), or None
    while it is still open."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def call_spans(fam: str, text: str, pos: int = 0) -> list[tuple[str, int, int | None]]:
    """The calls begun in text[pos:]: (name, where the arguments object starts, where it ends or None
    while it grows), in order; each next call is looked for after the previous one's arguments."""
    pat, out = CALL_STARTS[fam], []
    while (m := pat.search(text, pos)) is not None:
        name = next(g for g in m.groups() if g is not None).strip()
        end = _json_end(text, m.end())
        out.append((name, m.end(), end))
        if end is None:
            break
        pos = end
    return out


class ToolStream:
    """Streaming: `add(text so far)` -> (content delta, tool_call deltas). Content streams until a
    call may begin (a family marker, or text that may be one's start); from there the text is held
    back: each call goes out as it is generated, first its index, id and name, then its arguments
    as several fragments (call_spans); `finish(text)` sends what is left (the held text as content
    when it held no call; calls only the whole parse found, e.g. arguments given as a string, whole).
    A named tool streams its arguments from the first token; "required" streams the calls of its array."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.sent, self.held = plan, 0, False
        self.ids: list[str] = []  # the calls sent so far (their ids)
        self.args_sent: list[int] = []  # characters of each call's arguments sent
        self._named = ToolCall(plan.named, "") if plan.named else None

    @property
    def calls_sent(self) -> int:
        return len(self.ids)

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
                self.ids = [self._named.id]
                return "", [{"index": 0, "id": self._named.id, "type": "function",
                             "function": {"name": self._named.name, "arguments": delta}}]
            return "", [{"index": 0, "function": {"arguments": delta}}] if delta else []
        if p.choice == "required":
            return "", self._spans(text, "required")
        cut = len(text) if self.held else self._cut(text)
        content = ""
        if not self.held:
            content, self.sent = text[self.sent:cut], cut
            self.held = cut < len(text) and any(m in text[cut:] for m in MARKERS[p.family]) or (
                p.family == "llama3" and cut < len(text) and text[cut:].lstrip()[:1] == "{")
        return content, self._spans(text, p.family) if self.held else []

    def _spans(self, text: str, fam: str) -> list[dict]:
        """Deltas for the calls begun in the held text: a new call's header, then its arguments' growth."""
        out = []
        for i, (name, start, end) in enumerate(call_spans(fam, text, self.sent)):
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
           "plan", "response_message", "stream_choice", "CALL_STARTS", "PARSERS", "TOOL_FAMILIES"]
