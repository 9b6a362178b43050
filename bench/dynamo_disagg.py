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
import importlib.util
import random
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


def _routing():
    """bench/dynamo_routing.py: its `local_cluster`, the streamed request and the report."""
    spec = importlib.util.spec_from_file_location("kvexport_bench_dynamo_routing", HERE / "dynamo_routing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _routing()


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
    t0 = time.perf_counter()
    stamps: list[float] = []
    async for d in bench.completion_chunks(client, base, prompt, max_tokens):
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


def summarize(res: list[dict]) -> dict:
    out = {}
    for kind in ("all", "long", "chat"):
        rs = [r for r in res if kind == "all" or r["kind"] == kind]
        ttft = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
        itl = [g for r in rs for g in r["itl_s"]]
        out[kind] = {"requests": len(rs), "ttft_p50_s": bench.pct(ttft, 0.5), "ttft_p99_s": bench.pct(ttft, 0.99),
                     "itl_p50_s": bench.pct(itl, 0.5), "itl_p99_s": bench.pct(itl, 0.99),
                     "latency_p50_s": bench.pct([r["latency_s"] for r in rs], 0.5)}
    return out


def measure(build_dir: Path, tmp: Path, disagg: bool, reqs, args) -> dict:
    each = [("--mode", "prefill"), ("--mode", "decode")] if disagg else None
    with bench.local_cluster(build_dir, tmp, 2, "round-robin", ("--kv-cache-memory", args.kv_cache_memory),
                             namespace="kvxdisaggbench", model=bench.MODEL, each_worker_args=each) as c:
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
    build_dir = bench.paged_build(args.build)
    reqs = workload(args)
    tmp = HERE / ".cache" / "dynamo_disagg"
    rows = [measure(build_dir, tmp / name, disagg, reqs, args) for name, disagg in (("agg", False), ("disagg", True))]
    bench.write_report(args, build_dir, ("requests", "rate", "long_prompt", "long_out", "chat_prompt", "chat_out",
                                         "seed", "kv_cache_memory"), rows)


if __name__ == "__main__":
    main()
