"""The tool-call parser interface (ToolParser): what one format's calls look like in a model's
output, read whole and while the output streams; the call it reads (ToolCall); and the JSON
helpers several formats share. The formats are json_formats.py and markup_formats.py; their
registry is this package's __init__.py.

    whole:     parse(text)                 -> (content or None, [ToolCall])
    streaming: content_end(text)           -> how much of the text is content for certain
               holds_call(rest)            -> whether the text from there on holds a call (then held back)
               call_spans(text, pos)       -> [(name, arguments start, arguments end or None)]

A parser keeps no state: a request's stream state is tools.ToolStream's.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

# a JSON call's start up to its arguments object, {"name": N, "arguments" | "parameters": {...}}: group 1 is the
# name; the arguments' "{" follows the match
JSON_CALL = r'\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


class ToolParser:
    """One tool-call format. A subclass sets the class attributes and implements `parse`; the
    streaming methods below serve every format whose call is a marker, a name, then a JSON
    arguments object, and a format that differs overrides the one method where it does."""

    name: str  # the registry's key (`kvexport serve --tool-call-parser NAME`)
    # the model families of exporter/families.py whose chat templates use this format
    model_families: tuple[str, ...] = ()
    # chat-template text that tells this format (any one of them: uses_template), and the text its
    # models' templates have (tools.TOOL_FAMILIES)
    template_markers: tuple[str, ...] = ()
    template_example: str = ""
    # where a call may start in the output: from the first one on, the text is held back while streaming
    markers: tuple[str, ...] = ()
    # a call's start up to its arguments object (streaming: the name goes out, then the arguments as
    # they grow): the first group that matched is the name; the arguments' "{" follows the match
    call_start: re.Pattern

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output -> (the content, or None when only calls were there; the calls). Without
        calls: (text, [])."""
        raise NotImplementedError

    def uses_template(self, template: str) -> bool:
        """Whether a chat template's text tells this format (tools.family asks the registry in order)."""
        return any(m in template for m in self.template_markers)

    def content_end(self, text: str) -> int:
        """How much of `text` is content for certain: up to the first marker, or up to a marker's
        beginning at the end of the text (wait for more)."""
        at = min((i for i in (text.find(m) for m in self.markers) if i >= 0), default=-1)
        return at if at >= 0 else self._before_partial_marker(text)

    def _before_partial_marker(self, text: str) -> int:
        for m in self.markers:
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    return len(text) - k
        return len(text)

    def holds_call(self, rest: str) -> bool:
        """Whether the text from the content's end on (`rest`, not empty) holds a call's start: from
        then on the whole output is held back and only calls stream."""
        return any(m in rest for m in self.markers)

    def arguments_end(self, text: str, start: int) -> int | None:
        """Where the arguments opening at text[start] end (the index after them), or None while they
        are still open: a JSON object's closing brace."""
        return json_end(text, start)

    def call_spans(self, text: str, pos: int = 0) -> list[tuple[str, int, int | None]]:
        """The calls begun in text[pos:]: (name, where the arguments start, where they end or None
        while they grow), in order; each next call is looked for after the previous one's arguments."""
        out: list[tuple[str, int, int | None]] = []
        while (m := self.call_start.search(text, pos)) is not None:
            name = next(g for g in m.groups() if g is not None).strip()
            end = self.arguments_end(text, m.end())
            out.append((name, m.end(), end))
            if end is None:
                break
            pos = end
        return out


# ---- JSON helpers shared by the formats ------------------------------------------------------
def json_call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    """{"name": N, args_key | "parameters" | "arguments": {...} or its text} -> a ToolCall (None if not one)."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters", obj.get("arguments", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def json_calls(values: list[Any]) -> list[ToolCall]:
    """The calls among JSON values, each a call object or a list of them."""
    return [c for v in values for c in map(json_call, v if isinstance(v, list) else [v]) if c is not None]


def json_values(text: str) -> list[Any]:
    """Consecutive JSON values in text (separated by whitespace or ';'); stops at the first non-JSON."""
    dec, i = json.JSONDecoder(), 0
    out: list[Any] = []
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


def json_end(text: str, start: int) -> int | None:
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
