"""Structured output and tool calling (issue 35) on a real smollm2-135m build: all 53 held-out
JSON schemas (schemas/heldout.json) generated in one batch through the engine, every output valid
(jsonschema); the real `openai` client against `kvexport serve`: chat.completions.parse with a
pydantic model, json_object, vLLM's structured_outputs (regex, choice, grammar), a tools round trip
(call -> tool result -> answer) streaming and not, `auto` calls the model writes on its own (free text
-> the hermes parser -> tool_calls, streamed as name + argument fragments), the deprecated
functions / function_call; the bad inputs, each a 400 naming its field, with the server answering the
next request; and the Python API (kvexport.StructuredOutputs). Triton: test_structured_triton.py."""

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvexport import SamplingParams
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.engine import LLMEngine
from kvexport.runtime.sampling_params import StructuredOutputs

HELDOUT = json.loads((Path(__file__).parent / "schemas" / "heldout.json").read_text())
# NOTE: all 53 in one batch (continuous batching; prefill chunks of 1024 tokens): ~25 s on 2 idle cores,
# smollm2-135m (ONNX attention). Greedy and no penalty, as issue 48 asks: smollm2 loops inside strings
# ("Lady_In_The_Nightingale_Lady_In_The_...") and recursions ({"v": 19, "kids": [{...) until max_tokens;
# closing within the budget (structured.py) ends each of those documents so that it parses and validates
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def engine(smollm2_build):
    return LLMEngine(smollm2_build, EngineConfig(max_num_seqs=64, kv_cache_memory="256MiB",
                                                 max_num_batched_tokens=1024))


def _chat(engine, text: str) -> list[int]:
    return list(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))


def _run(engine, rids: list[str]) -> dict:
    while engine.has_unfinished():
        engine.step()
    return {r: engine.pop_output(r) for r in rids}


def test_heldout_schemas_give_valid_json(engine):
    """All 53 held-out schemas (nested objects, bounded arrays, enums, patterns, anyOf, $ref, formats,
    optional fields, number ranges, ...) as one batch (greedy, no penalty, <= 128 tokens each): every output
    valid, and ended by the grammar (finish "stop"). Before closing within the budget: 50 of 53 (three loops
    cut by max_tokens)."""
    assert len(HELDOUT) == 53 and len({s["name"] for s in HELDOUT}) == 53
    chosen = HELDOUT
    rids = [engine.add_request(_chat(engine, f"Give a short example of a {s['name'].replace('_', ' ')} as JSON "
                                             f"matching this schema: {json.dumps(s['schema'])}"),
                               SamplingParams(max_tokens=MAX_TOKENS, structured=StructuredOutputs(json=s["schema"])))
            for s in chosen]
    outs = _run(engine, rids)
    bad = {}
    for s, r in zip(chosen, rids):
        o = outs[r]
        try:
            jsonschema.validate(json.loads(o.text), s["schema"])
            assert o.finish_reason == "stop"
        except Exception as e:  # noqa: BLE001 - collected, reported together
            bad[s["name"]] = (o.finish_reason, o.text[:200], str(e)[:200])
    assert not bad, bad


def test_regex_choice_grammar_and_n_samples(engine):
    """vLLM's other kinds on the engine; n > 1 samples each get their own matcher (sampled, seeded)."""
    specs = [StructuredOutputs(regex=r"[0-9]{3}-[A-Z]{2}"), StructuredOutputs(choice=["yes", "no", "maybe"]),
             StructuredOutputs(grammar='root ::= "(" [a-c]+ ")"'), StructuredOutputs(json_object=True)]
    rids = []
    for spec in specs:
        for i in range(3):
            rids.append(engine.add_request(_chat(engine, "Answer:"), SamplingParams(
                max_tokens=24, temperature=1.0, seed=7, structured=spec), sample_index=i))
    outs = _run(engine, rids)
    texts = [outs[r].text for r in rids]
    import re

    assert all(re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t) for t in texts[0:3]), texts[0:3]
    assert all(t in ("yes", "no", "maybe") for t in texts[3:6]), texts[3:6]
    assert all(re.fullmatch(r"\([a-c]+\)", t) for t in texts[6:9] if outs[rids[6]].finish_reason == "stop"), texts
    for t, r in zip(texts[9:12], rids[9:12]):
        if outs[r].finish_reason == "stop":
            assert isinstance(json.loads(t), dict), t


