"""Structured output: grammars compiled once per spec, one matcher per sequence, and the
allowed-token bitmask applied to a whole step's logits at once (issue 35).

    SamplingParams.structured (StructuredOutputs: json schema | json object | regex | choice | grammar)
        ──StructuredOutputManager.compile() (xgrammar; cached by spec; a time limit)──▶ CompiledGrammar
        ──matcher()──▶ Matcher, one per sequence (SamplerState.grammar)
    each step: mask_logits(logits, rows) fills every constrained row's bitmask [rows, ceil(V/32)]
        and sets the disallowed logits to -inf in one vectorized pass; sample() then calls
        Matcher.accept(token).

The library is xgrammar (docs/BENCHMARKS.md "Structured output" has the measurement against
llguidance: ~15x cheaper masks per token, the cost every decode step pays; compiles are cached).

NOTE: compiling runs off the server's event loop and off the engine thread: the front ends call
`compile()` in a worker thread while they parse a request, so the engine's own call in
`matcher()` is a cache hit. A new spec is compiled first in a child process killed at
`compile_timeout_s` (grammar_trial.py: a refused compile stops costing CPU and memory at once;
at most MAX_PENDING wait, more are a 503), then here. Refusals are cached like grammars: the same
spec again is refused at once. A grammar that admits no output at all is refused when compiled.

NOTE: keywords xgrammar 0.2.8 accepts but does not enforce (it compiles them and generates output
that may break them) are refused by name (UNSUPPORTED_KEYWORDS), never silently ignored.

Speculative decoding: a matcher keeps its whole history (xgrammar 0.2.8: unlimited rollback). A verifier checks
drafted tokens with `Matcher.validate(drafts)` (how many leading drafts the grammar allows, state
unchanged) or fills one mask row per draft position with `Matcher.fill_along(drafts, bitmask, row)`
(state unchanged), samples, then calls `accept()` for each token it keeps; `rollback(n)` undoes the
last n accepted tokens.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from ..sampling_params import StructuredOutputs
from .grammar_trial import CompileTrials, GrammarBusyError, GrammarError

__all__ = ["GrammarBusyError", "GrammarError", "Matcher", "StructuredOutputManager", "StructuredOutputs", "mask_logits",
           "UNSUPPORTED_KEYWORDS", "check_json_schema", "missing_packages"]

COMPILE_TIMEOUT_S = 10.0  # a grammar that takes longer to compile is refused (400)
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)
MAX_SPEC_CHARS = 256 * 1024  # characters of a schema / regex / grammar at most

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


# the packages structured output needs (import name -> what pip installs); NOTE: a Triton execution
# environment may lack them (xgrammar 0.2.8 imports torch; scripts/install_dev.sh puts the CPU build in
# .venv-triton): then the Triton model refuses these inputs by name and serves the other requests
REQUIREMENTS = {"xgrammar": "xgrammar==0.2.8", "jsonschema": "jsonschema"}


def missing_packages() -> list[str]:
    """Which of REQUIREMENTS cannot be imported here (empty when structured output can run)."""
    import importlib

    out = []
    for name in REQUIREMENTS:
        try:
            importlib.import_module(name)
        except ImportError:
            out.append(name)
    return out


def check_json_schema(schema: Any, param: str) -> None:
    """Refuse (GrammarError naming `param`) a schema that is not valid JSON Schema (jsonschema's
    metaschema check) or uses a keyword in UNSUPPORTED_KEYWORDS (named, with where it is)."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{param} must be a JSON schema (an object), got {type(schema).__name__}", param)
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


class Matcher:
    """One sequence's place in its grammar (an xgrammar GrammarMatcher). Not thread-safe: the
    engine thread alone uses it."""

    __slots__ = ("_m", "_eos")

    def __init__(self, matcher: Any, eos: tuple[int, ...]):
        self._m, self._eos = matcher, eos

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """The tokens allowed next -> bitmask[row] (int32 words, bit t % 32 of word t // 32).
        A finished grammar allows only the end-of-sequence tokens (ignore_eos keeps a request going)."""
        if self._m.is_terminated():
            bitmask[row] = 0
            for t in self._eos:
                bitmask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
            return
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False when the grammar does not allow it (the state is unchanged).
        A token after the grammar finished is accepted without effect (ignore_eos)."""
        if self._m.is_terminated():
            return True
        return bool(self._m.accept_token(int(token)))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def validate(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar allows from here; the state is left as it was."""
        n = 0
        for t in tokens:
            if self._m.is_terminated() or not self._m.accept_token(int(t)):
                break
            n += 1
        if n:
            self._m.rollback(n)
        return n

    def fill_along(self, tokens: Sequence[int], bitmask: np.ndarray, row: int) -> int:
        """Masks for a draft: bitmask[row + i] = the tokens allowed after tokens[:i], for i = 0..k
        while the grammar allows the draft (k + 1 rows when it allows all of it). Returns how many
        rows were filled; the state is left as it was."""
        self.fill(bitmask, row)
        n = 0
        for t in tokens:
            if self._m.is_terminated() or not self._m.accept_token(int(t)):
                break
            n += 1
            self.fill(bitmask, row + n)
        if n:
            self._m.rollback(n)
        return n + 1

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())


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
            check_json_schema(json.loads(spec.json), param)
            return compiler.compile_grammar(bound_numbers(str(xgr.Grammar.from_json_schema(
                spec.json, any_whitespace=False, strict_mode=True))))
        if spec.json_object:  # NOTE: an object, as OpenAI's json_object asks (xgrammar's builtin takes any value)
            return compiler.compile_grammar(bound_numbers(str(xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False))))
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
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


