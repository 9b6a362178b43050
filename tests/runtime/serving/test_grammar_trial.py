"""Grammar compiles that cannot run away (issue 48): a compile over the time limit is refused and its
child process killed (nothing keeps computing it), the refusal cached (the same spec again starts no
compile), a queue beyond MAX_PENDING refused as busy (503) and not cached; grammars that admit no
output, `$ref`s outside the schema and pattern + length refused by name; numbers bounded so a
constrained answer always closes. Real xgrammar, the real smollm2 tokenizer; no timing asserted."""

import json
import re
import threading
from pathlib import Path

import pytest
import xgrammar as xgr

from kvexport import manifest as mf
from kvexport.runtime.execution.grammar_trial import CompileTrials
from kvexport.runtime.execution.structured import (MAX_DIGITS, GrammarBusyError, GrammarError,
                                                   StructuredOutputManager, bound_numbers)
from kvexport.runtime.sampling_params import StructuredOutputs
from kvexport.runtime.serving.openai_protocol import ApiError
from kvexport.runtime.tokenizer import load_build_tokenizer

# NOTE: 2,000 optional properties take xgrammar 0.2.8 ~90 s to compile (measured: 1,000 -> 11 s); the limit here is 2 s
SLOW = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}


@pytest.fixture(scope="module")
def tokenizer(smollm2_build):
    return load_build_tokenizer(Path(smollm2_build), mf.load(Path(smollm2_build)).tokenizer)


@pytest.fixture(scope="module")
def manager(tokenizer):
    m = StructuredOutputManager(tokenizer, 49152, (2,), compile_timeout_s=2.0)
    yield m
    m.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_refused_compile_is_killed_and_its_refusal_cached(tokenizer):
    manager = StructuredOutputManager(tokenizer, 49152, (2,), compile_timeout_s=2.0)
    manager.compile(StructuredOutputs(regex="[a-z]+"))  # the child is up
    trials = manager._trials
    (child,) = [c for c in trials._idle if c is not None]
    with pytest.raises(GrammarError) as e:
        manager.compile(StructuredOutputs(json=SLOW), "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema" and e.value.code == "grammar_compile_timeout"
    assert not _alive(child.proc.pid), "the child compiling the refused grammar still runs"
    assert trials.killed == 1
    with pytest.raises(GrammarError) as again:  # cached: no new child, no new compile
        manager.compile(StructuredOutputs(json=SLOW), "response_format.json_schema.schema")
    assert again.value.code == "grammar_compile_timeout" and trials.started == 1
    # the next grammar gets a fresh child and compiles
    assert manager.compile(StructuredOutputs(choice=["yes", "no"])) is not None
    assert trials.started == 2
    manager.close()


def test_a_queue_beyond_the_cap_is_busy_and_not_cached(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[2])
    trials = CompileTrials(info.serialize_json(), timeout_s=3.0, workers=1, max_pending=1)
    try:
        done = threading.Event()
        t = threading.Thread(target=lambda: (pytest.raises(GrammarError, trials.run, StructuredOutputs(json=SLOW),
                                                           "a"), done.set()))
        t.start()
        while trials._pending == 0:
            threading.Event().wait(0.01)
        with pytest.raises(GrammarBusyError) as e:
            trials.run(StructuredOutputs(regex="x+"), "response_format")
        assert e.value.code == "grammar_compile_busy" and ApiError.from_request_error(e.value).status == 503
        t.join()
        assert done.is_set()
        trials.run(StructuredOutputs(regex="x+"), "response_format")  # after the queue drained: compiled
    finally:
        trials.close()


@pytest.mark.parametrize("spec, param", [
    (StructuredOutputs(regex=r"[^\s\S]"), "regex"),
    (StructuredOutputs(grammar="root ::= root"), "grammar"),
    (StructuredOutputs(json={"$ref": "#"}), "json"),
])
def test_a_grammar_that_admits_no_output_is_refused(manager, spec, param):
    with pytest.raises(GrammarError) as e:
        manager.compile(spec)
    assert e.value.param == param and e.value.code in ("empty_grammar", "invalid_grammar"), e.value


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "points outside the schema"),
    ({"$ref": "file:///etc/passwd"}, "points outside the schema"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "put the length into the pattern"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x", "minLength": 2}}},
     "put the length into the pattern"),
    # found by the round-4 trial of our own: each was a 200 whose output did not validate
    ({"type": "object", "properties": {"price": {"type": "number", "multipleOf": 0.25}}}, "multipleOf"),
    ({"type": "integer", "multipleOf": 7}, "multipleOf"),  # enforced, but its digits unbounded
    ({"type": "string", "enum": [1, 2]}, "no value can match it"),
    ({"type": "number", "maximum": float("nan")}, "nan (at /maximum) is not a JSON number"),  # was xgrammar's internals
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "const": -1}}}, "const value -1"),
    ({"type": "string", "enum": ["a", 1]}, "enum value 1 "),
    ({"type": "object", "required": ["zz"], "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
     'required property "zz"'),
])
def test_schema_parts_the_grammar_would_drop_are_refused(manager, schema, words):
    with pytest.raises(GrammarError) as e:
        manager.compile(StructuredOutputs(json=schema), "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema" and words in str(e.value), e.value


@pytest.mark.parametrize("spec", [
    StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0},
                                                              "x": {"type": "number"}}, "required": ["n", "x"]}),
    StructuredOutputs(json_object=True),
])
def test_numbers_are_bounded_so_the_json_can_close(manager, spec):
    m = xgr.GrammarMatcher(manager.compile(spec))
    assert m.accept_string(('{"n": ' if spec.json else '{"k": ') + "1" * MAX_DIGITS)
    assert not m.accept_string("1"), "an integral digit beyond MAX_DIGITS was allowed"
    assert m.accept_string(', "x": 0.' if spec.json else ".")
    assert m.accept_string("5" * (MAX_DIGITS - 1)) and not m.accept_string("5"), "an unbounded fraction"
    assert m.accept_string("}")