# ---- the server, through the openai client --------------------------------------------------
@pytest.fixture(scope="module")
def client(engine):
    """The app over the same engine (its thread owns the engine from here on: the engine tests above ran)."""
    from fastapi.testclient import TestClient

    from kvexport.runtime.serving.server import OpenAIServer, build_app

    with TestClient(build_app(OpenAIServer(engine, "smol"))) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=40_000_000)


def test_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(model="smol", messages=[{"role": "user", "content": "Describe Paris."}],
                                      response_format=City, max_tokens=96)
    assert isinstance(r.choices[0].message.parsed, City), r.choices[0].message.content


def test_json_object_and_structured_outputs_extra(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "A JSON object please"}],
                                       response_format={"type": "json_object"}, max_tokens=48)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model="smol", prompt="The answer is", max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].text in ("left", "right")
    r = client.completions.create(model="smol", prompt="Code:", max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}})
    assert len(r.choices[0].text) == 4 and r.choices[0].text[:2].isupper() and r.choices[0].text[2:].isdigit()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}},
                                       "required": ["tz"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream, choice", [(False, "required"),
                                            (True, {"type": "function", "function": {"name": "get_weather"}})])
def test_tools_round_trip(client, stream, choice):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="smol", tools=[WEATHER, TIME], tool_choice=choice, max_tokens=48)
    if stream:
        calls: dict[int, dict] = {}
        reason = None
        for ch in client.chat.completions.create(messages=msgs, stream=True, **kw):
            for c in ch.choices:
                reason = c.finish_reason or reason
                for d in c.delta.tool_calls or []:
                    e = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    e["id"] = d.id or e["id"]
                    e["name"] += (d.function.name or "") if d.function else ""
                    e["arguments"] += (d.function.arguments or "") if d.function else ""
        got = [(c["id"], c["name"], c["arguments"]) for c in calls.values()]
    else:
        r = client.chat.completions.create(messages=msgs, **kw)
        reason = r.choices[0].finish_reason
        got = [(c.id, c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert got and reason == ("tool_calls" if choice == "required" else "stop"), (got, reason)
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for _, name, args in got:
        jsonschema.validate(json.loads(args), by_name[name]["function"]["parameters"])
    if choice != "required":
        assert got[0][1] == "get_weather"
    # the tool's result goes back; the answer is plain text
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in got]}]
    msgs += [{"role": "tool", "tool_call_id": i, "content": json.dumps({"temp": 21})} for i, _, _ in got]
    r = client.chat.completions.create(model="smol", messages=msgs, tools=[WEATHER, TIME], tool_choice="none",
                                       max_tokens=16)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


# NOTE: smollm2-135m never calls a tool on its own from the tools' system message alone (measured: 0 of 6
# questions, in the hermes form and in SmolLM2's own training form); after one earlier call in the conversation
# (an agent's history) it calls for every weather question tried under greedy decoding (Tokyo, Berlin, Rome,
# Lima: 4 of 4) and answers "What is 2+2?" in plain text
AUTO_HISTORY = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
CITY = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]}}}


def _collect(stream) -> tuple[str, dict[int, dict], str | None, int]:
    """A chat stream's content, calls (index -> id, name, arguments), finish_reason and argument fragments."""
    content, calls, reason, fragments = "", {}, None, 0
    for ch in stream:
        for c in ch.choices:
            reason = c.finish_reason or reason
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                e = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                e["id"] = d.id or e["id"]
                e["name"] += (d.function.name or "") if d.function else ""
                e["arguments"] += (d.function.arguments or "") if d.function else ""
                fragments += bool(d.function and d.function.arguments)
    return content, calls, reason, fragments


