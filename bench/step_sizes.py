"""Time of one engine step of M tokens (one sequence's prompt of M tokens) for a block-wise
quantized build, in each of its sessions: the small-step one (MatMulNBits at level 4) and the
large-step one of `--weight-matmul-accuracy` (auto: int8 pairs for fp32 builds, float for fp16
int4; int8: per-channel int8 x per-token int8). Where the second starts to win is
runtime/execution/session_plan.py LARGE_STEP_TOKENS.

    .venv/bin/python bench/step_sizes.py BUILD [--accuracy int8] [--sizes 1,2,4,8,16,32,64]
        [--threads 2] [--repeats 7] [--out bench/results/step_sizes.json]

Each prompt is fresh random ids (prefix caching off), timed as generate(max_tokens=1); median
of `--repeats`. NOTE: on a shared machine rerun on a quiet one; compare columns, not runs.
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
    ap.add_argument("build")
    ap.add_argument("--accuracy", default="int8", choices=("auto", "int8"))
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/step_sizes.json")
    a = ap.parse_args()

    import numpy as np

    from kvexport import LLM, SamplingParams
    from kvexport.runtime.execution import session_plan

    sizes = [int(s) for s in a.sizes.split(",")]
    form = None
    cols = {}
    for name, threshold in (("small (level 4)", 10**9), ("large", 1)):
        # every step in one session
        session_plan.LARGE_STEP_TOKENS.update(dict.fromkeys(session_plan.LARGE_STEP_TOKENS, threshold))
        llm = LLM(a.build, threads=a.threads, kv_cache_memory="256MiB", weight_matmul_accuracy=a.accuracy,
                  enable_prefix_caching=False)
        form = llm.engine.backend.large_form
        if form is None:
            raise SystemExit(f"{a.build} with accuracy {a.accuracy} has no large-step session")
        rng = np.random.default_rng(0)
        vocab = llm.engine.manifest.model.vocab_size
        ms = {}
        for m in sizes:
            times = []
            for i in range(a.repeats + 1):
                prompt = rng.integers(3, vocab, m).tolist()
                t = time.perf_counter()
                llm.generate([prompt], SamplingParams(max_tokens=1))
                if i:  # the first of each size warms up
                    times.append(time.perf_counter() - t)
            ms[m] = round(statistics.median(times) * 1e3, 2)
        cols[name if name != "large" else f"large ({form})"] = ms
        del llm
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} cores",
              "build": a.build, "accuracy": a.accuracy, "large_form": form, "ms_per_step": cols}
    print(f"{'M':>5s}" + "".join(f"  {c:>18s}" for c in cols))
    for m in sizes:
        print(f"{m:5d}" + "".join(f"  {cols[c][m]:18.2f}" for c in cols))
    out = Path(a.out)
    runs = json.loads(out.read_text()) if out.is_file() else {}
    runs[f"{Path(a.build).name}@{a.accuracy}"] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