@pytest.mark.parametrize("regex", ["a$b", "x^y", "(a|^b)"])
def test_an_anchor_inside_a_regex_is_refused(manager, regex):
    """xgrammar ignores `^` / `$` in the middle of a pattern ("a$b" produced "ab", which the regex does not match)."""
    with pytest.raises(GrammarError, match="anchor") as e:
        manager.compile(StructuredOutputs(regex=regex))
    assert e.value.param == "regex"


@pytest.mark.parametrize("regex", ["^abc$", "[^a]+x", r"a\$b", "[$^]x", "[a^]y"])
def test_anchors_at_the_ends_escaped_or_in_classes_are_taken(manager, regex):
    manager.compile(StructuredOutputs(regex=regex))


def test_choices_outside_the_bmp_are_matched_exactly(manager, tokenizer):
    """A choice with an emoji: escaped as JSON surrogate pairs, xgrammar read two lone surrogates and forced
    bytes that are no UTF-8 (the output was '' or 'no '). Each choice's own tokens must be accepted whole."""
    choices = ["yes 👍", "no 👎", "𝔘"]
    compiled = manager.compile(StructuredOutputs(choice=choices))
    for c in choices:
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(c) and m.is_completed(), c


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer", "minimum": 0, "maximum": 8, "multipleOf": 2}, ["0", "4", "8"], ["3", "10", "-2", "44"]),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 30, "multipleOf": 7}, ["7", "28"], ["0", "35"]),
])
def test_a_bounded_integer_multiple_of_is_enforced(manager, schema, good, bad):
    """xgrammar ignores multipleOf with a range (the held-out schema "number_multiple" passed by luck): written out as
    an enum it is exact; {"minimum": 1, "maximum": 3, "multipleOf": 5} admits nothing and is refused."""
    compiled = manager.compile(StructuredOutputs(json=schema))
    for text in good:
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(text) and m.is_completed(), text
    for text in bad:
        m = xgr.GrammarMatcher(compiled)
        assert not (m.accept_string(text) and m.is_completed()), text
    with pytest.raises(GrammarError, match="no value can match it"):
        manager.compile(StructuredOutputs(json={"type": "integer", "minimum": 1, "maximum": 3, "multipleOf": 5}))


