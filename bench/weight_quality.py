"""Quantized-weights report for smollm2-135m: per weight precision x KV precision, the weights
file size, perplexity (same text and windows as bench/kv_quality.py) and single-stream decode
time per token.

    .venv/bin/python bench/weight_quality.py [--tokens 2048] [--threads 2] [--configs fp32,int4,...]
        [--out bench/results/weight_quality.json]

Builds (paged, plugin attention where the native op is built, --all-logits, unvalidated):
  fp32                  the Q4_1 GGUF dequantized to fp32 (= the source file's own perplexity)
  int8 / int4           --weights int8 / int4: the default forms (exporter/limits.py DEFAULT_WEIGHT_FORM:
                        int8 per channel + smoothquant; int4 rtn blocks of 32, the Q4_1 blocks exactly)
  int8-b32 / int4-rtn   the exact forms, named (--weight-block-size 32 / --quant-method rtn)
  int8-ch[-awq|-sq]     --weights int8 --weight-block-size channel [--quant-method awq|smoothquant]
                        (served as int8 x int8 matmuls with per-token activation scales)
  *-int8acc / *-float   weight_matmul_accuracy int8 / float instead of the build's (runtime/execution/
                        session_plan.py; int8: steps of 4+ tokens, so every perplexity chunk, as per-channel
                        int8 x int8); int4-sq-int8acc: --quant-method smoothquant on int4 blocks
  int4-awq              --quant-method awq (re-rounds every matrix from the dequantized floats)
  int4-b64 / -b64-awq   block 64: no GGUF block maps, so rtn vs awq on equal terms
  *+kv8                 the same with --kv-dtype int8
Decode: one prompt of 32 tokens, `--decode-tokens` greedy tokens through kvexport.LLM; ms per
token = (time(N + 1 tokens) - time(1 token)) / N, median of 3. NOTE: timings on a shared
machine are noisy; rerun on a quiet one for the record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

CONFIGS = {  # name -> BuildOptions keywords (+ "accuracy", "float_head": see RUNTIME_KNOBS)
    "fp32": {}, "int8": dict(weights="int8"), "int4": dict(weights="int4"),
    "int8-b32": dict(weights="int8", weight_block_size=32),
    "int8-ch": dict(weights="int8", weight_block_size=0),
    "int8-ch-awq": dict(weights="int8", weight_block_size=0, quant_method="awq"),
    "int8-ch-sq": dict(weights="int8", weight_block_size=0, quant_method="smoothquant"),
    "int8-ch-sq+kv8": dict(weights="int8", weight_block_size=0, quant_method="smoothquant", kv_dtype="int8"),
    "int4-int8acc": dict(weights="int4", accuracy="int8"), "int8-int8acc": dict(weights="int8", accuracy="int8"),
    "int8-b32-float": dict(weights="int8", weight_block_size=32, accuracy="float"),
    "int4-float": dict(weights="int4", accuracy="float"),
    "int4-fphead": dict(weights="int4", float_head=True), "int8-fphead": dict(weights="int8", float_head=True),
    "int4-awq": dict(weights="int4", quant_method="awq"),
    "int4-b64": dict(weights="int4", weight_block_size=64),
    "int4-b64-awq": dict(weights="int4", weight_block_size=64, quant_method="awq"),
    "int4-rtn": dict(weights="int4", weight_block_size=32, quant_method="rtn"),
    "int4-rtn-int8acc": dict(weights="int4", weight_block_size=32, quant_method="rtn", accuracy="int8"),
    # int4 candidates served under accuracy "int8" (large steps per-channel int8 x per-token int8)
    "int4-awq-int8acc": dict(weights="int4", weight_block_size=32, quant_method="awq", accuracy="int8"),
    "int4-sq-int8acc": dict(weights="int4", weight_block_size=32, quant_method="smoothquant", accuracy="int8"),
    "int4-b64-int8acc": dict(weights="int4", weight_block_size=64, accuracy="int8"),
    "int4-b64-awq-int8acc": dict(weights="int4", weight_block_size=64, quant_method="awq", accuracy="int8"),
    "int4-b64-sq-int8acc": dict(weights="int4", weight_block_size=64, quant_method="smoothquant", accuracy="int8"),
    "int4-b128-sq-int8acc": dict(weights="int4", weight_block_size=128, quant_method="smoothquant", accuracy="int8"),
    "fp32+kv8": dict(kv_dtype="int8"), "int8+kv8": dict(weights="int8", kv_dtype="int8"),
    "int4+kv8": dict(weights="int4", kv_dtype="int8"),
}


# "accuracy": EngineConfig.weight_matmul_accuracy (None: the build's; runtime/execution/session_plan.py:
# "int8" = MatMulNBits level 4 + per-channel int8 large steps, "float" = level 0); "float_head": the
# LM head (and tied embeddings) kept in float instead of int8 (exporter/quantize.py HEAD_BITS), to
# measure what the int8 head costs
RUNTIME_KNOBS = ("accuracy", "float_head")


def _float_head_build(name, out, opts):
    from kvexport.exporter import quantize as qz
    from kvexport.exporter import weight_sources
    from kvexport.exporter.build import build

    orig = weight_sources.quantized_weights

    def without_head(*a, **k):
        w, q, req, info = orig(*a, **k)
        q.pop(qz.QUANTIZED_HEAD)
        return w, q, req, info

    weight_sources.quantized_weights = without_head
    try:
        build("smollm2-135m", out, opts)
    finally:
        weight_sources.quantized_weights = orig


def decode_ms(build_dir: Path, prompt: list[int], n: int, threads: int, accuracy: str | None = None) -> float:
    from kvexport import LLM, SamplingParams

    llm = LLM(build_dir, threads=threads, kv_cache_memory="256MiB", weight_matmul_accuracy=accuracy)
    def run(k: int) -> float:
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=k, ignore_eos=True))
        return time.perf_counter() - t
    run(4)
    return statistics.median((run(n + 1) - run(1)) / n * 1e3 for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--builds", help="keep builds in this folder (reused when present)")
    ap.add_argument("--out", default="bench/results/weight_quality.json")
    a = ap.parse_args()

    from kvexport import io
    from kvexport import manifest as mf
    from kvexport.exporter import calibrate, source
    from kvexport.exporter.build import BuildOptions, build
    from kvexport.runtime.execution.session_plan import resolve_accuracy

    from perplexity import nll_paged  # noqa: E402 - bench/ sibling

    root = Path(a.builds or tempfile.mkdtemp(prefix="wq-"))
    src = source.resolve("smollm2-135m")
    tok = source.load_tokenizer(src)
    ids = tok(calibrate.read_text(calibrate.default_text(calibrate.EVALUATION_TEXT)),
              add_special_tokens=False)["input_ids"][:a.tokens]
    prompt = ids[:32]
    rows = {}
    for name in a.configs.split(","):
        kw = dict(CONFIGS[name])
        knobs = {k: kw.pop(k) for k in RUNTIME_KNOBS if k in kw}
        accuracy = knobs.get("accuracy")  # None: the build's (session_plan.resolve_accuracy)
        if "kv_dtype" in kw:
            kw["kv_dtype"] = io.DType(kw["kv_dtype"])
        base = lambda c: {k: v for k, v in c.items() if k != "accuracy"}  # noqa: E731
        out = root / next(n for n, c in CONFIGS.items() if base(c) == base(CONFIGS[name]))  # one build per options
        t0 = time.time()
        if not (out / io.MANIFEST_NAME).is_file():
            opts = BuildOptions(all_logits=True, max_seq_len=1024, validate=False, **kw)
            if knobs.get("float_head"):
                _float_head_build(name, out, opts)
            else:
                build("smollm2-135m", out, opts)
        m = mf.load(out)
        s, n = nll_paged(out, ids, a.window, a.chunk, accuracy)
        q = m.weights.quantization
        rows[name] = {"weights_bytes": m.weights.bytes, "perplexity": round(math.exp(s / n), 4),
                      "form": q.form() if q else m.dtype, "weight_matmul_accuracy": resolve_accuracy(q, accuracy),
                      "decode_ms_per_token": round(decode_ms(out, prompt, a.decode_tokens, a.threads, accuracy), 2),
                      "attention": m.kv.attention, "wall_s": round(time.time() - t0, 1)}
        print(name, rows[name], flush=True)
    base = rows.get("fp32")
    if base:
        for r in rows.values():
            r["size_vs_fp32"] = round(r["weights_bytes"] / base["weights_bytes"], 3)
            r["perplexity_vs_fp32"] = round(r["perplexity"] / base["perplexity"] - 1, 5)
            r["decode_speedup_vs_fp32"] = round(base["decode_ms_per_token"] / r["decode_ms_per_token"], 2)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores (shared: timings noisy)",
              "command": "python bench/weight_quality.py " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                       for k, v in vars(a).items() if v and k != "out"),
              "evaluation_text": f"King Lear, {len(ids)} tokens, windows of {a.window}, chunks of {a.chunk}",
              "fp32_note": "fp32 = the Q4_1 GGUF dequantized: its perplexity is the source file's", "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
