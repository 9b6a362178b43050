"""A long-context retrieval suite in RULER's task shapes, generated deterministically (no download), and
the accuracy of KV eviction on it: kvexport's full cache, streaming (sinks + recent window) and importance
eviction (snapkv, h2o: runtime/core/importance.py) against kvpress's presses on the same model, prompts
and ratios.

    # kvexport (the project's venv; BUILD: a paged plugin build, e.g. `kvexport build smollm2-135m
    # --max-seq-len 8192`):
    .venv/bin/python bench/longctx.py kvexport --build BUILD [--contexts 2048,4096] [--samples 1]
        [--fractions 0.5,0.25,0.125] [--policies full,streaming,snapkv,h2o] [--out bench/results/longctx_kvexport.json]
    # kvpress 0.5.5 (its own venv: it pins transformers < 5.3), the same suite from the build's tokenizer:
    /work/venv-kvpress/bin/python bench/longctx.py kvpress --build BUILD --gguf GGUF [...]
        [--presses snapkv,expected_attention,tova,kvzip] [--out bench/results/longctx_kvpress.json]
    # the table (markdown) of both:
    .venv/bin/python bench/longctx.py table bench/results/longctx_kvexport.json bench/results/longctx_kvpress.json
    # KV memory per sequence (stats().kv_blocks_used / /metrics blocks used) and decode step time by budget:
    .venv/bin/python bench/longctx.py memory --build BUILD --contexts 4096 [--out bench/results/longctx_memory.json]

Tasks (RULER, Hsieh et al. 2024, its shapes with our own generator): niah_single (one "special magic
number" in a haystack of filler sentences), niah_multikey (the same with 3 distractor needles of other
keys), niah_multivalue (two numbers for one key: both must be named), variable tracking (a chain of
`VAR Xi = VAR Xj` assignments from one value among distractor chains: name every variable of the chain)
and common words (a numbered list of words, 10 of them about 3x as frequent as the 30 others: name them). Score: the share
of the expected strings found in the greedy answer (RULER's string_match_all), averaged.

The prompt is context + question + answer prefix, as one text, without a chat template, for both; the
budget is a fraction of the prompt's tokens (kvexport: --kv-budget-fraction; streaming: sinks + a recent
window of that size; kvpress: compression_ratio = 1 - fraction of the context, its question being
uncompressed, as kvpress does). Sizes are for 2 shared CPU cores: few samples, stated in the results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
WORDS = ("apple river stone cloud paper garden window silver forest candle mirror bridge ocean pencil "
         "thunder marble feather lantern meadow castle harbor violin copper desert orchard compass blanket "
         "tunnel glacier saddle pepper quartz ribbon falcon walnut canyon ember pillow basket ladder").split()
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words")


@dataclass(frozen=True, slots=True)
class Case:
    task: str
    context_tokens: int  # the target prompt length (tokens)
    seed: int
    context: str
    question: str  # the question and the answer prefix
    answers: tuple[str, ...]  # every one must appear in the answer
    max_new_tokens: int


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _key(rng: random.Random) -> str:
    return "-".join(rng.choice(WORDS) for _ in range(2))


def _haystack(count, target: int, inserts: list[str], rng: random.Random) -> str:
    """Filler sentences with `inserts` at random depths, as long as fits `target` tokens (count(text))."""
    n = max(1, target // max(1, count(FILLER)))
    while n > 1 and count(FILLER * n + " ".join(inserts)) > target:
        n -= max(1, n // 20)
    parts = [FILLER] * n
    for s in inserts:
        parts.insert(rng.randint(1, len(parts) - 1) if len(parts) > 1 else 0, s + " ")
    return "".join(parts)


def make_case(task: str, target: int, seed: int, count) -> Case:
    """One case of `task` whose prompt is about `target` tokens (count: text -> tokens)."""
    rng = random.Random(f"{task}-{target}-{seed}")
    room = target - 60  # the question's tokens
    if task in ("niah_single", "niah_multikey", "niah_multivalue"):
        key = _key(rng)
        values = [_number(rng)] * (2 if task == "niah_multivalue" else 1)
        values = [_number(rng) for _ in values]
        needles = [f"One of the special magic numbers for {key} is: {v}." for v in values]
        if task == "niah_multikey":
            others = set()
            while len(others) < 3:
                k = _key(rng)
                if k != key:
                    others.add(k)
            needles += [f"One of the special magic numbers for {k} is: {_number(rng)}." for k in sorted(others)]
        ctx = _haystack(count, room, needles, rng)
        what = "numbers" if task == "niah_multivalue" else "number"
        q = (f"\nWhat {'are all the special magic numbers' if what == 'numbers' else 'is the special magic number'} "
             f"for {key} mentioned in the provided text? The special magic {what} for {key} mentioned in the "
             f"provided text {'are' if what == 'numbers' else 'is'}")
        return Case(task, target, seed, ctx, q, tuple(values), 24 if what == "numbers" else 12)
    if task == "variable_tracking":
        value = str(rng.randint(10000, 99999))
        names = rng.sample([f"{a}{b}" for a in "ABCDEFGHJKLMNPQRSTUVWXYZ" for b in "ABCDEFGHJKLMNPQRSTUVWXYZ"], 12)
        chain, distract = names[:4], names[4:8]
        lines = [f"VAR {chain[0]} = {value}."] + [f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, 4)]
        other = str(rng.randint(10000, 99999))
        lines += [f"VAR {distract[0]} = {other}."] + [f"VAR {distract[i]} = VAR {distract[i - 1]}." for i in range(1, 4)]
        # the assignments in order (each after the one it reads), spread evenly over the haystack
        sentences = _haystack(count, room - 12 * len(lines), [], rng).split(". ")
        step = max(1, len(sentences) // (len(lines) + 1))
        out = []
        for i, s in enumerate(sentences):
            out.append(s)
            if i % step == step - 1 and i // step < len(lines):
                out.append(lines[i // step][:-1])
        ctx = ". ".join(out)
        q = (f"\nFind all variables that are assigned the value {value} in the text above. Answer: According to "
             f"the chain(s) of variable assignment in the text above, 4 variables are assigned the value {value}, "
             f"they are:")
        return Case(task, target, seed, ctx, q, tuple(chain), 30)
    if task == "common_words":
        common = rng.sample(WORDS, 10)
        rare = [w for w in WORDS if w not in common]
        def listed(ws):
            return "Below is a numbered list of words.\n" + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ws))

        words: list[str] = []
        while count(listed(words)) < room - 60:
            words += [rng.choice(common) if rng.random() < 0.5 else rng.choice(rare) for _ in range(20)]
        freq = {w: words.count(w) for w in set(words)}
        top = sorted(freq, key=lambda w: (-freq[w], w))[:10]
        ctx = listed(words)
        q = ("\nWhat are the 10 most common words in the above list? Answer: The top 10 words that appear most "
             "often in the list are:")
        return Case(task, target, seed, ctx, q, tuple(top), 40)
    raise ValueError(task)


def suite(count, contexts: list[int], samples: int, tasks=TASKS) -> list[Case]:
    return [make_case(t, c, s, count) for c in contexts for t in tasks for s in range(samples)]


def score(text: str, answers: tuple[str, ...]) -> float:
    """RULER's string_match_all: the share of the answers found in the output (case-insensitive)."""
    low = text.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def _counter(build: str):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(build) / "tokenizer" / "tokenizer.json"))
    return tok, (lambda text: len(tok.encode(text, add_special_tokens=False).ids))