def test_bound_numbers_leaves_other_repetitions_alone():
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps({"type": "array", "items": {"type": "number"}}),
                                            any_whitespace=False))
    out = bound_numbers(ebnf)
    digit_rules = re.findall(r"^(\w+) ::= \(\(\[0-9\]\)\)$", out, re.M)
    assert "[0-9]*" not in out and digit_rules and all(f"{r}{{1, -1}}" not in out for r in digit_rules)
    assert "basic_array_items{0, -1}" in out  # arrays stay as long as the schema allows
    assert out.count("::=") == ebnf.count("::=")


def test_a_dead_end_inside_the_output_fails_that_request_alone(manager, tokenizer):
    """The trial sees the first token only; a grammar whose second token cannot exist is caught at its
    mask: reported (the row left unmasked) so the runner fails that request, not a NaN-weights error,
    and the other rows of the step are masked as usual."""
    import numpy as np

    from kvexport.runtime.execution.structured import mask_logits

    dead_end = manager.matcher(StructuredOutputs(grammar='root ::= "a" x\nx ::= x "b"'))
    fine = manager.matcher(StructuredOutputs(regex="[0-9]+"))
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    assert dead_end.accept(a)
    logits = np.zeros((3, 49152), np.float32)
    assert mask_logits(logits, [0, 2], [dead_end, fine]) == [0]
    assert np.isfinite(logits[0]).all()  # left for the runner to fail
    assert np.isfinite(logits[2]).sum() < 49152 and np.isfinite(logits[2]).any()


def test_a_tools_references_resolve_in_its_own_parameters(manager):
    """tool_choice "required" nests each tool's parameters in an array of calls; a `$ref` of the tool's
    (a pydantic model's `#/$defs/...`, or `#` itself) must point into its own parameters, never the array."""
    from kvexport.runtime.serving import tools

    unit = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
            "$defs": {"Unit": {"enum": ["c", "f"]}}}
    plan = tools.ToolPlan(tools.check_tools([{"type": "function", "function": {"name": "temp", "parameters": unit}}]),
                          "required", False, "hermes", False)
    m = xgr.GrammarMatcher(manager.compile(plan.structured, "tools"))
    assert m.accept_string('[{"name": "temp", "parameters": {"unit": "c"}}]') and m.accept_token(2)  # 2: the end
    m = xgr.GrammarMatcher(manager.compile(plan.structured, "tools"))
    assert not m.accept_string('[{"name": "temp", "parameters": {"unit": "k"')
    with pytest.raises(GrammarError) as e:  # itself, forever: refused with the tool (before: the server's array)
        tools.check_tools([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}])
    assert e.value.param == "tools[0].function.parameters" and "refers only to itself" in str(e.value)


def test_a_bounded_number_closes_and_a_cut_answer_says_length(smollm2_build):
    """Greedy smollm2 asked for a long number under an integer schema: at most MAX_DIGITS digits, then the
    grammar ends it (finish "stop"); an object cut by max_tokens finishes with "length"."""
    from kvexport import LLM, SamplingParams

    llm = LLM(smollm2_build, kv_cache_memory="32MiB", max_num_seqs=2)
    (out,) = llm.generate("Write the number one hundred digits long, all ones: 1111111111111111111111",
                          SamplingParams(max_tokens=40, structured=StructuredOutputs(json={"type": "integer"})))
    assert out.finish_reason == "stop" and len(out.text.lstrip("-")) <= MAX_DIGITS and int(out.text) is not None
    (cut,) = llm.generate("A person as JSON:", SamplingParams(max_tokens=3, structured=StructuredOutputs(json={
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})))
    assert cut.finish_reason == "length", cut


