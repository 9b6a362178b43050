"""Disaggregated vs aggregated serving with NVIDIA Dynamo (issue 26 §3): TTFT and inter-token
latency p50/p99 of `kvexport dynamo` workers behind `python -m dynamo.frontend` under a
prefill-heavy mixed load, one `--mode prefill` + one `--mode decode` worker (KV handed over
through NIXL) vs two aggregated workers (round-robin), on 127.0.0.1 with Dynamo's file discovery.

Workload (fixed seed, no shared prefixes): --requests requests arriving open-loop (Poisson,
--rate per second), alternately "long" (--long-prompt tokens in, --long-out out: prefill-heavy)
and "chat" (--chat-prompt in, --chat-out out), streamed, greedy, ignore_eos. Per request: TTFT
(first text chunk) and the gaps between later chunks (one token each); reported per kind and
overall: TTFT p50/p99, inter-token latency p50/p99, end-to-end time; plus, for the disaggregated
pair, the blocks the decode worker pulled and the time it spent reading them.

    .venv/bin/python bench/dynamo_disagg.py --json bench/results/dynamo_disagg.json

Each worker runs `--threads 1`, so both configurations use the same two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import json
import os
import platform
import random
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
MODEL = "bench"


def _routing():
    spec = importlib.util.spec_from_file_location("kvexport_bench_dynamo_routing", HERE / "dynamo_routing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def workload(args) -> list[tuple[float, str, list[int], int]]:
    """(arrival offset s, kind, prompt, max_tokens) per request, in arrival order."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for i in range(args.requests):
        kind = "long" if i % 2 == 0 else "chat"
        n, m = (args.long_prompt, args.long_out) if kind == "long" else (args.chat_prompt, args.chat_out)
        out.append((t, kind, [rng.randrange(1000, 40000) for _ in range(n)], m))
        t += rng.expovariate(args.rate)
    return out


async def _one(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or "[DONE]" in line:
                continue
            d = json.loads(line[5:])
            if d.get("choices") and d["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    return {"ttft_s": stamps[0] - t0 if stamps else None, "itl_s": [b - a for a, b in zip(stamps, stamps[1:])],
            "latency_s": time.perf_counter() - t0, "chunks": len(stamps)}


async def run(base: str, reqs) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()

        async def at(offset, kind, prompt, m):
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
            return {"kind": kind, **await _one(client, base, prompt, m)}

        return await asyncio.gather(*(at(*r) for r in reqs))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(res: list[dict]) -> dict:
    out = {}
    for kind in ("all", "long", "chat"):
        rs = [r for r in res if kind == "all" or r["kind"] == kind]
        ttft = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
        itl = [g for r in rs for g in r["itl_s"]]
        out[kind] = {"requests": len(rs), "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
                     "itl_p50_s": _pct(itl, 0.5), "itl_p99_s": _pct(itl, 0.99),
                     "latency_p50_s": _pct([r["latency_s"] for r in rs], 0.5)}
    return out


def measure(build_dir: Path, tmp: Path, disagg: bool, reqs, args) -> dict:
    bench = _routing()
    each = [("--mode", "prefill"), ("--mode", "decode")] if disagg else None
    with bench.local_cluster(build_dir, tmp, 2, "round-robin", ("--kv-cache-memory", args.kv_cache_memory),
                             namespace="kvxdisaggbench", model=MODEL, each_worker_args=each) as c:
        # one warm-up request per worker (onnxruntime's first run of each step shape is slow)
        asyncio.run(run(c.base, [(0.0, "warm", [5, 6, 7] * 20, 4), (0.0, "warm", [8, 9] * 30, 4)]))
        t0 = time.perf_counter()
        res = asyncio.run(run(c.base, reqs))
        wall = time.perf_counter() - t0
        m = [c.worker_metrics(i) for i in range(2)]
    row = {"config": "1 prefill + 1 decode (NIXL)" if disagg else "2 aggregated (round-robin)", "wall_s": wall,
           **summarize(res)}
    if disagg:
        row["pulled_blocks"] = int(m[1].get("kvexport_disagg_pulled_blocks_total", 0))
        row["pull_seconds"] = m[1].get("kvexport_disagg_pull_seconds_total", 0.0)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", help="a paged build directory [smollm2-135m, built into bench/.cache]")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=0.5, help="arrivals per second (Poisson)")
    ap.add_argument("--long-prompt", type=int, default=384)
    ap.add_argument("--long-out", type=int, default=8)
    ap.add_argument("--chat-prompt", type=int, default=24)
    ap.add_argument("--chat-out", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    if args.build:
        build_dir = Path(args.build)
    else:
        from kvexport.exporter.build import BuildOptions, build

        build_dir = HERE / ".cache" / "smollm2-135m-paged"
        if not (build_dir / "kvexport.json").is_file():
            build("smollm2-135m", build_dir, BuildOptions(max_seq_len=512, validate=False, force=True))
    reqs = workload(args)
    tmp = HERE / ".cache" / "dynamo_disagg"
    rows = [measure(build_dir, tmp / name, disagg, reqs, args) for name, disagg in (("agg", False), ("disagg", True))]
    result = {"date": dt.date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end",
              "build": str(build_dir.name), "workload": {k: getattr(args, k) for k in (
                  "requests", "rate", "long_prompt", "long_out", "chat_prompt", "chat_out", "seed",
                  "kv_cache_memory")}, "rows": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
