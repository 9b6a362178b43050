"""The tool-call parser registry (runtime/serving/tool_parsers/): every registered format parses
whole and streams (or says its calls stream whole), qwen3_xml's calls go out whole at the end,
and `kvexport serve --tool-call-parser NAME` replaces the template's format: in a plan, through
the server over a real tiny build (smollm2's template: hermes by default), from the CLI; an
unknown name is refused naming the option and the registered names."""

import json
import re

import pytest
from click.testing import CliRunner

from kvexport.cli import main
from kvexport.errors import ConfigError
from kvexport.runtime.serving import tools
from kvexport.runtime.serving.tool_parsers import TOOL_PARSERS, ToolParser, tool_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
LLAMA3_CALL = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
NAMES = "deepseek, granite, harmony, hermes, llama3, mistral, phi4, qwen3_xml"


def test_every_registered_parser_parses_whole_and_streaming():
    assert ", ".join(sorted(TOOL_PARSERS)) == NAMES
    for name, p in TOOL_PARSERS.items():
        assert p.name == name and tool_parser(name) is p
        assert type(p).parse is not ToolParser.parse, name
        # streaming: a call-start pattern for the base call_spans, or its own call_spans (calls that stream whole)
        assert isinstance(getattr(p, "call_start", None), re.Pattern) or type(p).call_spans is not ToolParser.call_spans
        assert p.markers and p.model_families and tools.family(p.template_example) == (name, True), name


def test_qwen3_xml_calls_stream_whole_at_the_end():
    plan = tools.ToolPlan([WEATHER], "auto", True, "qwen3_xml", True)
    text = "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    st, content, deltas = plan.stream(), "", []
    for k in range(1, len(text) + 1, 3):
        c, d = st.add(text[:k])
        content, deltas = content + c, deltas + d
    assert content == "Sure.\n" and deltas == []  # the call is held back while it is generated
    c, d = st.finish(text)
    assert c == "" and len(d) == 1 and d[0]["index"] == 0 and d[0]["id"].startswith("call_")
    assert (d[0]["function"]["name"], json.loads(d[0]["function"]["arguments"])) == ("get_weather", {"city": "Oslo"})


def test_the_override_changes_which_parser_parses():
    default = tools.plan([WEATHER], "auto", None, "<tool_call>")
    assert (default.family, default.native) == ("hermes", True)
    assert default.parse(LLAMA3_CALL) == (LLAMA3_CALL, [])
    plan = tools.plan([WEATHER], "auto", None, "<tool_call>", tool_call_parser="llama3")
    assert (plan.family, plan.native) == ("llama3", True)  # whether the template renders tools is still its own
    content, calls = plan.parse(LLAMA3_CALL)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_an_unknown_parser_names_the_option_and_the_registered_ones():
    with pytest.raises(ConfigError) as e:
        tools.plan([WEATHER], "auto", None, "", tool_call_parser="hermes2")
    assert str(e.value) == f"--tool-call-parser 'hermes2' is not a tool-call parser; give one of: {NAMES}"
    with pytest.raises(ConfigError, match="--tool-call-parser None is not"):
        tool_parser(None)


def test_the_server_reads_calls_in_the_overriding_format(chat_build):
    from dataclasses import replace

    from kvexport.runtime.engine import LLMEngine
    from kvexport.runtime.serving.openai_protocol import ChatCompletionRequest
    from kvexport.runtime.serving.server import OpenAIServer, create_app

    # tool_choice none: the tools are not rendered (the tiny build's context is 64 tokens), the plan is made
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "weather in Oslo?"}],
                                                 "tools": [WEATHER], "tool_choice": "none", "max_tokens": 4})
    engine = LLMEngine(chat_build)
    _, _, default = OpenAIServer(engine, "tiny").prepare(body)
    assert (default.family, default.native) == ("hermes", False)  # smollm2's template renders no tools
    assert tools.response_message(replace(default, choice="auto"), LLAMA3_CALL) == (
        {"role": "assistant", "content": LLAMA3_CALL}, None)
    _, _, plan = create_app(chat_build, tool_call_parser="llama3").state.server.prepare(body)
    assert (plan.family, plan.native) == ("llama3", False)
    msg, reason = tools.response_message(replace(plan, choice="auto"), LLAMA3_CALL)
    assert reason == "tool_calls" and msg["content"] is None
    assert [c["function"] for c in msg["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    with pytest.raises(ConfigError, match="--tool-call-parser 'nope'"):
        OpenAIServer(engine, "tiny", tool_call_parser="nope")


def test_the_cli_passes_the_parser_and_refuses_an_unknown_one_before_loading(tmp_path, monkeypatch):
    from kvexport.runtime.serving import server

    not_a_build = tmp_path / "empty-folder"  # the model is never loaded: the name fails first
    not_a_build.mkdir()
    r = CliRunner().invoke(main, ["serve", str(not_a_build), "--port", "0", "--tool-call-parser", "nope"])
    assert r.exit_code == 2, r.output
    assert "--tool-call-parser 'nope' is not a tool-call parser; give one of:" in r.output and "qwen3_xml" in r.output
    got = {}
    monkeypatch.setattr(server, "serve", lambda *a, **kw: got.update(kw))
    r = CliRunner().invoke(main, ["serve", str(not_a_build), "--port", "0", "--tool-call-parser", "llama3"])
    assert r.exit_code == 0, r.output
    assert got["tool_call_parser"] == "llama3"
    assert NAMES in " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split())
