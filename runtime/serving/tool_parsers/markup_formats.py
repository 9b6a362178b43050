"""The tool-call formats whose calls are wrapped in their model's own markup: deepseek (V3's
tool-call tokens around a fenced JSON block), harmony (GPT-OSS channels; the content is the
`final` channel's) and qwen3_xml (Qwen3-Coder / Qwen3.5 XML parameters, whose calls stream whole).

NOTE: harmony's markers are special tokens, which the detokenizer drops (skip_special_tokens=True):
its parser also reads the text with the markers gone (`to=functions.NAME ... {...}`).
"""

from __future__ import annotations

import json
import re

from .base import ToolCall, ToolParser


class DeepSeekParser(ToolParser):
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`
    per call (DeepSeek V3)."""

    name = "deepseek"
    model_families = ("deepseek_v2", "deepseek_v3")
    template_markers = ("tool▁call",)
    template_example = "<｜tool▁calls▁begin｜>"
    markers = ("<｜tool▁calls▁begin｜>",)
    call_start = re.compile(r"<｜tool▁call▁begin｜>\s*\w*\s*<｜tool▁sep｜>\s*([^\n]+)\n```(?:json)?\n(?=\{)")
    _CALL = re.compile(r"<｜tool▁call▁begin｜>\s*\w*\s*<｜tool▁sep｜>\s*([^\n]+)\n```(?:json)?\n(.*?)\n```\s*"
                       r"<｜tool▁call▁end｜>", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find("<｜tool▁calls▁begin｜>")
        if start < 0:
            return text, []
        calls = [ToolCall(name.strip(), args.strip()) for name, args in self._CALL.findall(text[start:])]
        return (text[:start].strip() or None, calls) if calls else (text, [])


class HarmonyParser(ToolParser):
    """`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` per call
    (GPT-OSS), with the markers or without them; the content is the `final` channel's message."""

    name = "harmony"
    model_families = ("gpt_oss",)
    template_markers = ("<|channel|>", "to=functions.")
    template_example = "<|channel|>commentary to=functions."
    markers = ("<|channel|>", "to=functions.")
    call_start = re.compile(r"to=functions\.([A-Za-z0-9_.-]+)(?:[^{<]|<\|[a-z_]+\|>)*?(?=\{)")
    _NAME = re.compile(r"to=functions\.([A-Za-z0-9_.-]+)")
    _FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, pos = [], 0
        while (m := self._NAME.search(text, pos)) is not None:
            brace = text.find("{", m.end())
            if brace < 0:
                break
            try:
                args, end = json.JSONDecoder().raw_decode(text, brace)
            except ValueError:
                break
            calls.append(ToolCall(m.group(1), text[brace:end] if isinstance(args, dict) else json.dumps(args)))
            pos = end
        final = self._FINAL.search(text)
        if not calls:
            return (final.group(1).strip() if final else text), []
        return (final.group(1).strip() or None) if final else None, calls


class Qwen3XmlParser(ToolParser):
    """`<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>` (Qwen3-Coder,
    Qwen3.5): a value is JSON when it reads as JSON, else a string."""

    name = "qwen3_xml"
    model_families = ("qwen3_5_text", "qwen3_5_moe")
    template_markers = ("<function=",)
    template_example = "<tool_call>\n<function="
    markers = ("<tool_call>", "<function=")
    _FUNCTION = re.compile(r"<function=([A-Za-z0-9_.-]+)>(.*?)(?:</function>|$)", re.S)
    _PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            start = text.find("<function=")
        if start < 0:
            return text, []
        calls = [ToolCall(name, json.dumps({k: _value(v) for k, v in self._PARAMETER.findall(body)}))
                 for name, body in self._FUNCTION.findall(text[start:])]
        return (text[:start].strip() or None, calls) if calls else (text, [])

    def call_spans(self, text: str, pos: int = 0) -> list[tuple[str, int, int | None]]:
        """None while the output streams: the arguments are XML parameters, not JSON text to send in
        fragments, so each call goes out whole once the output is complete (tools.ToolStream.finish)."""
        return []


def _value(v: str):
    """A qwen3_xml parameter's value: JSON when it reads as JSON, else the string."""
    try:
        return json.loads(v)
    except ValueError:
        return v
