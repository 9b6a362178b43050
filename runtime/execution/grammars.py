"""One structured-output spec made into an xgrammar grammar: the checks a JSON schema must pass (the
keywords xgrammar would not enforce, `$ref`s outside the schema or only to themselves), the numbers bounded
(`bound_numbers`), the compile itself (`compile_spec`) and the check that the grammar admits some output
(`check_admits_output`). Used by the server (structured.py) and by the trial's child process
(grammar_trial.py), which is why it stands apart from both.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from ..request_checks import RequestError
from ..sampling_params import StructuredOutputs


class GrammarError(RequestError):
    """A structured-output spec that cannot be served: invalid, unsupported, too slow to compile."""


# JSON-schema keywords xgrammar 0.2.8 compiles without enforcing (measured: bench/structured.py; the
# tests try each): refused by name. `allOf` is refused with more than one branch (xgrammar: "support
# for allOf with multiple options is still ongoing").
UNSUPPORTED_KEYWORDS = frozenset({
    "uniqueItems", "not", "if", "then", "else", "contains", "minContains", "maxContains", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems"})
# keywords whose value is a map of names to subschemas / a list of subschemas: walked as schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems")


def check_json_schema(schema: Any, param: str) -> None:
    """Refuse (GrammarError naming `param`) a schema that is not valid JSON Schema (jsonschema's
    metaschema check) or uses a keyword in UNSUPPORTED_KEYWORDS (named, with where it is)."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{param} must be a JSON schema (an object), got {type(schema).__name__}", param)
    where = _non_finite(schema, "")
    if where is not None:  # NOTE: Python's json reads NaN / Infinity; JSON has neither (xgrammar's parser fails)
        raise GrammarError(f"{param}: {where[1]} (at {where[0] or '/'}) is not a JSON number; use a finite number",
                           param)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the top level"
        raise GrammarError(f"{param} is not a valid JSON schema (at {where}): {e.message}", param) from None

    def walk(s: Any, path: str) -> None:
        if not isinstance(s, dict):
            return
        bad = sorted(UNSUPPORTED_KEYWORDS & s.keys())
        if bad:
            raise GrammarError(f"{param}: the JSON-schema keyword{'s' if len(bad) > 1 else ''} {', '.join(bad)} "
                               f"(at {path or '/'}) {'are' if len(bad) > 1 else 'is'} not supported by this server's "
                               f"constrained decoding; remove {'them' if len(bad) > 1 else 'it'} and check the "
                               f"output yourself", param, code="unsupported_schema_keyword")
        ref = s.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise GrammarError(f"{param}: \"$ref\": {ref[:100]!r} (at {path or '/'}) points outside the schema; this "
                               f"server resolves only references within it (\"#/$defs/...\") and fetches nothing: "
                               f"put the referenced schema under $defs", param, code="unsupported_schema_keyword")
        lengths = sorted({"minLength", "maxLength"} & s.keys())
        if "pattern" in s and lengths:
            raise GrammarError(f"{param}: pattern together with {' and '.join(lengths)} (at {path or '/'}) is not "
                               f"enforced by this server's constrained decoding (the pattern alone is); put the "
                               f"length into the pattern (e.g. {{1,3}}) and drop {' and '.join(lengths)}", param,
                               code="unsupported_schema_keyword")
        multiples = _multiples(s) if "multipleOf" in s else ()
        if multiples == []:
            raise GrammarError(f"{param}: no integer between the bounds (at {path or '/'}) is a multiple of "
                               f"{s['multipleOf']}: no value can match it; fix the bounds or multipleOf", param,
                               code="invalid_grammar")
        if multiples is None:
            raise GrammarError(f"{param}: multipleOf (at {path or '/'}) is enforced by this server's constrained "
                               f"decoding only on integers with a minimum and a maximum that leave at most "
                               f"{MAX_MULTIPLES:,} values; list the allowed values as an enum, or remove it and check "
                               f"the output yourself", param, code="unsupported_schema_keyword")
        _check_values(schema, s, path, param)
        _check_required(s, path, param)
        if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
            raise GrammarError(f"{param}: allOf with more than one schema (at {path or '/'}) is not supported by "
                               f"this server's constrained decoding; merge them into one schema", param,
                               code="unsupported_schema_keyword")
        for k in _SCHEMA_MAPS:
            if isinstance(s.get(k), dict):
                for name, sub in s[k].items():
                    walk(sub, f"{path}/{k}/{name}")
        for k in _SCHEMA_LISTS:
            if isinstance(s.get(k), list):
                for i, sub in enumerate(s[k]):
                    walk(sub, f"{path}/{k}/{i}")
        for k in _SCHEMA_ONE:
            walk(s.get(k), f"{path}/{k}")

    walk(schema, "")
    _check_ref_cycles(schema, param)


