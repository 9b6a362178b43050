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
    # SmolLM2's own training form: a list inside one tag
    ("hermes", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "f", "arguments": {}}]'
               '</tool_call>', None, [("get_weather", {"city": "Oslo"}), ("f", {})]),
    # GPT-OSS harmony: analysis, then a call on the commentary channel; the content is the final channel's
    ("harmony", '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Kyiv"}<|call|>', None,
     [("get_weather", {"city": "Kyiv"})]),
    ("harmony", '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'
                '<|call|>', None, [("get_weather", {"city": "Oslo"})]),
    # ... and with the special tokens dropped by the detokenizer
    ("harmony", 'analysisNeed weather.assistantcommentary to=functions.get_weather json{"city": "Kyiv"}', None,
     [("get_weather", {"city": "Kyiv"})]),
    ("harmony", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Four.<|return|>",
     "Four.", []),
    ("phi4", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Baku"}}]<|/tool_call|>', None,
     [("get_weather", {"city": "Baku"})]),
    ("phi4", 'functools[{"name": "get_weather", "arguments": {"city": "Baku"}}]', None,
     [("get_weather", {"city": "Baku"})]),
    ("phi4", "No tool needed.", "No tool needed.", []),
    ("granite", 'I will check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Riga"}}, '
                '{"name": "get_time", "arguments": {"tz": "EET"}}]', "I will check.",
     [("get_weather", {"city": "Riga"}), ("get_time", {"tz": "EET"})]),
    ("granite", '[{"name": "get_weather", "arguments": {"city": "Riga"}}]', None,  # the marker dropped
     [("get_weather", {"city": "Riga"})]),
    ("qwen3_xml", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "Sure.",
     [("get_weather", {"city": "San Jose", "days": 3})]),
])
def test_each_family_parses_its_calls(fam, text, content, calls):
    got_content, got = tools.TOOL_PARSERS[fam].parse(text)
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
    whole: dict[int, list] = {}
    for d in calls:  # a call's name first, then its arguments in fragments
        e = whole.setdefault(d["index"], [d["index"], "", ""])
        e[1] += d["function"].get("name", "")
        e[2] += d["function"].get("arguments", "")
    assert [(i, n, json.loads(a)) for i, n, a in whole.values()] == \
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
                                           ("<｜tool▁calls▁begin｜>", "deepseek"), ("<tool_call>", "hermes"),
                                           ("<|start|>assistant<|channel|>analysis", "harmony"),
                                           ("<|system|><|tool|>{{ tools }}<|/tool|>", "phi4"),
                                           ("<|start_of_role|>tools<|end_of_role|><|tool_call|>", "granite"),
                                           ("<tool_call>\n<function=example_function_name>", "qwen3_xml")])
def test_families_are_told_by_their_templates(template, fam):
    assert tools.family(template) == (fam, True)


def test_every_model_family_has_its_tool_family():
    """Each family exporter/families.py registers says which parser its templates get (or none: the
    hermes system message), and its template marker tells that family."""
    from kvexport.exporter.families import FAMILIES

    assert set(FAMILIES) <= set(tools.TOOL_FAMILIES), sorted(set(FAMILIES) - set(tools.TOOL_FAMILIES))
    for name, entry in tools.TOOL_FAMILIES.items():
        if entry is not None:
            assert tools.family(entry[1]) == (entry[0], True), name
            assert entry[0] in tools.TOOL_PARSERS  # parses whole and streaming (tests/runtime/serving/test_tool_parsers.py)


