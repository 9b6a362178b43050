"""Tool-call parsing per template family (runtime/serving/tools.py), whole and as stream deltas;
the tools' rendering through smollm2-135m's real chat template (which ignores `tools`: the hermes
system message) and through a template that renders them itself; and the grammar matcher's
pieces (runtime/execution/structured.py) on smollm2's real tokenizer: the batch mask, and the
draft check / rollback speculative decoding calls. No model runs here."""

import json

import numpy as np
import pytest

from kvexport.runtime.execution.structured import StructuredOutputManager, mask_logits
from kvexport.runtime.request_checks import RequestError
from kvexport.runtime.sampling_params import StructuredOutputs
from kvexport.runtime.serving import tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tok():
    from kvexport.exporter.source import load_tokenizer, resolve

    return load_tokenizer(resolve("smollm2-135m"))


@pytest.mark.parametrize("fam, text, content, calls", [
    ("hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Sure.",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", "no call here", "no call here", []),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "f", "parameters": {}}',
     None, [("get_weather", {"city": "Oslo"}), ("f", {})]),
    ("llama3", "The weather is fine.", "The weather is fine.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', None,
     [("get_weather", {"city": "Rome"})]),
    ("mistral", 'ok [TOOL_CALLS]get_weather[ARGS]{"city": "Bonn"}', "ok", [("get_weather", {"city": "Bonn"})]),
    ("deepseek", "hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Lima"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "hi", [("get_weather", {"city": "Lima"})]),
])
def test_each_family_parses_its_calls(fam, text, content, calls):
    got_content, got = tools.PARSERS[fam](text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_streamed_deltas_add_up_to_the_whole_parse():
    plan = tools.ToolPlan([WEATHER], "auto", True, "hermes", False)
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    st, content, calls = plan.stream(), "", []
    for k in range(1, len(text) + 1, 3):  # the text as it grows, a few characters a step
        c, d = st.add(text[:k])
        content += c
        calls += d
        assert "<tool" not in content  # a marker's start is held back, never sent as content
    c, d = st.finish(text)
    content, calls = content + c, calls + d
    assert content.strip() == "Let me check."
    assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in calls] == \
        [(0, "get_weather", {"city": "Paris"}), (1, "get_weather", {"city": "Rome"})]
    # text that only looked like a call's start goes out as content at the end
    st = plan.stream()
    c1, _ = st.add("a < b <tool")
    c2, d = st.finish("a < b <tool")
    assert c1 + c2 == "a < b <tool" and not d


def test_a_named_tool_streams_its_arguments():
    plan = tools.ToolPlan([WEATHER], "get_weather", True, "hermes", False)
    st = plan.stream()
    parts = [st.add(t)[1] for t in ('{"ci', '{"city": "Pa', '{"city": "Paris"}')]
    assert parts[0][0]["function"]["name"] == "get_weather" and parts[0][0]["id"].startswith("call_")
    assert "".join(p[0]["function"]["arguments"] for p in parts) == '{"city": "Paris"}'


def test_tool_choice_grammars():
    req = tools.ToolPlan([WEATHER], "required", False, "hermes", False).structured
    schema = json.loads(req.json)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"const": "get_weather"}
    named = tools.ToolPlan([WEATHER], "get_weather", True, "hermes", False).structured
    assert json.loads(named.json) == WEATHER["function"]["parameters"]
    assert tools.ToolPlan([WEATHER], "auto", True, "hermes", False).structured is None


def test_tools_render_through_a_template_that_ignores_them(tok):
    plan = tools.plan([WEATHER], "auto", None, tok.chat_template)
    assert (plan.family, plan.native) == ("hermes", False)
    msgs = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]
    m, t = plan.prepare(msgs)
    text = tok.apply_chat_template(m, tools=t, add_generation_prompt=True, tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text
    # tool_choice none: the tools are not shown
    m, t = tools.plan([WEATHER], "none", None, tok.chat_template).prepare(msgs[:1])
    assert "<tools>" not in tok.apply_chat_template(m, tools=t, add_generation_prompt=True, tokenize=False)


def test_a_template_that_renders_tools_gets_them(tok):
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments.city }}"
                "</tool_call>{% endfor %}\n{% endfor %}")
    plan = tools.plan([WEATHER], "auto", None, template)
    assert (plan.family, plan.native) == ("hermes", True)
    m, t = plan.prepare([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}])
    text = tok.apply_chat_template(m, tools=t, chat_template=template, tokenize=False)
    assert text.startswith("[tool get_weather]") and "<tool_call>Oslo</tool_call>" in text  # arguments as an object