class StructuredOutputManager:
    """Compiles StructuredOutputs for one tokenizer (xgrammar, loaded on first use) and caches
    the results by spec, refusals too. Thread-safe: front ends compile in worker threads, the engine
    thread makes matchers.

    Each new spec is first compiled in a child process killed at compile_timeout_s (CompileTrials:
    a refused compile stops costing CPU and memory), then compiled here, on one thread (the specs
    the trial passed: each about as fast as its trial)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 compile_timeout_s: float = COMPILE_TIMEOUT_S):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos = tuple(int(t) for t in eos_token_ids if 0 <= t < vocab_size)
        self.compile_timeout_s = compile_timeout_s
        self._compiler: Any = None
        self._trials: CompileTrials | None = None
        self._lock = threading.Lock()
        self._compiling = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()

    def _xgr_compiler(self, param: str = "response_format") -> Any:
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise GrammarError("structured output needs the build's tokenizer; this build has none",
                                       "response_format")
                missing = missing_packages()
                if missing:
                    raise GrammarError(f"{param}: structured output needs the Python package"
                                       f"{'s' if len(missing) > 1 else ''} {' and '.join(missing)}, which this "
                                       f"server's Python environment lacks; send the request without {param}, "
                                       f"or serve with `kvexport serve` (pip install "
                                       f"{' '.join(REQUIREMENTS[m] for m in missing)})", param,
                                       code="structured_output_unavailable")
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.eos) or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
                self._trials = CompileTrials(info.serialize_json(), self.compile_timeout_s)
            return self._compiler

    def compile(self, spec: StructuredOutputs, param: str | None = None) -> Any:
        """The compiled grammar of `spec` (cached, and so are refusals). GrammarError naming `param`
        (default: the spec's own field name) when it is invalid, unsupported, admits no output or takes
        longer than compile_timeout_s to compile; GrammarBusyError when too many compiles are waiting."""
        param = param or spec.field
        key = spec.key
        self._xgr_compiler(param)  # NOTE: the tokenizer's tables (once, seconds) are not the client's grammar: no limit
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
            else:
                fut = self._cache[key] = Future()
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
                threading.Thread(target=self._run, args=(spec, param, key, fut), daemon=True,
                                 name="grammar-trial").start()
        return fut.result()  # NOTE: bounded: the trial's deadline, then a compile the trial showed is as fast

    def _run(self, spec: StructuredOutputs, param: str, key: tuple, fut: Future) -> None:
        try:
            assert self._trials is not None
            self._trials.run(spec, param)
            fut.set_result(self._compiling.submit(compile_spec, self._compiler, spec, param).result())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits (a 400, or a server error)
            if isinstance(e, GrammarBusyError):  # NOTE: not the spec's fault: not cached
                with self._lock:
                    if self._cache.get(key) is fut:
                        del self._cache[key]
            fut.set_exception(e)

    def matcher(self, spec: StructuredOutputs | None) -> Matcher | None:
        """A fresh matcher for one sequence (None without a spec); compiles when not cached."""
        if spec is None:
            return None
        import xgrammar as xgr

        return Matcher(xgr.GrammarMatcher(self.compile(spec)), self.eos)

    def close(self) -> None:
        """Stop the compile trials' child processes (the server is stopping)."""
        if self._trials is not None:
            self._trials.close()
        self._compiling.shutdown(wait=False, cancel_futures=True)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def mask_logits(logits: np.ndarray, rows: Sequence[int], matchers: Sequence[Matcher]) -> list[int]:
    """Set, in place, every logit a row's grammar does not allow to -inf: logits [R, vocab]
    (float), rows[i] is the row of matchers[i]. One bitmask [len(rows), ceil(vocab/32)] is filled
    (each matcher its row), unpacked and applied to all rows at once. Returns the i whose grammar allows
    no token at all here (a dead end no token of the model continues): their rows are left as they were,
    for the caller to fail those requests alone (NOTE: masked, they would read as NaN weights)."""
    if not rows:
        return []
    vocab = logits.shape[1]
    bitmask = np.zeros((len(rows), bitmask_words(vocab)), np.int32)  # [B, words]
    for i, m in enumerate(matchers):
        m.fill(bitmask, i)
    dead = np.flatnonzero(~bitmask.any(axis=1))
    bitmask[dead] = -1
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)  # [B, V]
    idx = np.asarray(rows, np.intp)
    logits[idx] = np.where(allowed, logits[idx], -np.inf)
    return dead.tolist()