# ---- kvexport --------------------------------------------------------------------------------------
def run_kvexport(args) -> dict:
    """Every case under every configuration. The importance policies share one engine with prefix caching:
    per prompt the full cache runs first (its prompt's blocks go to the prefix cache), then each budget
    fraction as a request budget (SamplingParams.kv_budget_tokens): its prompt hits the cache up to the
    last w tokens (ImportanceEviction.prefix_lookup), which it computes, so its observation window's
    attention scores the whole prompt exactly as a from-scratch prefill would (the keys are the same),
    and a prompt is prefilled once for all of them. h2o runs on the same engine by switching its policy to
    decode-time eviction (ImportanceBudget.decode) between requests. Streaming (positional, no scores)
    gets an engine per fraction and context: sinks + a recent window of the budget's size."""
    import dataclasses

    from kvexport import LLM, SamplingParams

    tok, count = _counter(args.build)
    cases = suite(count, args.contexts, args.samples, args.tasks)
    prompts = [tok.encode(c.context + c.question, add_special_tokens=False).ids for c in cases]
    rows: list[dict] = []
    took: dict[str, float] = {}

    def record(method, frac, c, p, text):
        rows.append(dict(method=method, fraction=frac, task=c.task, context=c.context_tokens, prompt_tokens=len(p),
                         seed=c.seed, score=score(text, c.answers), answer=text))

    def params(c, budget=None):
        return SamplingParams(max_tokens=c.max_new_tokens, ignore_eos=True, kv_budget_tokens=budget)

    # snapkv-pool5: snapkv with its token scores max-pooled over 5 neighbours before the block max
    imp = [x for x in args.policies if x in ("snapkv", "h2o", "snapkv-pool5")]
    if "full" in args.policies or imp:
        from kvexport import manifest as mf

        max_len = min(mf.load(args.build).kv.max_seq_len, args.max_model_len or 1 << 30)
        llm = LLM(args.build, kv_cache_memory=args.kv_memory, max_num_batched_tokens=args.chunk, max_num_seqs=8,
                  enable_prefix_caching=True, max_model_len=max_len, kv_eviction="snapkv", kv_budget_tokens=max_len,
                  kv_sink_tokens=4, kv_observation_tokens=args.window, kv_recent_tokens=args.window)
        pol = llm.engine.scheduler.eviction
        snap = pol.b
        for i, (c, p) in enumerate(zip(cases, prompts)):
            t0 = time.time()
            pol.b = snap
            record("kvexport full", 1.0, c, p, llm.generate([p], params(c))[0].text)
            budgets = [(f, math.ceil(f * len(p))) for f in args.fractions]
            for name in imp:
                pol.b = dataclasses.replace(snap, decode=name == "h2o", pool_kernel=5 if name.endswith("pool5") else 1)
                outs = llm.generate([p] * len(budgets), [params(c, b) for _, b in budgets])
                for (f, _), o in zip(budgets, outs):
                    record(f"kvexport {name}", f, c, p, o.text)
            pol.b = snap
            took["importance"] = took.get("importance", 0.0) + time.time() - t0
            print(f"[{i + 1}/{len(cases)}] {c.task} {c.context_tokens} ({len(p)} tokens, {time.time() - t0:.0f} s): "
                  + " ".join(f"{r['method'].split()[-1]}@{r['fraction']}={r['score']:.2f}"
                             for r in rows[-1 - len(imp) * len(budgets):]), file=sys.stderr, flush=True)
            save(args, dict(rows=rows, seconds_by_part=took))
    if "streaming" in args.policies:
        for ctx in args.contexts:
            sel = [(c, p) for c, p in zip(cases, prompts) if c.context_tokens == ctx]
            for f in args.streaming_fractions:
                t0 = time.time()
                recent = max(int(f * max(len(p) for _, p in sel)) - 16, 16)
                llm = LLM(args.build, kv_cache_memory=args.kv_memory, max_num_batched_tokens=args.chunk, max_num_seqs=8,
                          enable_prefix_caching=False, kv_eviction="streaming", kv_sink_tokens=4,
                          kv_recent_tokens=recent)
                outs = llm.generate([p for _, p in sel], [params(c) for c, _ in sel])
                for (c, p), o in zip(sel, outs):
                    record("kvexport streaming", f, c, p, o.text)
                took["streaming"] = took.get("streaming", 0.0) + time.time() - t0
                print(f"streaming {ctx} {f}: {sum(r['score'] for r in rows[-len(sel):]) / len(sel):.3f} "
                      f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
                save(args, dict(rows=rows, seconds_by_part=took))
    return dict(rows=rows, seconds_by_part=took)


def run_memory(args) -> dict:
    """KV memory held per sequence (the engine's stats().kv_blocks_used, what /metrics exports as
    kvexport_kv_blocks_used) and decode step time, by budget: one prompt (the first niah_single case of
    the first context) served alone with request budgets (SamplingParams.kv_budget_tokens) of each
    fraction. Prefix caching on, so the prompt is computed once: later requests hit it up to their
    observation window, which they compute and score from (ImportanceEviction.prefix_lookup)."""
    from kvexport import LLM, SamplingParams
    from kvexport import manifest as mf

    tok, count = _counter(args.build)
    case = make_case("niah_single", args.contexts[0], 0, count)
    prompt = tok.encode(case.context + case.question, add_special_tokens=False).ids
    m = mf.load(args.build)
    llm = LLM(args.build, kv_cache_memory=args.kv_memory, max_num_batched_tokens=args.chunk, kv_eviction="snapkv",
              kv_budget_tokens=min(len(prompt) + 256, m.kv.max_seq_len), kv_sink_tokens=4,
              kv_observation_tokens=args.window, kv_recent_tokens=args.window)
    eng, rows = llm.engine, []
    for f in [1.0] + args.fractions:
        budget = None if f == 1.0 else int(f * len(prompt))
        rid = eng.add_request(prompt, SamplingParams(max_tokens=args.decode_steps, ignore_eos=True,
                                                     kv_budget_tokens=budget))
        req = eng.scheduler.requests[rid]
        while req.num_computed_tokens < len(prompt):  # the prompt's chunks (or the token after its cached blocks)
            eng.step()
        used = eng.stats().kv_blocks_used  # scored and evicted to the budget
        t0, steps = time.perf_counter(), 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
        dt = (time.perf_counter() - t0) / max(steps, 1)
        eng.pop_output(rid)
        rows.append(dict(fraction=f, prompt_tokens=len(prompt), blocks_used=used,
                         kv_bytes=used * m.kv.block_size * m.kv.bytes_per_token, decode_step_ms=round(1000 * dt, 2),
                         load_average=os.getloadavg()[0]))
        print(rows[-1], file=sys.stderr, flush=True)
        save(args, dict(memory=rows))
    return dict(memory=rows)


# ---- kvpress ---------------------------------------------------------------------------------------
PRESSES = {"snapkv": "SnapKVPress", "expected_attention": "ExpectedAttentionPress", "tova": "TOVAPress",
           "kvzip": "KVzipPress", "streaming": "StreamingLLMPress"}


def run_kvpress(args) -> dict:
    """Every case under the full cache and each press at each fraction (case by case, so partial results
    cover every configuration): the context is prefilled under the press (compressed), then the question
    and greedy decoding run on the compressed cache, as kvpress's pipeline does."""
    import tempfile

    import torch
    import kvpress
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tok, count = _counter(args.build)
    # seed by seed, every task each round: a run cut short has covered the tasks evenly
    cases = sorted(suite(count, args.contexts, args.samples, args.tasks),
                   key=lambda c: (c.context_tokens, c.seed, args.tasks.index(c.task)))
    gguf = Path(args.gguf)
    hf_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    model.eval()
    # NOTE: KVzipPress loads the tokenizer from model.config.name_or_path (a GGUF's folder has none)
    hf_dir = tempfile.mkdtemp(prefix="longctx-kvpress-")
    hf_tok.save_pretrained(hf_dir)
    model.config.save_pretrained(hf_dir)
    model.config.name_or_path = model.name_or_path = hf_dir
    rows = []
    took: dict[str, float] = {}
    configs = [("full", 1.0, None)] + [(p, f, getattr(kvpress, PRESSES[p])(compression_ratio=1 - f))
                                        for f in args.fractions for p in args.presses]
    for i, c in enumerate(cases):
        ctx_ids = tok.encode(c.context, add_special_tokens=False).ids
        q_ids = tok.encode(c.question, add_special_tokens=False).ids
        # --question-in-context: the question is part of what the press sees and compresses (query-aware,
        # as kvexport's observation window is), else kvpress's pipeline: the context alone, question after
        ids = torch.tensor([ctx_ids + q_ids] if args.question_in_context else [ctx_ids])
        for name, frac, press in configs:
            t0 = time.time()
            with torch.no_grad():
                if press is None:
                    out = model(input_ids=ids, use_cache=True)
                else:
                    with press(model):
                        out = model(input_ids=ids, use_cache=True)
                cache = out.past_key_values
                # the question, then greedy decoding, on the compressed cache (the question uncompressed)
                text_ids = []
                nxt = torch.tensor([q_ids])
                pos = ids.shape[1]
                if args.question_in_context:  # the prefill's last logits give the first token
                    t = int(out.logits[0, -1].argmax())
                    text_ids.append(t)
                    nxt = torch.tensor([[t]])
                for _ in range(c.max_new_tokens - len(text_ids)):
                    n = nxt.shape[1]
                    out = model(input_ids=nxt, past_key_values=cache, use_cache=True,
                                position_ids=torch.arange(pos, pos + n)[None], cache_position=torch.arange(pos, pos + n))
                    pos += n
                    cache = out.past_key_values
                    t = int(out.logits[0, -1].argmax())
                    text_ids.append(t)
                    nxt = torch.tensor([[t]])
            text = hf_tok.decode(text_ids)
            rows.append(dict(method=f"kvpress {name}" + ("+q" if args.question_in_context and press else ""), fraction=frac, task=c.task, context=c.context_tokens,
                             prompt_tokens=len(ctx_ids) + len(q_ids), seed=c.seed, score=score(text, c.answers),
                             answer=text))
            took[name] = took.get(name, 0.0) + time.time() - t0
        print(f"[{i + 1}/{len(cases)}] {c.task} {c.context_tokens}: " + " ".join(
            f"{r['method'].split()[-1]}@{r['fraction']}={r['score']:.2f}" for r in rows[-len(configs):]),
            file=sys.stderr, flush=True)
        save(args, dict(rows=rows, seconds_by_press=took))
    return dict(rows=rows, seconds_by_press=took)


def save(args, res: dict) -> None:
    """Write `res` (+ the command and settings) to args.out, through a temporary file."""
    if not args.out:
        return
    res = res | dict(command=" ".join(sys.argv), settings=dict(contexts=args.contexts, samples=args.samples,
                                                               fractions=args.fractions, tasks=args.tasks),
                     load_average=os.getloadavg()[0])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, args.out)


