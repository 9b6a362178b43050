"""Speed and memory of builds that differ in weight precision, measured in paired, alternating
runs (the machine may be shared): per repetition each build in turn (order rotated) serves the
mixed-64 trace (`kvexport bench`, a fresh process) and times single-stream greedy decode; then
peak RSS of `kvexport generate` with a 512 MiB KV pool. Reports medians and the load average
seen before each run.

    .venv/bin/python bench/weight_speed.py fp32=build/fp32 int8=build/int8 int4=build/int4 \\
        int4-int8=build/int4@int8 [--reps 3] [--trace mixed-64] [--threads 2] [--out bench/results/weight_speed.json]

NAME=BUILD@ACCURACY serves BUILD with `--weight-matmul-accuracy ACCURACY` (default: the build's own,
weights.quantization.matmul_accuracy; `kvexport inspect` says which).
Builds: `kvexport build smollm2-135m --no-validate --max-seq-len 2048 [--weights int8|int4]`.
Decode: one 32-token prompt, ms per token = (time(N + 1 tokens) - time(1 token)) / N,
median of 3 within the run (bench/weight_quality.py `decode_ms`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KVEXPORT = str(Path(sys.executable).with_name("kvexport"))
HERE = Path(__file__).resolve().parent
DECODE = """
import sys; sys.path.insert(0, {here!r})
from weight_quality import decode_ms
from kvexport.exporter import calibrate, source
tok = source.load_tokenizer(source.resolve("smollm2-135m"))
ids = tok(calibrate.read_text(calibrate.default_text(calibrate.EVALUATION_TEXT)), add_special_tokens=False)["input_ids"]
print(decode_ms({build!r}, ids[:32], {n}, {threads}, {accuracy!r}))
"""


def split(spec: str) -> tuple[str, str | None]:
    """BUILD[@ACCURACY] -> (BUILD, ACCURACY or None: the build's)."""
    build, _, accuracy = spec.partition("@")
    return build, accuracy or None


def _accuracy_flag(accuracy: str | None) -> list[str]:
    return ["--weight-matmul-accuracy", accuracy] if accuracy else []


def trace_run(spec: str, trace: str, threads: int) -> dict:
    build, accuracy = split(spec)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([KVEXPORT, "bench", build, "--trace", trace, "--threads", str(threads), "--json", f.name,
                        *_accuracy_flag(accuracy)], check=True, capture_output=True)
        return json.loads(Path(f.name).read_text())


def decode_run(spec: str, n: int, threads: int) -> float:
    build, accuracy = split(spec)
    code = DECODE.format(here=str(HERE), build=build, n=n, threads=threads, accuracy=accuracy)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def peak_rss_mib(spec: str, pool: str) -> float:
    """Peak RSS of `kvexport generate BUILD` (one prompt, 64 tokens) with a `pool` KV budget."""
    build, accuracy = split(spec)
    r = subprocess.run(["/usr/bin/time", "-f", "%M", KVEXPORT, "generate", build, "The king said",
                        "--kv-cache-memory", pool, *_accuracy_flag(accuracy)],
                       check=True, capture_output=True, text=True)
    return int(r.stderr.strip().splitlines()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("builds", nargs="+", help="NAME=BUILD_DIR")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trace", default="mixed-64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--pool", default="512MiB", help="KV budget of the peak-RSS run")
    ap.add_argument("--skip", default="", help="comma-separated: trace, decode, rss")
    ap.add_argument("--out", default="bench/results/weight_speed.json")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    builds = dict(b.split("=", 1) for b in a.builds)
    skip = set(filter(None, a.skip.split(",")))
    runs: dict[str, list] = {n: [] for n in builds}
    names = list(builds)
    for rep in range(a.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            row = {"rep": rep, "load_before": round(os.getloadavg()[0], 2)}
            if "trace" not in skip:
                r = trace_run(builds[name], a.trace, a.threads)
                row |= {k: r[k] for k in ("output_tokens_per_s", "total_tokens_per_s", "wall_s")}
            if "decode" not in skip:
                row["decode_ms_per_token"] = round(decode_run(builds[name], a.decode_tokens, a.threads), 2)
            runs[name].append(row)
            print(name, row, flush=True)
    summary = {}
    for name, rs in runs.items():
        s = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("rep", "load_before")}
        s["load_before"] = [r["load_before"] for r in rs]
        if "rss" not in skip:
            s["peak_rss_mib"] = round(peak_rss_mib(builds[name], a.pool), 1)
        summary[name] = s
    base = summary.get("fp32")
    if base:
        for s in summary.values():
            if "total_tokens_per_s" in s:
                s["throughput_vs_fp32"] = round(s["total_tokens_per_s"] / base["total_tokens_per_s"], 3)
            if "decode_ms_per_token" in s:
                s["decode_speedup_vs_fp32"] = round(base["decode_ms_per_token"] / s["decode_ms_per_token"], 3)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} cores",
              "command": " ".join(["python", "bench/weight_speed.py"] + sys.argv[1:]), "pool": a.pool,
              "summary": summary, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