@pytest.mark.parametrize("template, fam", [("... [TOOL_CALLS] ...", "mistral"), ("<|python_tag|>", "llama3"),
                                           ("<｜tool▁calls▁begin｜>", "deepseek"), ("<tool_call>", "hermes")])
def test_families_are_told_by_their_templates(template, fam):
    assert tools.family(template) == (fam, True)


def test_bad_tools_name_their_field():
    with pytest.raises(RequestError) as e:
        tools.plan([WEATHER, WEATHER], "auto", None, "")
    assert e.value.param == "tools[1].function.name"
    with pytest.raises(RequestError) as e:
        tools.plan([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None, None, "")
    assert e.value.param == "tools[0].function.parameters"
    with pytest.raises(RequestError) as e:
        tools.plan(None, {"type": "function", "function": {"name": "f"}}, None, "")
    assert e.value.param == "tool_choice.function.name"


def test_mask_and_the_draft_checks_speculation_calls(tok):
    """The batch mask allows exactly the grammar's tokens; validate / fill_along leave the matcher as it
    was; rollback undoes accepted tokens."""
    m = StructuredOutputManager(tok, 49152, (tok.eos_token_id,))
    spec = StructuredOutputs(choice=["yes", "no"])
    a, b = m.matcher(spec), m.matcher(StructuredOutputs(regex="[0-9]+"))
    logits = np.zeros((3, 49152), np.float32)
    mask_logits(logits, [0, 2], [a, b])
    allowed0 = {int(t) for t in np.flatnonzero(np.isfinite(logits[0]))}
    assert allowed0 and all(("yes".startswith(s) or "no".startswith(s)) and s
                            for s in (tok.decode([t]) for t in allowed0))
    assert np.isfinite(logits[1]).all()  # a row without a grammar is untouched
    assert all(tok.decode([t]).isdigit() for t in np.flatnonzero(np.isfinite(logits[2])))
    yes = tok("yes")["input_ids"]
    drafts = yes + [tok.eos_token_id, 5]
    assert a.validate(drafts) == len(yes) + 1  # "yes", the end, then nothing more
    bm = np.zeros((4, 49152 // 32), np.int32)
    assert a.fill_along(drafts[:2], bm, 0) == min(3, len(yes) + 2)
    assert not a.terminated  # left as it was
    for t in yes:
        assert a.accept(t)
    a.rollback(len(yes))
    assert a.validate(tok("no")["input_ids"]) == len(tok("no")["input_ids"])


def test_the_triton_inputs_carry_structured_output():
    """The Triton model's response_format / structured_outputs inputs (JSON text, BYTES tensors)."""
    from kvexport.runtime.serving.requests import RequestParser
    from kvexport.runtime.serving.triton_model import parse_request

    parser = RequestParser(None, 50, 32)
    ids = np.array([1, 2], np.int64)
    _, p, _ = parse_request({"input_ids": ids, "response_format": np.array([b'{"type": "json_object"}'], object)},
                            parser)
    assert p.structured == StructuredOutputs(json_object=True)
    _, p, _ = parse_request({"input_ids": ids, "structured_outputs": np.array([b'{"regex": "[0-9]+"}'], object)},
                            parser)
    assert p.structured == StructuredOutputs(regex="[0-9]+")
    with pytest.raises(RequestError) as e:
        parse_request({"input_ids": ids, "structured_outputs": np.array([b'{"regex": 5}'], object)}, parser)
    assert e.value.param == "structured_outputs.regex"
