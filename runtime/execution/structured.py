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

Closing within the budget (issue 48 §2): in the last CLOSING_WINDOW tokens a request may emit, every sampled
token is checked (`Matcher.keep_closable`): after it, can the output still end within the tokens left? A short
way to end it is planned greedily on a fork of the matcher from the tokenizer's one-character tokens (Closer: `"`
`}` `]` `0` ... first, two orders of preference, the shorter plan kept); a token that would leave no such way
is replaced by the model's most likely token that does, else by the plan's first. So a small model's loop inside
a string or a recursion still ends in a document that parses and validates, with finish_reason `stop`; only a
budget shorter than the shortest way to close from where the window starts cuts it (`length`). Not with
`ignore_eos` (the request goes on past the end).

Speculative decoding: a matcher keeps its whole history (xgrammar 0.2.8: unlimited rollback). A verifier checks
drafted tokens with `Matcher.validate(drafts)` (how many leading drafts the grammar allows, state
unchanged) or fills one mask row per draft position with `Matcher.fill_along(drafts, bitmask, row)`
(state unchanged), samples, then calls `accept()` for each token it keeps; `rollback(n)` undoes the
last n accepted tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from ..sampling_params import StructuredOutputs
from .grammar_trial import CompileTrials, GrammarBusyError
from .grammars import (MAX_DIGITS, UNSUPPORTED_KEYWORDS, GrammarError, bitmask_words, bound_numbers,
                       check_json_schema, compile_spec)

# NOTE: the grammar-making names (grammars.py) are handed on: front ends and tests import them from here
__all__ = ["CLOSING_WINDOW", "Closer", "GrammarBusyError", "GrammarError", "MAX_DIGITS", "Matcher",
           "StructuredOutputManager", "StructuredOutputs", "UNSUPPORTED_KEYWORDS", "bitmask_words", "bound_numbers",
           "check_json_schema", "mask_logits", "missing_packages"]

COMPILE_TIMEOUT_S = 10.0  # a grammar that takes longer to compile is refused (400)
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)
# and their bytes kept, at most: each compiled grammar's xgrammar memory_size_bytes plus its spec's text (a
# 1 MiB schema is part of its key); the least recently used are dropped past it, the newest always kept
CACHE_BYTES = 256 << 20
MAX_SPEC_CHARS = 256 * 1024  # characters of a schema / regex / grammar at most
# the last tokens of a request's max_tokens in which each sampled token must leave a way to end the output
# (Matcher.keep_closable); the way found when the window opens must fit in it (a document nested deeper than
# this needs to close is cut by max_tokens as before)
CLOSING_WINDOW = 64

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


class Closer:
    """What a matcher plans a way to end its output with, for one tokenizer: its one-character tokens in two
    orders of preference. A plan takes, at each step, the first token of its order the grammar allows. Order
    one ends strings first (`"`), order two closes objects and arrays first (`}` `]`: inside a string they
    are text, so that order finds no end there); both prefer a short value (`0`, `null`) and the symbols a
    pattern's separators need before letters."""

    FIRST = ('"', "}", "]", "0", "1", ",", ":", "n", "u", "l", "t", "r", "e", "f", "a", "s", "{", "[")

    def __init__(self, decoded_vocab: Sequence[bytes], eos: tuple[int, ...],
                 encode: Callable[[str], Sequence[int]] | None = None):
        self.encode = encode  # text -> token ids (no special tokens): what the grammar forces goes in whole tokens
        one: dict[str, int] = {}
        for i, b in enumerate(decoded_vocab):
            if len(b) == 1 and b[0] >= 0x20 and chr(b[0]) not in one:
                one[chr(b[0])] = i
        symbols = [c for c in one if not c.isalnum() and c != " " and c not in self.FIRST]
        rest = [c for c in one if c.isalnum() and c not in self.FIRST] + ([" "] if " " in one else [])
        first = [c for c in self.FIRST if c in one]
        strings_first = first + symbols + rest
        closers_first = [c for c in ("}", "]") if c in one] + [c for c in strings_first if c not in ("}", "]")]
        self.orders = tuple(np.array([one[c] for c in order], np.intp) for order in (strings_first, closers_first))
        self.eos = eos[0] if eos else None
        self.words = bitmask_words(len(decoded_vocab))


