"""Structured output (issue 35): the grammar library chosen by measurement, and the decode overhead
of a JSON schema on a real build.

    .venv/bin/python bench/structured.py libs [--out bench/results/structured_libs.json]
    .venv/bin/python bench/structured.py overhead --build BUILD [--batch 16] [--tokens 64]
        [--out bench/results/structured_overhead.json]
    .venv/bin/python bench/structured.py heldout --build BUILD [--max-tokens 160]
        [--out bench/results/structured_heldout.json]

`libs`: xgrammar and llguidance side by side on smollm2-135m's tokenizer (49,152 tokens):
  compile  seconds to compile one large JSON schema (40 nested objects x 8 fields: enums, patterns,
           ranges, bounded arrays = 320 fields), a fresh compiler each time (no cache), median of 3;
  mask     microseconds per token to fill the allowed-token bitmask of 16 matchers (one batch step)
           and advance each by its next token, along 16 valid JSON documents (one per schema);
  coverage of the held-out schemas (tests/runtime/serving/schemas/heldout.json): each compiles, accepts
           a valid document's tokens (where one is written below) and what each says it ignores.
`overhead`: decode throughput of `--batch` greedy requests of exactly `--tokens` tokens with and
without a JSON schema (response_format json_schema, the same schema for all) through the engine.
`heldout`: every held-out schema generated once on the build (one batch), each output checked with
`jsonschema`: the full set the test suite samples from (tests/runtime/serving/test_structured.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "tests" / "runtime" / "serving" / "schemas" / "heldout.json"

# valid documents of 16 held-out schemas: the trajectories the mask timing walks
DOCS = {
    "person": {"name": "Ada Lovelace", "age": 36},
    "city_enum": {"city": "Tokyo"},
    "nested_address": {"name": "Bo", "address": {"street": "1 Main Street", "zip": "12345"}},
    "tags_bounded": {"tags": ["red", "green", "blue"]},
    "array_of_objects": {"items": [{"id": 1, "label": "first"}, {"id": 2, "label": "second"}]},
    "product": {"sku": "SKU-042", "price": 19.5, "in_stock": True},
    "order": {"id": 7, "lines": [{"sku": "A1", "qty": 2}, {"sku": "B2", "qty": 10}]},
    "weather": {"city": "Lima", "unit": "celsius", "temp": 21.5},
    "sentiment": {"label": "positive", "confidence": 0.93},
    "book": {"title": "Dune", "authors": ["Frank Herbert"], "year": 1965},
    "event": {"name": "standup", "start": "09:30", "attendees": 12},
    "rgb": {"r": 12, "g": 200, "b": 255},
    "coordinates": {"lat": 48.85, "lon": 2.35},
    "ref_defs": {"from": {"x": 1, "y": 2}, "to": {"x": 3, "y": 4}},
    "matrix": {"m": [[1, 2], [3, 4]]},
    "optional_nested": {"user": {"id": 5, "nick": "zed"}, "meta": {"v": 1}},
}


# NOTE: greedy smollm2-135m repeats itself inside unbounded strings and numbers ("1234567890123...",
# "1000000...") until max_tokens cuts the document; a frequency penalty (what a client would set) ends those
# loops. The grammar guarantees the syntax and the schema; a document cut by max_tokens is invalid anyway.
FREQUENCY_PENALTY = 0.5


def heldout_prompt(s: dict) -> str:
    """The user turn for a held-out schema: its name and the schema, as clients of structured output write it."""
    return f"Give a short example of a {s['name'].replace('_', ' ')} as JSON matching this schema: {json.dumps(s['schema'])}"


def large_schema(groups: int = 40) -> dict:
    """An object of `groups` nested objects of 8 fields each (enums, patterns, ranges, arrays)."""
    def group(g: int) -> dict:
        props = {
            "id": {"type": "integer", "minimum": 0, "maximum": 10_000},
            "name": {"type": "string", "maxLength": 32},
            "kind": {"enum": [f"k{g}_{j}" for j in range(6)]},
            "code": {"type": "string", "pattern": f"^G{g}-[A-Z]{{2}}[0-9]{{3}}$"},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
            "active": {"type": "boolean"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        }
        return {"type": "object", "properties": props, "required": list(props)[:6], "additionalProperties": False}
    props = {f"group_{g}": group(g) for g in range(groups)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _tokenizer():
    from kvexport.exporter.source import load_tokenizer, resolve

    return load_tokenizer(resolve("smollm2-135m"))


class _Xgr:
    name = "xgrammar"

    def __init__(self, tok, vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.vocab = vocab

    def compile(self, schema: str, cache: bool = False):
        c = self.xgr.GrammarCompiler(self.info, cache_enabled=cache)
        return c.compile_json_schema(schema, any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask_step(self, matchers, bitmask, tokens):
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        for m, t in zip(matchers, tokens):
            if t is not None:
                assert m.accept_token(t), "a valid document's token was refused"

    def bitmask(self, n):
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def accepts(self, compiled, ids) -> bool:
        m = self.matcher(compiled)
        return all(m.accept_token(t) for t in ids)

    def ignored(self, schema: str, compiled) -> list[str]:
        return []  # xgrammar reports nothing it ignores


class _Llg:
    name = "llguidance"

    def __init__(self, tok, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lnp

        self.llg, self.lnp = llguidance, lnp
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.exec = llguidance.LLExecutor()
        self.vocab = vocab

    def compile(self, schema: str, cache: bool = False):
        grm = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False, "item_separator": ", ",
                                                                             "key_separator": ": "})
        m = self.llg.LLMatcher(self.tok, grm)  # NOTE: llguidance compiles when a matcher is made
        if m.is_error():
            raise ValueError(m.get_error())
        bm = self.lnp.allocate_token_bitmask(1, self.vocab)
        self.lnp.fill_next_token_bitmask(m, bm, 0)  # and builds its lexer lazily: the first mask counts
        return grm

    def matcher(self, grm):
        return self.llg.LLMatcher(self.tok, grm)

    def mask_step(self, matchers, bitmask, tokens):
        self.lnp.fill_next_token_bitmask_par(self.exec, [(m, i) for i, m in enumerate(matchers)], bitmask)
        for m, t in zip(matchers, tokens):
            if t is not None:
                assert m.consume_token(t), "a valid document's token was refused"

    def bitmask(self, n):
        return self.lnp.allocate_token_bitmask(n, self.vocab)

    def accepts(self, grm, ids) -> bool:
        m = self.matcher(grm)
        return all(m.consume_token(t) for t in ids) and not m.is_error()

    def ignored(self, schema: str, grm) -> list[str]:
        ok, warnings = self.llg.LLMatcher.validate_grammar_with_warnings(grm, self.tok)
        return list(warnings)


def bench_libs(out: Path | None) -> dict:
    tok = _tokenizer()
    vocab = 49152
    heldout = json.loads(HELDOUT.read_text())
    big = json.dumps(large_schema())
    result: dict = {"machine": platform.processor() or platform.machine(), "vocab": vocab,
                    "large_schema_bytes": len(big), "libs": {}}
    for lib in (_Xgr(tok, vocab), _Llg(tok, vocab)):
        r: dict = {}
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            lib.compile(big)
            times.append(time.perf_counter() - t0)
        r["compile_large_s"] = statistics.median(times)
        # mask per token at batch 16, along the 16 documents
        by_name = {s["name"]: json.dumps(s["schema"]) for s in heldout}
        compiled = [lib.compile(by_name[k], cache=True) for k in DOCS]
        docs = [tok(json.dumps(d))["input_ids"] for d in DOCS.values()]
        eos = tok.eos_token_id
        docs = [d + [eos] for d in docs]
        matchers = [lib.matcher(c) for c in compiled]
        bitmask = lib.bitmask(len(matchers))
        steps = max(len(d) for d in docs)
        t0 = time.perf_counter()
        for k in range(steps):
            live = [(m, d[k]) for m, d in zip(matchers, docs) if k < len(d)]
            lib.mask_step([m for m, _ in live], bitmask, [t for _, t in live])
        dt = time.perf_counter() - t0
        ntok = sum(len(d) for d in docs)
        r["mask_batch16_us_per_token"] = dt / ntok * 1e6
        r["mask_batch16_ms_per_step"] = dt / steps * 1e3
        # coverage
        cov = {}
        for s in heldout:
            text = json.dumps(s["schema"])
            entry: dict = {}
            try:
                t0 = time.perf_counter()
                c = lib.compile(text)
                entry["compile_ms"] = (time.perf_counter() - t0) * 1e3
                entry["compiles"] = True
                entry["ignored"] = lib.ignored(text, c)
                if s["name"] in DOCS:
                    entry["accepts_valid_doc"] = lib.accepts(c, tok(json.dumps(DOCS[s["name"]]))["input_ids"])
            except Exception as e:  # noqa: BLE001 - a schema the library refuses: recorded
                entry = {"compiles": False, "error": " ".join(str(e).split())[:300]}
            cov[s["name"]] = entry
        r["coverage"] = cov
        r["compiled"] = sum(e["compiles"] for e in cov.values())
        r["with_warnings"] = sum(bool(e.get("ignored")) for e in cov.values())
        r["schemas"] = len(cov)
        r["compile_heldout_median_ms"] = statistics.median(e["compile_ms"] for e in cov.values() if e["compiles"])
        r["compile_heldout_max_ms"] = max(e["compile_ms"] for e in cov.values() if e["compiles"])
        result["libs"][lib.name] = r
        print(f"{lib.name}: compile large {r['compile_large_s'] * 1e3:.1f} ms | mask batch 16 "
              f"{r['mask_batch16_us_per_token']:.1f} us/token ({r['mask_batch16_ms_per_step']:.2f} ms/step) | "
              f"compiles {r['compiled']}/{r['schemas']} (median {r['compile_heldout_median_ms']:.1f} ms, max "
              f"{r['compile_heldout_max_ms']:.1f} ms), warnings on {r['with_warnings']}")
        for k, e in cov.items():
            if not e["compiles"] or e.get("ignored") or e.get("accepts_valid_doc") is False:
                print(f"   {k}: {e}")
    _write(out, result)
    return result


def _engine(build: str, batch: int):
    from kvexport.runtime.config import EngineConfig
    from kvexport.runtime.engine import LLMEngine

    return LLMEngine(build, EngineConfig(max_num_seqs=batch, kv_cache_memory="512MiB"))


def bench_overhead(build: str, batch: int, tokens: int, out: Path | None) -> dict:
    from kvexport.runtime.execution.structured import StructuredOutputs
    from kvexport.runtime.sampling_params import SamplingParams

    # 16 order lines: longer than --tokens, so every measured step is constrained (the grammar never finishes)
    line = {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                             "note": {"type": "string", "maxLength": 24}},
            "required": ["sku", "qty", "note"], "additionalProperties": False}
    schema = {"type": "array", "items": line, "minItems": 16, "maxItems": 16}
    eng = _engine(build, batch)
    prompt = eng.tokenizer(f"List 16 order lines as JSON matching {json.dumps(schema)}:")["input_ids"]
    result: dict = {"build": build, "batch": batch, "tokens": tokens}

    def run(structured) -> float:
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, structured=structured)
        rids = [eng.add_request(list(prompt), params) for _ in range(batch)]
        while eng.has_unfinished():  # prompts first: the timing is the decode steps only
            eng.step()
            if all(len(eng.output(r).token_ids) >= 1 for r in rids):
                break
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        dt = time.perf_counter() - t0
        outs = [eng.pop_output(r) for r in rids]
        result.setdefault("sample_text", {})["json" if structured else "plain"] = outs[0].text[:120]
        return sum(len(o.token_ids) - 1 for o in outs) / dt

    # the grammar's own time inside the steps (mask fill + apply; the matcher's accept is inside sample(), µs):
    # a figure the machine's load affects like the steps around it, unlike two throughputs taken apart
    from kvexport.runtime.execution import model_runner

    spent = [0.0]
    inner = model_runner.ModelRunner._mask_grammars

    def timed(*a):
        t = time.perf_counter()
        inner(*a)
        spent[0] += time.perf_counter() - t

    model_runner.ModelRunner._mask_grammars = staticmethod(timed)
    run(None)  # warm-up
    spec = StructuredOutputs(json=json.dumps(schema))
    t0 = time.perf_counter()
    eng.structured.compile(spec)
    result["compile_s"] = time.perf_counter() - t0
    for name, spec_ in (("plain", None), ("json_schema", spec), ("plain_again", None), ("json_schema_again", spec)):
        spent[0], t0 = 0.0, time.perf_counter()
        result[f"{name}_tok_s"] = run(spec_)
        result[f"{name}_mask_share_pct"] = spent[0] / (time.perf_counter() - t0) * 100
        print(f"{name}: {result[f'{name}_tok_s']:.1f} tok/s; grammar masks {result[f'{name}_mask_share_pct']:.2f}% "
              f"of the run")
    plain = (result["plain_tok_s"] + result["plain_again_tok_s"]) / 2
    js = (result["json_schema_tok_s"] + result["json_schema_again_tok_s"]) / 2
    result["overhead_pct"] = (plain - js) / plain * 100
    print(f"overhead of a JSON schema at batch {batch}: {result['overhead_pct']:.1f}%")
    _write(out, result)
    return result


def bench_heldout(build: str, max_tokens: int, out: Path | None) -> dict:
    import jsonschema

    from kvexport.runtime.execution.structured import StructuredOutputs
    from kvexport.runtime.sampling_params import SamplingParams

    heldout = json.loads(HELDOUT.read_text())
    eng = _engine(build, len(heldout))
    rids = []
    t0 = time.perf_counter()
    for s in heldout:
        prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": heldout_prompt(s)}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
        params = SamplingParams(max_tokens=max_tokens, frequency_penalty=FREQUENCY_PENALTY,
                                structured=StructuredOutputs(json=json.dumps(s["schema"])))
        rids.append(eng.add_request(list(prompt), params))
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    rows, valid = {}, 0
    for s, r in zip(heldout, rids):
        o = eng.pop_output(r)
        try:
            jsonschema.validate(json.loads(o.text), s["schema"])
            ok = True
        except Exception as e:  # noqa: BLE001 - recorded
            ok = f"{type(e).__name__}: {str(e)[:120]}"
        valid += ok is True
        rows[s["name"]] = {"text": o.text, "finish": o.finish_reason, "valid": ok, "tokens": len(o.token_ids)}
    result = {"build": build, "schemas": len(heldout), "valid": valid, "seconds": dt, "max_tokens": max_tokens,
              "outputs": rows}
    print(f"{valid}/{len(heldout)} valid in {dt:.1f} s")
    for k, v in rows.items():
        if v["valid"] is not True:
            print(f"   {k}: {v}")
    _write(out, result)
    return result


def _write(out: Path | None, result: dict) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("libs")
    a.add_argument("--out", type=Path)
    b = sub.add_parser("overhead")
    b.add_argument("--build", required=True)
    b.add_argument("--batch", type=int, default=16)
    b.add_argument("--tokens", type=int, default=64)
    b.add_argument("--out", type=Path)
    c = sub.add_parser("heldout")
    c.add_argument("--build", required=True)
    c.add_argument("--max-tokens", type=int, default=160)
    c.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.cmd == "libs":
        bench_libs(args.out)
    elif args.cmd == "overhead":
        bench_overhead(args.build, args.batch, args.tokens, args.out)
    else:
        bench_heldout(args.build, args.max_tokens, args.out)


if __name__ == "__main__":
    main()