STREAMED = [  # (family, choice, text): calls whose arguments must stream in several fragments
    ("hermes", "auto", 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
                       '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
                       '</tool_call>'),
    ("hermes", "auto", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                       '{"name": "get_time", "arguments": {"tz": "CET"}}]</tool_call>'),
    ("llama3", "auto", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'),
    ("mistral", "auto", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]'),
    ("mistral", "auto", '[TOOL_CALLS]get_weather[ARGS]{"city": "Bonn", "unit": "celsius"}'),
    ("deepseek", "auto", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                         '{"city": "Lima", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("harmony", "auto", '<|channel|>analysis<|message|>Weather {needed}.<|end|><|start|>assistant<|channel|>commentary '
                        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Kyiv", "unit": "celsius"}'
                        '<|call|>'),
    ("phi4", "auto", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Baku", "unit": "celsius"}}]'
                     '<|/tool_call|>'),
    ("granite", "auto", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Riga", "unit": "celsius"}}]'),
    ("hermes", "required", '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                           '{"name": "get_time", "parameters": {"tz": "CET"}}]'),
]


@pytest.mark.parametrize("fam, choice, text", STREAMED)
def test_arguments_stream_in_fragments_that_add_up_to_the_parse(fam, choice, text):
    plan = tools.ToolPlan([WEATHER], choice, True, fam, True)
    st, content, deltas = plan.stream(), "", []
    for k in range(1, len(text) + 1, 2):  # two characters a step
        c, d = st.add(text[:k])
        content, deltas = content + c, deltas + d
    c, d = st.finish(text)
    content, deltas = content + c, deltas + d
    calls: dict[int, dict] = {}
    fragments: dict[int, int] = {}
    for d in deltas:
        e = calls.setdefault(d["index"], {"name": "", "arguments": "", "id": None})
        e["id"] = d.get("id") or e["id"]
        e["name"] += d["function"].get("name", "")
        e["arguments"] += d["function"].get("arguments", "")
        fragments[d["index"]] = fragments.get(d["index"], 0) + bool(d["function"].get("arguments"))
    whole_content, whole = plan.parse(text)
    assert [(e["name"], json.loads(e["arguments"])) for e in calls.values()] == \
        [(c.name, json.loads(c.arguments)) for c in whole]
    assert all(e["id"] and e["id"].startswith("call_") for e in calls.values())
    assert all(n >= 3 for n in fragments.values()), fragments  # arguments as several deltas, not one
    assert (content.strip() or None) == (whole_content if fam != "harmony" else None)
    assert "<tool" not in content and "[TOOL" not in content


def test_legacy_functions_are_taken_as_tools():
    fn = WEATHER["function"]
    p = tools.plan(None, None, None, "", functions=[fn], function_call={"name": "get_weather"})
    assert (p.tools, p.choice, p.parallel, p.legacy) == ([WEATHER], "get_weather", False, True)
    msg, reason = tools.response_message(p, '{"city": "Paris"}')
    assert msg == {"role": "assistant", "content": None,
                   "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}} and reason is None
    p = tools.plan(None, None, None, "", functions=[fn], function_call="auto")
    msg, reason = tools.response_message(p, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                            '</tool_call>')
    assert msg["function_call"]["name"] == "get_weather" and "tool_calls" not in msg and reason == "function_call"
    assert tools.plan(None, None, None, "", functions=[fn], function_call="none").choice == "none"
    assert tools.plan(None, None, None, "", functions=[], function_call="none") is None
    # earlier turns: an assistant's function_call and the function's result
    msgs = tools.legacy_messages([{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": None,
                                   "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                                  {"role": "function", "name": "get_weather", "content": '{"temp": 3}'}])
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert "function_call" not in msgs[1]
    assert msgs[2] == {"role": "tool", "name": "get_weather", "content": '{"temp": 3}',
                       "tool_call_id": msgs[1]["tool_calls"][0]["id"]}


@pytest.mark.parametrize("kw, param", [
    ({"functions": [{"name": "bad name!"}]}, "functions[0].name"),
    ({"functions": [{"name": "f", "parameters": {"type": "bogus"}}]}, "functions[0].parameters"),
    ({"functions": [WEATHER["function"]], "function_call": {"name": "nope"}}, "function_call.name"),
    ({"functions": [WEATHER["function"]], "function_call": "required"}, "function_call"),
    ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions"),
])
def test_bad_legacy_functions_name_their_field(kw, param):
    with pytest.raises(RequestError) as e:
        tools.plan(kw.pop("tools", None), None, None, "", **kw)
    assert e.value.param == param, (e.value.param, str(e.value))
    assert str(e.value).startswith(param.split("[")[0].split(".")[0]) and ".function." not in str(e.value), str(e.value)


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


@pytest.mark.parametrize("cut", [18, 40, 75])
def test_required_calls_cut_by_max_tokens_read_the_same_whole_and_streamed(cut):
    """tool_choice "required" cut short (finish_reason length): the whole parse gave the text as content and no
    call while the stream had sent a call with its arguments so far (round-4 trial). Both now give the calls
    begun, the last one's arguments as far as they got; none begun, the text as content."""
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
            '{"name": "get_time", "parameters": {"tz": "CET"}}]')[:cut]
    plan = tools.ToolPlan([WEATHER], "required", True, "hermes", True)
    st, content, deltas = plan.stream(), "", []
    for k in range(1, len(text) + 1, 3):
        c, d = st.add(text[:k])
        content, deltas = content + c, deltas + d
    c, d = st.finish(text)
    content, deltas = content + c, deltas + d
    streamed: dict[int, list[str]] = {}
    for d in deltas:
        e = streamed.setdefault(d["index"], ["", ""])
        e[0] += d["function"].get("name", "")
        e[1] += d["function"].get("arguments", "")
    whole_content, whole = plan.parse(text)
    assert [(c.name, c.arguments) for c in whole] == [tuple(v) for v in streamed.values()]
    assert (whole_content or "") == content  # no call begun (cut 18): the text is content, both ways
    assert bool(whole) == (cut > 18)