class Matcher:
    """One sequence's place in its grammar (an xgrammar GrammarMatcher). Not thread-safe: the
    engine thread alone uses it."""

    __slots__ = ("_m", "_eos", "_closer")

    def __init__(self, matcher: Any, eos: tuple[int, ...], closer: Closer | None = None):
        self._m, self._eos, self._closer = matcher, eos, closer

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

    def closing(self, limit: int, after: int | None = None) -> list[int] | None:
        """A short way to end the output from here (after `after`, when given): at most `limit` tokens, the last
        an end-of-sequence token (none when the grammar already ended), or None when no plan fits. The state is
        left as it was."""
        c = self._closer
        if c is None or c.eos is None:
            return None
        best = None
        bitmask = np.zeros((1, c.words), np.int32)
        for order in c.orders:  # NOTE: the second plan only counts when shorter than the first
            m = self._m.fork()
            if after is not None and not m.accept_token(int(after)):
                return None
            plan: list[int] = []
            cap = limit if best is None else len(best) - 1
            while len(plan) < cap:
                if m.is_terminated():
                    break
                if m.is_completed():
                    plan.append(c.eos)
                    break
                forced = m.find_jump_forward_string() if c.encode is not None else ""
                first = c.encode(forced)[:1] if forced else []  # NOTE: text the grammar forces (a key's name) in
                if first and m.accept_token(int(first[0])):     # the tokenizer's own tokens, not one per character
                    plan.append(int(first[0]))
                    continue
                m.fill_next_token_bitmask(bitmask, 0)
                bits = (bitmask[0, order // 32] >> (order % 32)) & 1  # the order's tokens allowed here
                hit = np.flatnonzero(bits)
                if hit.size:
                    tok = int(order[hit[0]])
                else:  # NOTE: none of the one-character tokens: the lowest token the grammar allows
                    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
                    if not allowed.size:
                        break
                    tok = int(allowed[0])
                if not m.accept_token(tok):
                    break
                plan.append(tok)
            else:
                continue  # the cap was reached before the end
            if m.is_terminated() or (plan and plan[-1] == c.eos):
                best = plan
        return best

    def keep_closable(self, token: int, budget: int, ranked: Callable[[], Sequence[int]] = list) -> int:
        """The token to emit in place of `token` when `budget` tokens may still be emitted (this one included):
        `token` when after it the output can still end within budget - 1 tokens (or the window is not reached,
        or no way to end fits from here either), else the first of `ranked()` (the model's likeliest tokens, best
        first) that leaves a way, else the first token of the way from here."""
        if self._closer is None or budget > CLOSING_WINDOW or self._m.is_terminated() or token in self._eos:
            return token
        if self.closing(budget - 1, after=token) is not None:
            return token
        here = self.closing(budget)
        if here is None:  # NOTE: deeper than the window can close: cut by max_tokens as before
            return token
        for t in ranked():
            ends = t in self._eos and self._m.is_completed()
            if t != token and (ends or self.closing(budget - 1, after=t) is not None):
                return t
        return here[0]


def _key_bytes(key: tuple) -> int:
    """Bytes a cache key's text holds (a schema's, a regex's, a grammar's)."""
    return sum(len(x) if isinstance(x, (str, bytes)) else _key_bytes(x) if isinstance(x, tuple) else 8 for x in key)


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
        self._closer: Closer | None = None
        self._trials: CompileTrials | None = None
        self._lock = threading.Lock()
        self._compiling = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._sizes: dict[tuple, int] = {}  # bytes of each cached entry (its key's text, then its grammar's too)
        self.cache_bytes = 0  # sum of _sizes (CACHE_BYTES bounds it)

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
                tok = self.tokenizer
                self._closer = Closer(info.decoded_vocab, self.eos,
                                      lambda text: tok.encode(text, add_special_tokens=False))
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
                self._account(key, _key_bytes(key))
                threading.Thread(target=self._run, args=(spec, param, key, fut), daemon=True,
                                 name="grammar-trial").start()
        return fut.result()  # NOTE: bounded: the trial's deadline, then a compile the trial showed is as fast

    def _run(self, spec: StructuredOutputs, param: str, key: tuple, fut: Future) -> None:
        try:
            assert self._trials is not None
            self._trials.run(spec, param)
            compiled = self._compiling.submit(compile_spec, self._compiler, spec, param).result()
            with self._lock:
                if self._cache.get(key) is fut:  # (still cached: its grammar's bytes count too)
                    self._account(key, _key_bytes(key) + int(getattr(compiled, "memory_size_bytes", 0)))
            fut.set_result(compiled)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits (a 400, or a server error)
            if isinstance(e, GrammarBusyError):  # NOTE: not the spec's fault: not cached
                with self._lock:
                    if self._cache.get(key) is fut:
                        del self._cache[key]
                        self.cache_bytes -= self._sizes.pop(key, 0)
            fut.set_exception(e)

    def _account(self, key: tuple, size: int) -> None:
        """`key`'s entry now holds `size` bytes; the least recently used entries are dropped while the cache
        holds more than CACHE_SIZE entries or CACHE_BYTES bytes (the newest stays). Called with the lock held."""
        self.cache_bytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        while len(self._cache) > 1 and (len(self._cache) > CACHE_SIZE or self.cache_bytes > CACHE_BYTES):
            old, _ = self._cache.popitem(last=False)
            self.cache_bytes -= self._sizes.pop(old, 0)

    def matcher(self, spec: StructuredOutputs | None) -> Matcher | None:
        """A fresh matcher for one sequence (None without a spec); compiles when not cached."""
        if spec is None:
            return None
        import xgrammar as xgr

        return Matcher(xgr.GrammarMatcher(self.compile(spec)), self.eos, self._closer)

    def close(self) -> None:
        """Stop the compile trials' child processes (the server is stopping)."""
        if self._trials is not None:
            self._trials.close()
        self._compiling.shutdown(wait=False, cancel_futures=True)


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