MAX_MULTIPLES = 1024  # values an integer multipleOf with bounds may leave (written out as an enum)
_VALUE_KEYS = ("enum", "const", "default", "examples")  # values, not schemas: never rewritten


def _multiples(s: dict) -> list[int] | None:
    """The integers an integer schema's `multipleOf` with `minimum`/`exclusiveMinimum` and `maximum`/
    `exclusiveMaximum` admits (at most MAX_MULTIPLES), or None when it is not such a schema. NOTE: xgrammar
    0.2.8 ignores multipleOf on numbers and on integers with a range, and leaves the digits of an unbounded
    one unbounded; written out as an enum it is exact."""
    import math

    m = s.get("multipleOf")
    if s.get("type") != "integer" or isinstance(m, bool) or not isinstance(m, (int, float)) or m <= 0 or m != int(m):
        return None

    num = lambda k: isinstance(s.get(k), (int, float)) and not isinstance(s.get(k), bool)  # noqa: E731
    try:  # NOTE: json.loads reads Infinity: ceil/floor of it overflow
        lows = ([math.ceil(s["minimum"])] if num("minimum") else []) + \
            ([math.floor(s["exclusiveMinimum"]) + 1] if num("exclusiveMinimum") else [])
        highs = ([math.floor(s["maximum"])] if num("maximum") else []) + \
            ([math.ceil(s["exclusiveMaximum"]) - 1] if num("exclusiveMaximum") else [])
    except (OverflowError, ValueError):
        return None
    if not lows or not highs:
        return None
    lo, hi, m = max(lows), min(highs), int(m)
    first = -(-lo // m) * m  # the first multiple >= lo
    if first <= hi and (hi - first) // m + 1 > MAX_MULTIPLES:
        return None
    return list(range(first, hi + 1, m))  # [] when no multiple lies in the range


def enumerate_multiples(schema: Any) -> Any:
    """`schema` with every integer `multipleOf` (bounded: `_multiples`) written out as an `enum` of its values."""
    if isinstance(schema, list):
        return [enumerate_multiples(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _VALUE_KEYS else enumerate_multiples(v)) for k, v in schema.items()}
    values = _multiples(schema) if "multipleOf" in schema else None
    if values is not None:
        for k in ("multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            out.pop(k, None)
        out["enum"] = [v for v in values if v in schema["enum"]] if isinstance(schema.get("enum"), list) else values
    return out


def _check_values(root: Any, s: dict, path: str, param: str) -> None:
    """Refuse `enum` / `const` values that the rest of their schema does not admit ({"type": "string",
    "enum": [1, 2]}): xgrammar takes the listed values and drops the rest of the schema, so the output
    would not validate; none admitted: the schema admits no value at all."""
    import jsonschema

    values = s["enum"] if isinstance(s.get("enum"), list) else [s["const"]] if "const" in s else None
    rest = {k: v for k, v in s.items() if k not in ("enum", "const") and k not in _ANNOTATIONS}
    if not values or not rest or _refers(rest):  # NOTE: a $ref would resolve against this piece, not the schema
        return
    check = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)(rest)
    bad = [v for v in values if not check.is_valid(v)]
    if bad:
        which = "enum" if "enum" in s else "const"
        shown = ", ".join(json.dumps(v)[:40] for v in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise GrammarError(f"{param}: {which} value{'s' if len(bad) > 1 else ''} {shown} (at {path or '/'}) "
                           f"{'are' if len(bad) > 1 else 'is'} not allowed by the rest of that schema (its type or "
                           f"bounds){': no value can match it' if len(bad) == len(values) else ''}; make them agree",
                           param, code="invalid_grammar")


def _refers(s: Any) -> bool:
    if isinstance(s, dict):
        return "$ref" in s or any(_refers(v) for v in s.values())
    return isinstance(s, list) and any(_refers(v) for v in s)


def _check_required(s: dict, path: str, param: str) -> None:
    """Refuse `required` names that `properties` does not list: the server's grammars (strict mode) admit only
    listed properties, so such an object could never be written."""
    required, props = s.get("required"), s.get("properties")
    if not isinstance(required, list) or not required:
        return
    listed = props.keys() if isinstance(props, dict) else set()
    missing = [r for r in required if isinstance(r, str) and r not in listed]
    if missing:
        raise GrammarError(f"{param}: required propert{'ies' if len(missing) > 1 else 'y'} "
                           f"{', '.join(json.dumps(m) for m in missing[:5])} (at {path or '/'}) "
                           f"{'are' if len(missing) > 1 else 'is'} not in its properties; this server admits only "
                           f"listed properties: add {'them' if len(missing) > 1 else 'it'} to properties",
                           param, code="invalid_grammar")


def _non_finite(v: Any, path: str) -> tuple[str, str] | None:
    """(where, the value) of the first NaN / Infinity in a parsed JSON value, or None."""
    import math

    if isinstance(v, float) and not math.isfinite(v):
        return path, str(v)
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, sub in items:
        found = _non_finite(sub, f"{path}/{k}")
        if found is not None:
            return found
    return None


def check_regex_anchors(regex: str, param: str) -> None:
    """Refuse `^` / `$` anywhere but at the start / end of the pattern (outside character classes, unescaped):
    xgrammar ignores an anchor in the middle ("a$b" matched "ab"). The output always matches the whole pattern."""
    i, in_class = 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if regex[i + 1:i + 2] == "^":
                i += 1
            if regex[i + 1:i + 2] == "]":  # a literal ] first in a class
                i += 1
        elif (c == "^" and i > 0) or (c == "$" and i < len(regex) - 1):
            raise GrammarError(f"{param}: the anchor {c!r} at position {i} of the regex is not at its "
                               f"{'start' if c == '^' else 'end'}; this server matches the whole output against the "
                               f"whole pattern and does not enforce anchors in the middle: remove it", param,
                               code="invalid_grammar")
        i += 1


_ANNOTATIONS = frozenset({"$ref", "$defs", "definitions", "title", "description", "$comment", "$schema", "$id",
                          "examples", "default"})


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` ("#", "#/$defs/X") points at; None when it points nowhere."""
    node = root
    for part in ref[1:].lstrip("/").split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _check_ref_cycles(schema: Any, param: str) -> None:
    """Refuse a `$ref` that leads only to `$ref`s back to itself ({"$ref": "#"}: a value that never begins;
    the grammar admits a prefix and then no token)."""
    def refs(s: Any):
        if isinstance(s, dict):
            if isinstance(s.get("$ref"), str) and s["$ref"].startswith("#"):
                yield s["$ref"]
            for v in s.values():
                yield from refs(v)
        elif isinstance(s, list):
            for v in s:
                yield from refs(v)

    for ref in set(refs(schema)):
        seen, cur = {ref}, ref
        while True:
            target = _resolve(schema, cur)
            if not isinstance(target, dict) or not isinstance(target.get("$ref"), str) or target.keys() - _ANNOTATIONS:
                break
            cur = target["$ref"]
            if cur in seen:
                raise GrammarError(f"{param}: \"$ref\": {ref!r} refers only to itself (through {' -> '.join(sorted(seen))}): "
                                   f"no value can match it; give the referenced schema a type", param,
                                   code="invalid_grammar")
            seen.add(cur)


MAX_DIGITS = 16  # digits of a JSON number's integral part at most; its fraction and exponent: MAX_DIGITS - 1
_DIGIT_RULE = re.compile(r"^(\w+) ::= \(\(\[0-9\]\)\)$", re.M)  # a rule that is one digit: `name ::= (([0-9]))`
_UNBOUNDED = re.compile(r"(\w+)\{(\d+), -1\}")  # `rule{k, -1}`: k or more


def bound_numbers(ebnf: str) -> str:
    """xgrammar's EBNF for a JSON schema with every run of digits bounded: `[0-9]*` and a digit rule's
    `{k, -1}` repetition take at most MAX_DIGITS - 1 digits (so an integral part is at most MAX_DIGITS
    long, as llama.cpp's JSON-schema grammars bound it). NOTE: unbounded, a small model's loop
    (`"population": 1111111111...`) became the whole output until max_tokens cut the JSON (issue 48);
    bounded, the grammar makes it close. Whitespace needs no bound: the grammars allow none (any_whitespace
    off). The language only shrinks (a valid output stays valid for the schema)."""
    digit_rules = set(_DIGIT_RULE.findall(ebnf))
    ebnf = ebnf.replace("[0-9]*", f"[0-9]{{0, {MAX_DIGITS - 1}}}")
    return _UNBOUNDED.sub(lambda m: f"{m.group(1)}{{{m.group(2)}, {MAX_DIGITS - 1}}}" if m.group(1) in digit_rules
                          else m.group(0), ebnf)


def compile_spec(compiler: Any, spec: StructuredOutputs, param: str) -> Any:
    """`spec` compiled by an xgrammar GrammarCompiler; GrammarError naming `param` when it is invalid or
    unsupported. The same function runs in the trial's child (grammar_trial.py) and in the server."""
    import xgrammar as xgr

    try:
        if spec.json is not None:
            schema = json.loads(spec.json)
            check_json_schema(schema, param)
            return compiler.compile_grammar(bound_numbers(str(xgr.Grammar.from_json_schema(
                json.dumps(enumerate_multiples(schema)), any_whitespace=False, strict_mode=True))))
        if spec.json_object:  # NOTE: an object, as OpenAI's json_object asks (xgrammar's builtin takes any value)
            return compiler.compile_grammar(bound_numbers(str(xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False))))
        if spec.regex is not None:
            check_regex_anchors(spec.regex, param)
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            # NOTE: ensure_ascii off: an escaped character outside the BMP ("\\ud83d\\ude00") is two lone
            # surrogates to xgrammar, which then forces bytes that are no UTF-8 (the output was none of the choices)
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False)
                                                                     for s in spec.choice))
        assert spec.grammar is not None
        return compiler.compile_grammar(spec.grammar)
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the reason
        said = " ".join(str(e).split())
        said = said.split(": ", 1)[-1] if said.startswith("[") else said  # drop "[time] file.cc:line: "
        raise GrammarError(f"{param}: this {spec.kind} cannot be compiled: {said[:300]}", param,
                           code="invalid_grammar") from None


def check_admits_output(compiled: Any, spec: StructuredOutputs, param: str) -> None:
    """Refuse (GrammarError naming `param`) a compiled grammar that allows no first token at all, not even
    the end of the output (a regex like `[^\\s\\S]`, a rule that only calls itself): otherwise every
    logit is masked and the request fails as if the weights held NaN."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiled)
    words = bitmask_words(compiled.tokenizer_info.vocab_size)
    bitmask = np.zeros((1, words), np.int32)
    if not m.is_terminated():
        m.fill_next_token_bitmask(bitmask, 0)
        if not bitmask.any():
            raise GrammarError(f"{param}: this {spec.kind} admits no output at all (no token can start it); "
                               f"fix it so some text matches", param, code="empty_grammar")


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


__all__ = ["GrammarError", "MAX_DIGITS", "UNSUPPORTED_KEYWORDS", "bitmask_words", "bound_numbers", "check_admits_output",
           "check_json_schema", "check_regex_anchors", "compile_spec"]
