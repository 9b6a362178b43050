"""What every op's GPU check (its folder's gpu_check.py, run by scripts/gpu_check.sh on a lent GPU,
or at toy sizes on CPU under TRITON_INTERPRET=1 with --tiny) shares: the command line and its JSON
report, the report's header, the correctness loop (one broken case never hides the others) and
its summary lines, median timing with CUDA events, the copy bandwidth the kernels are measured
against, and ragged batches of sequences.

Each op gives its cases, how one case compares with its reference, its timings and its summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from typing import Callable


def ragged(block_size: int, batch: int, ctx: int, q_len: int) -> dict:
    """make_case's q_lens, ctx_lens and num_blocks for `batch` sequences of q_len new tokens after
    contexts ragged around ctx - q_len, with 8 blocks to spare."""
    q_lens = [q_len] * batch
    ctx_lens = [max(0, ctx - q_len - 7 * (i % 3)) for i in range(batch)]
    need = 1 + sum(-(-(c + q) // block_size) for c, q in zip(ctx_lens, q_lens))
    return dict(q_lens=q_lens, ctx_lens=ctx_lens, num_blocks=need + 8)


def report_header(tiny: bool) -> dict:
    """The start of a report: date, host, sizes, torch / triton versions, and the GPU and CUDA version
    when not tiny (tiny runs on CPU)."""
    import torch
    import triton

    report: dict = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                        tiny=tiny, torch=torch.__version__, triton=triton.__version__)
    if not tiny:
        report["gpu"] = torch.cuda.get_device_name()
        report["cuda"] = torch.version.cuda
    return report


def check_cases(device: str, cases: list[dict], compare: Callable[[dict], tuple[float, float, bool]]) -> list[dict]:
    """Each case (a dict with its "name") through compare(the rest of the case) -> (max error,
    tolerance, pools bit-exact): a result each, ok when the error is within the tolerance and the
    pools are exact; a case that raises is a failed result with its error (the others still run)."""
    import torch

    results = []
    for c in cases:
        c = dict(c)
        name = c.pop("name")
        t0 = time.perf_counter()
        try:
            err, tol, pools = compare(c)
            results.append(dict(name=name, ok=bool(err <= tol and pools), max_err=err, tolerance=tol,
                                pools_bit_exact=pools, seconds=round(time.perf_counter() - t0, 2)))
        except Exception as e:  # report and go on: one broken case must not hide the others
            results.append(dict(name=name, ok=False, error=f"{type(e).__name__}: {e}",
                                trace=traceback.format_exc()[-2000:]))
        del c
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def correctness_lines(report: dict, op: str) -> list[str]:
    """The summary's first lines: the op, date, device and versions, then one line per case."""
    lines = [f"{op} GPU check {report['date']} on {report.get('gpu', 'CPU (tiny, interpreter)')} "
             f"(torch {report['torch']}, triton {report['triton']})"]
    for c in report["correctness"]:
        detail = (f"max err {c['max_err']:.2e} (tol {c['tolerance']:.1e}), pools exact {c['pools_bit_exact']}"
                  if "max_err" in c else c.get("error", ""))
        lines.append(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: {detail}")
    return lines


def median_seconds(fn: Callable[[], object], device: str, warmup: int, iters: int) -> float:
    """Median seconds of fn() (CUDA events on the GPU)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int, warmup: int, iters: int) -> float:
    """Device-to-device copy, bytes/s counting read + write."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = median_seconds(lambda: dst.copy_(src), device, warmup, iters)
    return 2 * nbytes / t


def cli(argv, description: str, json_name: str, run: Callable[[bool], dict], summary: Callable[[dict], str]) -> int:
    """The command line of a GPU check: --out, --tiny; run(tiny) -> report, written to
    <out>/json_name ({"error", "trace"} when it raised), then summary(report) printed; 0 when every
    correctness case passed."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help=f"folder for {json_name}")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on CPU under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are decorated then)
    os.makedirs(args.out, exist_ok=True)
    try:
        report = run(args.tiny)
    except Exception as e:
        report = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
        print(report["trace"], file=sys.stderr)
    with open(os.path.join(args.out, json_name), "w") as f:
        json.dump(report, f, indent=1, default=str)
    if "error" in report:
        return 1
    print(summary(report))
    return 0 if report["goals"]["correctness"] else 1