def test_a_dropped_manager_takes_its_child_with_it(tokenizer):
    """An engine dropped without close() (a script's LLM, a test's) leaves no compile process behind."""
    import gc

    m = StructuredOutputManager(tokenizer, 49152, (2,))
    m.compile(StructuredOutputs(regex="a+"))
    (child,) = [c for c in m._trials._idle if c is not None]
    pid = child.proc.pid
    del m, child
    gc.collect()
    assert not _alive(pid)


def _run_loop(matcher, tokenizer, text: str, budget: int, ranked=list) -> tuple[str, int]:
    """A stand-in model that wants `text`'s tokens in turn (a small model's loop), each sampled through
    Matcher.keep_closable with `budget` tokens in all: the text emitted and the tokens it took. (Once a token
    is replaced, the stand-in's next ones may break the grammar: keep_closable replaces those too.)"""
    want = tokenizer.encode(text, add_special_tokens=False)
    toks: list[int] = []
    while len(toks) < budget and not matcher.terminated:
        t = matcher.keep_closable(want[len(toks)], budget - len(toks), ranked)
        assert matcher.accept(t)
        toks.append(t)
    return tokenizer.decode([t for t in toks if t != 2]), len(toks)  # 2: the end of sequence


@pytest.mark.parametrize("budget", [20, 40, 100])
def test_a_loop_inside_a_string_or_a_recursion_still_closes_within_max_tokens(manager, tokenizer, budget):
    """Issue 48 §2: a model looping inside a string or a recursion ends, within its budget, in a document that
    parses and validates, the grammar ending it (the end-of-sequence token last); the model's own likelier
    tokens are taken where they close; far from the end nothing is changed."""
    import jsonschema

    from kvexport.runtime.execution.structured import CLOSING_WINDOW

    book = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
            "required": ["title", "year"], "additionalProperties": False}
    loop = '{"title": "' + " Lady" * 200
    text, used = _run_loop(manager.matcher(StructuredOutputs(json=book)), tokenizer, loop, budget)
    jsonschema.validate(json.loads(text), book)
    assert used <= budget and text.count(" Lady") >= budget - 16, (text, used)  # the loop ran until the end neared
    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["v"], "additionalProperties": False}
    text, used = _run_loop(manager.matcher(StructuredOutputs(json=tree)), tokenizer, '{"v": 1, "kids": [' * 60, budget)
    jsonschema.validate(json.loads(text), tree)
    assert used <= budget and text.count("{") >= budget // 12, (text, used)
    # the model's second choice closes the string: taken rather than the plan's first token
    (quote,) = tokenizer.encode('"', add_special_tokens=False)
    (quote_comma,) = tokenizer.encode('",', add_special_tokens=False)
    text, used = _run_loop(manager.matcher(StructuredOutputs(json=book)), tokenizer, loop, budget,
                           ranked=lambda: [quote_comma, quote])
    assert '",' in text and json.loads(text)["title"].startswith(" Lady"), text
    (lady,) = tokenizer.encode(" Lady", add_special_tokens=False)
    assert manager.matcher(StructuredOutputs(json=book)).keep_closable(lady, CLOSING_WINDOW + 1) == lady


def test_a_budget_shorter_than_any_close_is_cut_with_length_not_bent(manager, tokenizer):
    """No way to end fits the tokens left (a required nested object at 5 tokens): the model's tokens are kept
    (max_tokens cuts the output, finish "length" in the engine: test_a_bounded_number_closes_...)."""
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}},
                                                     "required": ["b"]}}, "required": ["a"]}
    m = manager.matcher(StructuredOutputs(json=schema))
    assert m.closing(5) is None and m.closing(40) is not None
    (brace,) = tokenizer.encode("{", add_special_tokens=False)
    assert m.keep_closable(brace, 5) == brace
