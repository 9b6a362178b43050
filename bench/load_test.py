"""Load test of `kvexport serve` (the OpenAI-compatible server) on 127.0.0.1.

Starts the server on a build (smollm2-135m by default, built into bench/.cache if no
--build is given), sends N concurrent streaming /v1/completions requests (distinct
prompts, greedy, ignore_eos so every completion has exactly --max-tokens tokens), and
checks that none is lost or duplicated: every stream reassembles into one completion
with one id (unique across requests), one finish_reason ("length"), a usage count equal
to --max-tokens, and a final [DONE]. Reports TTFT / end-to-end latency p50/p99 and
throughput as JSON (stdout and --json), with the date, the machine and its load average.

    .venv/bin/python bench/load_test.py --requests 200 --json bench/results/load_test.json

Bounded: every request has a timeout, the whole run a deadline, and the server is
stopped (process group) however the run ends. `run_load` and `served` are imported by
tests/runtime/serving/test_server_load.py for a small version of the same check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvexport.runtime.serving.triton_local import ServerStartError, wait_http_ready

HOST = "127.0.0.1"
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(build_dir: str | Path, kv_cache_memory: str = "512MiB", max_num_seqs: int = 64, threads: int | None = None,
           log_path: str | Path | None = None, startup_timeout: float = 120.0):
    """Run `kvexport serve` on a free loopback port; yields its base URL; always stops it."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvexport.cli", "serve", str(build_dir), "--host", HOST, "--port", str(port),
           "--kv-cache-memory", kv_cache_memory, "--max-num-seqs", str(max_num_seqs)]
    if threads:
        cmd += ["--threads", str(threads)]
    log_path = Path(log_path or os.devnull)
    base = f"http://{HOST}:{port}"
    with open(log_path, "w") as log:
        # NOTE: cwd outside the repository, so `kvexport` is the installed package
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd="/", start_new_session=True)
    try:
        try:
            wait_http_ready(f"{base}/health", proc, startup_timeout)
        except ServerStartError as e:
            tail = log_path.read_text(errors="replace")[-3000:] if log_path.name != os.devnull else ""
            raise RuntimeError(f"kvexport serve did not start: {e}\n{tail}") from None
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def prompt(i: int) -> str:
    topics = ["the ocean", "a mountain", "the moon", "a small town", "trains", "bees", "a library", "winter"]
    return f"Request {i}. Write one sentence about {topics[i % len(topics)]}:"


async def _one(client: httpx.AsyncClient, base: str, model: str, i: int, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    r = {"index": i, "ids": set(), "text": "", "finish_reasons": [], "usage": None, "done": 0, "ttft": None,
         "latency": None, "error": None, "chunks": 0}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    r["done"] += 1
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    r["error"] = chunk["error"]
                    continue
                r["ids"].add(chunk["id"])
                r["chunks"] += 1
                if chunk.get("usage"):
                    r["usage"] = chunk["usage"]
                for c in chunk["choices"]:
                    if c["text"] and r["ttft"] is None:
                        r["ttft"] = time.perf_counter() - t0
                    r["text"] += c["text"]
                    if c.get("finish_reason"):
                        r["finish_reasons"].append(c["finish_reason"])
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r["error"] = f"{type(e).__name__}: {e}"
    r["latency"] = time.perf_counter() - t0
    return r


def check(results: list[dict], n: int, max_tokens: int) -> list[str]:
    """Problems found: lost, failed, incomplete or duplicated completions."""
    problems = []
    if len(results) != n:
        problems.append(f"{n - len(results)} requests lost")
    seen: dict[str, int] = {}
    for r in results:
        i = r["index"]
        if r["error"]:
            problems.append(f"request {i}: {r['error']}")
            continue
        if len(r["ids"]) != 1:
            problems.append(f"request {i}: {len(r['ids'])} completion ids in one stream")
        for cid in r["ids"]:
            if cid in seen:
                problems.append(f"request {i}: completion id {cid} also seen in request {seen[cid]}")
            seen[cid] = i
        if r["finish_reasons"] != ["length"]:
            problems.append(f"request {i}: finish reasons {r['finish_reasons']} (want exactly one 'length')")
        if r["done"] != 1:
            problems.append(f"request {i}: {r['done']} [DONE] markers")
        if not r["usage"] or r["usage"]["completion_tokens"] != max_tokens:
            problems.append(f"request {i}: usage {r['usage']} (want {max_tokens} completion tokens)")
        if not r["text"]:
            problems.append(f"request {i}: empty text")
    return problems


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs) + 0.5)) - 1))]


async def run_load_async(base: str, n: int, max_tokens: int, timeout: float) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits) as client:
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_one(client, base, model, i, max_tokens)) for i in range(n)]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        wall = time.perf_counter() - t0
    return [t.result() for t in done], wall


def run_load(base: str, n: int, max_tokens: int, timeout: float = 600.0) -> dict:
    """Send n concurrent streaming requests; returns the figures and the problems found."""
    results, wall = asyncio.run(run_load_async(base, n, max_tokens, timeout))
    problems = check(results, n, max_tokens)
    ok = [r for r in results if not r["error"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    lat = [r["latency"] for r in ok]
    tokens = sum((r["usage"] or {}).get("completion_tokens", 0) for r in ok)
    ms = lambda x: None if x is None else round(1000 * x, 1)  # noqa: E731
    return {"requests": n, "completed": len(ok), "max_tokens": max_tokens, "problems": problems,
            "wall_s": round(wall, 2), "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 2),
            "requests_per_s": round(len(ok) / wall, 3),
            "ttft_ms": {"p50": ms(_pct(ttft, 50)), "p99": ms(_pct(ttft, 99)), "max": ms(max(ttft, default=None))},
            "latency_ms": {"p50": ms(_pct(lat, 50)), "p99": ms(_pct(lat, 99))}}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    mem = next((int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), None) if Path("/proc/meminfo").exists() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_mib": mem, "os": platform.platform(),
            "python": platform.python_version()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", help="a paged build directory [smollm2-135m, built into bench/.cache]")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900.0, help="deadline of the whole run, seconds")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    build_dir = args.build
    if build_dir is None:
        from kvexport.exporter.build import BuildOptions, build

        build_dir = HERE / ".cache" / "smollm2-135m-paged"
        if not (build_dir / "kvexport.json").exists():
            build("smollm2-135m", build_dir, BuildOptions(max_seq_len=512, validate=False, force=True))
    load_before = os.getloadavg()
    with served(build_dir, args.kv_cache_memory, args.max_num_seqs, log_path=HERE / ".cache" / "load_test_server.log"
                if (HERE / ".cache").is_dir() else None) as base:
        report = run_load(base, args.requests, args.max_tokens, args.timeout)
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
    kv = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
          if line.startswith(("kvexport_preemptions_total", "kvexport_prefix_cache_hit_rate"))}
    report = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "build": str(build_dir),
              "server": {"kv_cache_memory": args.kv_cache_memory, "max_num_seqs": args.max_num_seqs,
                         "endpoint": "/v1/completions stream=true, temperature 0, ignore_eos"},
              **report, "server_metrics": kv, "machine": machine(),
              "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