@pytest.mark.parametrize("city", ["Tokyo", "Berlin"])
def test_auto_the_model_calls_on_its_own(client, city):
    """tool_choice auto (the default): the model's free text goes through the hermes parser into
    OpenAI tool_calls, whole and streamed (the name, then the arguments in several fragments)."""
    msgs = AUTO_HISTORY + [{"role": "user", "content": f"What is the weather in {city}?"}]
    r = client.chat.completions.create(model="smol", messages=msgs, tools=[CITY], max_tokens=40)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": city}
    assert not c.message.content
    content, calls, reason, fragments = _collect(client.chat.completions.create(
        model="smol", messages=msgs, tools=[CITY], max_tokens=40, stream=True))
    assert reason == "tool_calls" and not content.strip(), (content, calls)
    assert [(e["name"], json.loads(e["arguments"])) for e in calls.values()] == [("get_weather", {"city": city})]
    assert calls[0]["id"].startswith("call_") and fragments >= 3, (calls, fragments)


def test_auto_without_a_call_is_plain_text(client):
    msgs = AUTO_HISTORY + [{"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model="smol", messages=msgs, tools=[CITY], max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    assert "4" in r.choices[0].message.content
    content, calls, reason, _ = _collect(client.chat.completions.create(
        model="smol", messages=msgs, tools=[CITY], max_tokens=16, stream=True))
    assert content == r.choices[0].message.content and not calls and reason == r.choices[0].finish_reason


def test_legacy_functions_and_function_call(client):
    """OpenAI's deprecated `functions` / `function_call` (older clients): taken as tools / tool_choice,
    answered with `function_call` (whole and streamed); the earlier turns' function_call and
    `role: function` results render like tool calls and results."""
    fn = CITY["function"]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="smol", messages=msgs, functions=[fn], function_call={"name": fn["name"]},
                                       max_tokens=32)
    m = r.choices[0].message
    assert m.function_call.name == "get_weather" and not m.tool_calls, m
    jsonschema.validate(json.loads(m.function_call.arguments), fn["parameters"])
    name, args = "", ""
    for ch in client.chat.completions.create(model="smol", messages=msgs, functions=[fn],
                                             function_call={"name": fn["name"]}, max_tokens=32, stream=True):
        for c in ch.choices:
            assert not c.delta.tool_calls
            if c.delta.function_call:
                name += c.delta.function_call.name or ""
                args += c.delta.function_call.arguments or ""
    assert name == "get_weather" and args == m.function_call.arguments
    # auto, after an earlier function_call and its result: the model calls again (as test_auto_...)
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": None, "function_call": {"name": "get_weather",
                                                                        "arguments": '{"city": "Paris"}'}}]
    r = client.chat.completions.create(model="smol", messages=history + [
        {"role": "user", "content": "What is the weather in Tokyo?"}], functions=[fn], max_tokens=40)
    c = r.choices[0]
    assert c.finish_reason == "function_call" and c.message.function_call.name == "get_weather", c
    assert json.loads(c.message.function_call.arguments) == {"city": "Tokyo"}
    r = client.chat.completions.create(model="smol", messages=history + [
        {"role": "function", "name": "get_weather", "content": '{"temp": 21}'}], functions=[fn],
        function_call="none", max_tokens=12)
    assert r.choices[0].message.content and r.choices[0].message.function_call is None


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", "not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}},
     "response_format.json_schema.schema", "not (at /properties/a)"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "cannot be compiled"),
    ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, "structured_outputs.grammar", "cannot be compiled"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
     "tools[0].function.parameters", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not among"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}},
     "tool_choice.function.name", "must be a string"),  # was a 500: unhashable list
    ({"functions": [{"name": "f"}], "function_call": {"name": {}}}, "function_call.name", "must be a string"),
    ({"structured_outputs": {"regex": "a$b"}}, "structured_outputs.regex", "anchor"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict",
     "true or false"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"functions": [{"name": "f", "parameters": {"type": "bogus"}}]}, "functions[0].parameters",
     "not a valid JSON schema"),
    ({"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call.name", "not among"),
    ({"functions": [{"name": "f"}], "tools": [WEATHER]}, "functions", "not both"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
])
def test_bad_input_is_a_400_naming_the_field(client, body, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    extra = {k: body.pop(k) for k in list(body) if k == "structured_outputs"}  # vLLM's field: not the client's
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", extra_body=extra or None, **body)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err
    # the server goes on serving
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].message.content is not None


