"""The tool-call formats whose calls are JSON objects {"name", "arguments" | "parameters"} after a
marker: hermes, llama3, mistral, phi4 and granite; and the JSON array that tool_choice "required"
constrains the output to (REQUIRED_CALLS: no model's format, so not registered by name).

NOTE: the markers of phi4, granite and (tekken) mistral are special tokens in their tokenizers, which
the detokenizer drops (skip_special_tokens=True): the phi4/granite parser also reads a leading
`[{"name": ...}]` without its marker.
"""

from __future__ import annotations

import json
import re

from .base import JSON_CALL, ToolCall, ToolParser, json_call, json_calls, json_values


class HermesParser(ToolParser):
    """`<tool_call>{"name", "arguments"}</tool_call>` per call (Hermes, Qwen 2.5/3, SmolLM3; SmolLM2's
    own training form `<tool_call>[{...}, ...]</tool_call>` too). Also the format of a template that
    does not render `tools` (tools.ToolPlan.prepare writes them in this form)."""

    name = "hermes"
    model_families = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "smollm3")
    template_markers = ("<tool_call>",)
    template_example = "<tool_call>"
    markers = ("<tool_call>",)
    call_start = re.compile(JSON_CALL)
    _BODY = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        # one call a tag, or SmolLM2's list of calls in one tag
        calls = [c for body in self._BODY.findall(text[start:]) for c in json_calls(json_values(body)[:1])]
        return (text[:start].strip() or None, calls) if calls else (text, [])


class Llama3Parser(ToolParser):
    """`<|python_tag|>`? `{"name", "parameters"}`, `;`-separated (Llama 3.1-3.3 JSON tool calling): a
    call only at the start of the output."""

    name = "llama3"
    model_families = ("llama",)  # Llama 3.1-3.3 (SmolLM2's template renders no tools: the hermes system message)
    template_markers = ("<|python_tag|>", "ipython")
    template_example = "<|python_tag|>"
    markers = ("<|python_tag|>", "{")
    call_start = re.compile(JSON_CALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>")
        if not body.startswith("{"):
            return text, []
        calls = [c for c in (json_call(v, "parameters") for v in json_values(body)) if c is not None]
        return (None, calls) if calls else (text, [])

    def content_end(self, text: str) -> int:
        """Nothing, while the output is blank or opens with a call; else all but a marker's beginning."""
        if not text.strip() or text.lstrip().startswith(("{", "<|python_tag|>")):
            return 0
        return self._before_partial_marker(text)


class MistralParser(ToolParser):
    """`[TOOL_CALLS][{"name", "arguments"}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}` (v11+)."""

    name = "mistral"
    model_families = ("mistral", "mixtral")
    template_markers = ("[TOOL_CALLS]",)
    template_example = "[TOOL_CALLS]"
    markers = ("[TOOL_CALLS]",)
    call_start = re.compile(JSON_CALL + r"|([A-Za-z0-9_.-]+)\[ARGS\]\s*(?=\{)")
    _V11 = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\]")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        calls: list[ToolCall] = []
        for part in text[start:].split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            if (m := self._V11.match(part)) is not None:  # v11+: name[ARGS]{...}
                vals = json_values(part[m.end():])
                calls += [ToolCall(m.group(1), json.dumps(vals[0]))] if vals else []
            else:
                calls += json_calls(json_values(part)[:1])
        return (text[:start].strip() or None, calls) if calls else (text, [])


class ToolCallListParser(ToolParser):
    """`<|tool_call|>[{"name", "arguments"}, ...]`; or a leading `[{"name": ...` when the detokenizer
    dropped the marker. Phi-4-mini and Granite 3.x, as their own subclasses (they differ in templates)."""

    _STARTS = ("<|tool_call|>", "functools")
    call_start = re.compile(JSON_CALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = [i for i in (text.find(m) for m in self._STARTS) if i >= 0]
        start = min(at) if at else (0 if text.lstrip().startswith(("[{", "{")) else -1)
        if start < 0:
            return text, []
        body = text[start:]
        for m in self._STARTS:
            body = body.replace(m, " ")
        calls = json_calls(json_values(body.replace("<|/tool_call|>", " ")))
        return (text[:start].strip() or None, calls) if calls else (text, [])


class Phi4Parser(ToolCallListParser):
    """Phi-4-mini: `<|tool_call|>[...]<|/tool_call|>` or `functools[...]`."""

    name = "phi4"
    model_families = ("phi3",)  # Phi-4-mini (Phi-3's templates render no tools)
    template_markers = ("<|tool_call|>", "<|tool|>")
    template_example = "<|tool_call|>"
    markers = ("<|tool_call|>", "functools[")


class GraniteParser(ToolCallListParser):
    """Granite 3.x: `<|tool_call|>[...]`; its templates are told from Phi-4's by their role markers."""

    name = "granite"
    model_families = ("granite",)  # Granite 3.x (no exporter family yet)
    template_markers = ("<|tool_call|>", "<|tool|>")
    template_example = "<|start_of_role|><|tool_call|>"
    markers = ("<|tool_call|>",)

    def uses_template(self, template: str) -> bool:
        return "<|start_of_role|>" in template and super().uses_template(template)


class RequiredCalls(ToolParser):
    """tool_choice "required": the output is the grammar's JSON array [{"name", "parameters"}, ...]
    (tools.ToolPlan.structured), all calls from its first character."""

    name = "required"
    call_start = re.compile(JSON_CALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            return None, [ToolCall(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            # cut short by max_tokens: the calls begun, the last one's arguments as far as they got (what the
            # stream sent: tools.ToolStream), as a named tool's cut arguments are; no call begun: the text as it is
            spans = self.call_spans(text)
            if not spans:
                return text, []
            return None, [ToolCall(name, text[start:end if end is not None else len(text)])
                          for name, start, end in spans]

    def content_end(self, text: str) -> int:
        return 0

    def holds_call(self, rest: str) -> bool:
        return True


REQUIRED_CALLS = RequiredCalls()
