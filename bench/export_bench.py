"""Export benchmark: wall time and peak RSS of `kvexport build` for smollm2-135m (fp32, each
layout; each build in its own process so RSS is the build's alone), graph and weight sizes,
and the validation figures of every family on tiny random models.

    .venv/bin/python bench/export_bench.py [--out bench/results/export.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


_CHILD = """
import resource, sys
from kvexport.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    print("PEAK_RSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def build_in_child(model: str, out: Path, *extra: str) -> dict:
    """One `kvexport build` in a fresh process: its wall time and its own peak RSS."""
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-P", "-c", _CHILD, "build", model, "--out", str(out), "--force", *extra],
                       capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"build failed:\n{r.stderr[-3000:]}")
    peak_kib = int([l for l in r.stderr.splitlines() if l.startswith("PEAK_RSS_KIB")][-1].split()[1])
    m = json.loads((out / "kvexport.json").read_text())
    return {"wall_s": round(wall, 1), "peak_rss_mib": round(peak_kib / 1024, 1),
            "graph_bytes": {k: v["bytes"] for k, v in m["graphs"].items()},
            "weights_bytes": m["weights"]["bytes"], "parameters": m["weights"]["parameters"],
            "kv_bytes_per_token": m["kv"]["bytes_per_token"],
            "validation": {k: m["validation"][k] for k in ("max_abs_diff", "greedy_identical", "token_agreement",
                                                            "prompt_lengths", "steps")}}


def tiny_families(tmp: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import make_hf_folder  # the test suite's tiny model factory

    from kvexport import io
    from kvexport.exporter.build import BuildOptions, build

    cases = {"llama": dict(num_key_value_heads=2), "mistral": dict(num_key_value_heads=2, sliding_window=8),
             "qwen2": dict(num_key_value_heads=2), "phi3": dict(num_key_value_heads=2), "gpt2": {}}
    out = {}
    for fam, ov in cases.items():
        src = make_hf_folder(fam, tmp / f"hf-{fam}", **ov)
        for layout in io.KVLayout:
            for dtype in (io.DType.FP32, io.DType.FP16):
                _, m = build(str(src), tmp / f"b-{fam}-{layout.value}-{dtype.value}",
                             BuildOptions(layout=layout, dtype=dtype, block_size=4, max_seq_len=64))
                v = m.validation
                assert v is not None  # validated builds
                out[f"{fam}/{layout.value}/{dtype.value}"] = {"max_abs_diff": v.max_abs_diff,
                                                               "greedy_identical": v.greedy_identical,
                                                               "token_agreement": v.token_agreement}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/export.json")
    ap.add_argument("--skip-real", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    results = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "command": "python bench/export_bench.py"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not args.skip_real:
            for layout in ("paged", "contiguous"):
                results[f"smollm2-135m/{layout}/fp32"] = build_in_child("smollm2-135m", tmp / layout, "--layout", layout)
                print(layout, json.dumps(results[f"smollm2-135m/{layout}/fp32"]), flush=True)
        results["tiny_families"] = tiny_families(tmp)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