def test_a_compile_over_the_time_limit_is_refused(smollm2_build):
    """The time limit, made tiny here so a real compile exceeds it (no timing asserted)."""
    from kvexport import manifest as mf
    from kvexport.runtime.execution.structured import GrammarError, StructuredOutputManager
    from kvexport.runtime.tokenizer import load_build_tokenizer

    tok = load_build_tokenizer(Path(smollm2_build), mf.load(Path(smollm2_build)).tokenizer)
    m = StructuredOutputManager(tok, 49152, (2,), compile_timeout_s=1e-6)
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^x{i}[a-z]{{3}}$"}
                                            for i in range(200)}}
    with pytest.raises(GrammarError) as e:
        m.compile(StructuredOutputs(json=big), "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema" and "took longer than" in str(e.value)


def test_the_grammar_cache_is_bounded_by_bytes(smollm2_build, monkeypatch):
    """Compiled grammars are kept by bytes (their xgrammar size plus their spec's text) as well as by count: past
    CACHE_BYTES the least recently used go (the newest stays), and a dropped one compiles again on its next use."""
    from kvexport import manifest as mf
    from kvexport.runtime.execution import structured
    from kvexport.runtime.tokenizer import load_build_tokenizer

    tok = load_build_tokenizer(Path(smollm2_build), mf.load(Path(smollm2_build)).tokenizer)
    m = structured.StructuredOutputManager(tok, 49152, (2,))
    specs = [StructuredOutputs(regex=f"(ab|c{i}){{1,3}}") for i in range(3)]
    m.compile(specs[0])
    one = m.cache_bytes
    assert one > 1000  # a compiled grammar over smollm2's 49k tokens is kilobytes at least
    monkeypatch.setattr(structured, "CACHE_BYTES", int(2.5 * one))
    m.compile(specs[1])
    m.compile(specs[0])  # a hit: now the most recently used
    m.compile(specs[2])  # a third does not fit: the least recently used (specs[1]) goes
    assert [k[1] for k in m._cache] == [specs[0].regex, specs[2].regex] and m.cache_bytes <= 2.5 * one
    monkeypatch.setattr(structured, "CACHE_BYTES", 1)
    m.compile(specs[1])  # the newest stays even alone over the cap
    assert [k[1] for k in m._cache] == [specs[1].regex] and m.cache_bytes == m._sizes[specs[1].key]


def test_the_python_api_exports_what_builds_a_constraint(smollm2_build):
    """`from kvexport import LLM, SamplingParams, StructuredOutputs`: a constraint on the Python API."""
    import kvexport
    from kvexport import LLM
    from kvexport.errors import KvExportError
    from kvexport.runtime import sampling_params

    assert "StructuredOutputs" in kvexport.__all__ and kvexport.StructuredOutputs is sampling_params.StructuredOutputs
    llm = LLM(smollm2_build, kv_cache_memory="32MiB", max_num_seqs=4)
    (out,) = llm.generate("The code is", kvexport.SamplingParams(
        max_tokens=8, structured=kvexport.StructuredOutputs(regex="[A-Z]{3}-[0-9]{2}")))
    import re

    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", out.text), out.text
    (out,) = llm.generate("Paris is in", kvexport.SamplingParams(
        max_tokens=8, structured=kvexport.StructuredOutputs(choice=["France", "Spain"])))
    assert out.text in ("France", "Spain"), out.text
    with pytest.raises(KvExportError) as e:  # a bad one fails alone, naming what is wrong
        llm.generate("x", kvexport.SamplingParams(max_tokens=4, structured=kvexport.StructuredOutputs(regex="[a-")))
    assert "cannot be compiled" in str(e.value)

