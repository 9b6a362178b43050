"""Single-stream decode time per token of two builds, paired in one process: both are loaded
once, then timed in turn (order alternating) so that the machine's drift hits both alike. For
changes worth a few percent, which separate runs of bench/weight_speed.py (a fresh process per
build and run) cannot resolve on a shared machine.

    .venv/bin/python bench/decode_pair.py BUILD_A BUILD_B [--pairs 10] [--tokens 48] [--threads 2]
        [--out bench/results/decode_pair.json]

BUILD may end in @ACCURACY (`--weight-matmul-accuracy`). `--drop-offsets-b`: B's session has the
GGUF Q4_1 block-offset product (exporter/graph.py `linear`) cut out, to time what it costs: B's
logits are then wrong, its tokens only count. Per turn: one 32-token prompt, ms per
token = (time(N + 1 tokens) - time(1 token)) / N, greedy, EOS ignored. Reports each build's
median and the median of the per-pair ratios A / B (> 1: B is faster). NOTE: two sessions in
one process share caches and memory bandwidth, so absolute figures run higher than alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drop-offsets-b", action="store_true")
    ap.add_argument("--out", default="bench/results/decode_pair.json")
    args = ap.parse_args()

    from kvexport import LLM, SamplingParams
    from kvexport.runtime.execution import ort_backends

    def load(spec: str):
        build, _, accuracy = spec.partition("@")
        return LLM(build, threads=args.threads, kv_cache_memory="128MiB", enable_prefix_caching=False,
                   weight_matmul_accuracy=accuracy or "auto")

    llms = {args.a: load(args.a)}
    if args.drop_offsets_b:
        args.b += " (offsets dropped)"
        ort_backends._OrtBackend._cpu_model = _without_offsets(ort_backends._OrtBackend._cpu_model)
        llms[args.b] = load(args.b.split(" ")[0])
    else:
        llms[args.b] = load(args.b)
    prompt = list(range(200, 232))
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    many = SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True, temperature=0.0)

    def ms_per_token(spec: str) -> float:
        t = time.perf_counter()
        llms[spec].generate([prompt], one)
        first = time.perf_counter() - t
        t = time.perf_counter()
        llms[spec].generate([prompt], many)
        return (time.perf_counter() - t - first) / args.tokens * 1e3

    for spec in llms:  # warm-up
        ms_per_token(spec)
    times: dict[str, list[float]] = {spec: [] for spec in llms}
    for i in range(args.pairs):
        for spec in (args.a, args.b) if i % 2 == 0 else (args.b, args.a):
            times[spec].append(ms_per_token(spec))
    ratios = [a / b for a, b in zip(times[args.a], times[args.b])]
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} cores", "threads": args.threads,
              "decode_ms_per_token": {s: round(statistics.median(t), 2) for s, t in times.items()},
              "median_ratio_a_over_b": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios]}
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    runs = json.loads(out.read_text()) if out.is_file() else {}
    runs[f"{args.a} vs {args.b}"] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(runs, indent=2) + "\n")


def _without_offsets(cpu_model):
    """_cpu_model with every offsets Gemm (C = the codes' product) replaced by that C."""
    import onnx

    from kvexport.runtime.execution import ort_quant

    def wrapped(self, path, plan, store=None):
        model = cpu_model(self, path, plan, store)
        if isinstance(model, str):
            model = onnx.load(model, load_external_data=False)
        g = model.graph
        for n in g.node:
            if n.op_type == "Gemm" and len(n.input) == 3:
                ort_quant.bypass(n, n.input[2])
        ort_quant._prune(g)
        return model

    return wrapped


if __name__ == "__main__":
    main()