# ---- table -----------------------------------------------------------------------------------------
def table(paths: list[str]) -> str:
    rows = [r for p in paths for r in json.loads(Path(p).read_text())["rows"]]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fracs = sorted({r["fraction"] for r in rows}, reverse=True)
    contexts = sorted({r["context"] for r in rows})
    head = "| method | budget | " + " | ".join(f"{c // 1024}k" for c in contexts) + " | all | n |"
    lines = [head, "|" + "---|" * (len(contexts) + 4)]
    for m in methods:
        for f in fracs:
            sel = [r for r in rows if r["method"] == m and r["fraction"] == f]
            if not sel:
                continue
            cells = []
            for c in contexts:
                s = [r["score"] for r in sel if r["context"] == c]
                cells.append(f"{100 * sum(s) / len(s):.0f}" if s else "-")
            label = "full" if f == 1.0 else f"1/{round(1 / f)}"
            lines.append(f"| {m} | {label} | " + " | ".join(cells) +
                         f" | {100 * sum(r['score'] for r in sel) / len(sel):.0f} | {len(sel)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("kvexport", "kvpress", "memory", "table", "suite"))
    p.add_argument("paths", nargs="*", help="table: result files")
    p.add_argument("--build", help="the kvexport build (its tokenizer defines the suite's token counts)")
    p.add_argument("--gguf", help="kvpress: the model's GGUF file (the same weights as the build)")
    p.add_argument("--contexts", default="2048,4096")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--fractions", default="0.5,0.25,0.125")
    p.add_argument("--policies", default="full,snapkv,streaming,h2o")
    p.add_argument("--streaming-fractions", default="0.25", help="kvexport: the fractions streaming runs at")
    p.add_argument("--max-model-len", type=int, default=0, help="kvexport: 0 = the build's max_seq_len")
    p.add_argument("--presses", default="snapkv,expected_attention,tova,kvzip")
    p.add_argument("--question-in-context", action="store_true",
                   help="kvpress: compress context + question together (query-aware; methods named PRESS+q)")
    p.add_argument("--window", type=int, default=32, help="kvexport: observation window / recent tokens")
    p.add_argument("--chunk", type=int, default=1024, help="kvexport: max_num_batched_tokens")
    p.add_argument("--kv-memory", default="1GiB")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-steps", type=int, default=32, help="memory: decode steps timed per budget")
    p.add_argument("--out")
    a = p.parse_args(argv)
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.fractions = [float(x) for x in a.fractions.split(",")]
    a.streaming_fractions = [float(x) for x in a.streaming_fractions.split(",")]
    a.tasks = a.tasks.split(",")
    a.policies = a.policies.split(",")
    a.presses = a.presses.split(",")
    if a.what == "table":
        print(table(a.paths))
        return
    if a.what == "suite":
        tok, count = _counter(a.build)
        for c in suite(count, a.contexts, a.samples, a.tasks):
            print(c.task, c.context_tokens, count(c.context + c.question), c.answers)
        return
    t0 = time.time()
    res = {"kvexport": run_kvexport, "kvpress": run_kvpress, "memory": run_memory}[a.what](a)
    save(a, res | dict(seconds=round(time.time() - t0, 1)))


if __name__ == "__main__":
    main()
