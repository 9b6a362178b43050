"""kvexport.runtime.serving.tool_parsers: the tool-call formats, one class each (as vLLM's
entrypoints/openai/tool_parsers/), and their registry by name. tools.py (the request's side: the
tools checked, rendered and the output parsed into OpenAI tool_calls) picks one per request: the
format its chat template tells (tools.family), or the one `kvexport serve --tool-call-parser NAME` names.

    base.py            ToolParser (parse whole; stream: content end, held call, call spans), ToolCall
    json_formats.py    hermes, llama3, mistral, phi4, granite; REQUIRED_CALLS (tool_choice "required")
    markup_formats.py  deepseek, harmony, qwen3_xml

NOTE: imports nothing but the standard library and kvexport.errors: `kvexport serve --help` lists the names.
"""

from __future__ import annotations

from kvexport.errors import ConfigError

from .base import ToolCall, ToolParser
from .json_formats import REQUIRED_CALLS, GraniteParser, HermesParser, Llama3Parser, MistralParser, Phi4Parser
from .markup_formats import DeepSeekParser, HarmonyParser, Qwen3XmlParser

# NOTE: in the order chat templates are told apart (tools.family: the first whose template markers a
# template has): a Qwen3.5 template also has hermes' `<tool_call>`, a Granite one Phi-4's `<|tool_call|>`
TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (
    MistralParser(), DeepSeekParser(), HarmonyParser(), Qwen3XmlParser(), GraniteParser(), Phi4Parser(),
    HermesParser(), Llama3Parser())}
DEFAULT_PARSER = "hermes"  # a template that tells no format (tools.family)


def tool_parser(name: str) -> ToolParser:
    """The registered parser named `name`; ConfigError naming --tool-call-parser and the names otherwise."""
    if not isinstance(name, str) or name not in TOOL_PARSERS:
        raise ConfigError(f"--tool-call-parser {name!r} is not a tool-call parser; give one of: "
                          f"{', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


__all__ = ["DEFAULT_PARSER", "REQUIRED_CALLS", "TOOL_PARSERS", "ToolCall", "ToolParser", "tool_parser"]
