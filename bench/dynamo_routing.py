"""KV-aware routing with NVIDIA Dynamo: prefix hit rate and TTFT of `kvexport dynamo` workers behind
`python -m dynamo.frontend --router-mode kv` vs `--router-mode round-robin` (and one worker alone,
the hit rate kv routing should approach), on 127.0.0.1 with Dynamo's file discovery (no etcd/NATS).

Workload: several long shared prefixes (token ids drawn with a fixed seed; --prefixes of
--prefix-tokens each), every prefix asked --rounds times with a distinct short suffix, in a
shuffled order (fixed seed), --concurrency requests at a time, streamed (greedy, --max-tokens).
Per configuration a fresh cluster (cold caches): the frontend, then the workers (each
`--threads 1`), ready when the frontend lists them all. Reported per configuration: the prompt
tokens served from a prefix cache (the `cached_tokens` of each response's usage, summed over
requests, / the prompt tokens), the workers' own block hit rate (kvexport_prefix_cache_hits_total /
queries_total from their /metrics), TTFT p50/p90 and the end-to-end time.

    .venv/bin/python bench/dynamo_routing.py --json bench/results/dynamo_routing.json   # --concurrency 2: _c2

`local_cluster` is also what tests/runtime/serving/test_dynamo_worker.py starts its cluster with.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator

import httpx

from kvexport.runtime.serving.dynamo_events import EventBroker

HERE = Path(__file__).resolve().parent
READY = re.compile(r"dynamo worker: model '.*' on dyn://")
MODEL = "bench"


def low_free_ports(n: int) -> list[int]:
    """n free TCP ports below 32768 (Dynamo 1.6.1 reads DYN_SYSTEM_PORT as a 16-bit signed integer)."""
    out: list[int] = []
    rng = random.Random()
    while len(out) < n:
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in out:
            out.append(port)
    return out


class Cluster:
    """A running frontend + workers: the frontend's base URL, each worker's /metrics URL, each
    worker's process (`workers[i]`; `start_worker(i)` starts worker i again, e.g. after a kill)."""

    def __init__(self, base: str, metrics: list[str], env: dict, logs: list[Path], namespace: str):
        self.base, self.metrics, self.env, self.logs, self.namespace = base, metrics, env, logs, namespace
        self.workers: list[subprocess.Popen] = []
        self.start_worker: Callable[[int], subprocess.Popen] = lambda i: None  # set by local_cluster

    def ready_workers(self) -> int:
        """Workers the frontend's /health lists now (0 when it does not answer)."""
        try:
            health = httpx.get(f"{self.base}/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return 0
        return sum(i.get("endpoint") == "generate" for i in health.get("instances", []))

    def worker_metrics(self, i: int) -> dict[str, float]:
        text = httpx.get(self.metrics[i], timeout=10).text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(kvexport_\w+) (\S+)$", text, re.M)}

    def log_text(self) -> str:
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in self.logs)


def wait_until(cond, what: str, logs, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout} s\n{logs()}")
        time.sleep(0.2)


@contextlib.contextmanager
def local_cluster(build_dir: str | Path, tmp: Path, workers: int = 2, router_mode: str = "kv",
                  worker_args: tuple[str, ...] = (), namespace: str = "kvxbench",
                  model: str = MODEL, timeout: float = 300.0,
                  frontend_args: tuple[str, ...] = (),
                  each_worker_args: list[tuple[str, ...]] | None = None) -> Iterator[Cluster]:
    """`python -m dynamo.frontend` (+ `frontend_args`) + `workers` × `kvexport dynamo build_dir` on
    127.0.0.1 (file discovery in `tmp`, Dynamo's system server with kvexport's /metrics on a free
    port per worker); yields once the frontend's /health lists every worker and /v1/models the
    model; stops them all (SIGTERM, then SIGKILL). `each_worker_args[i]`: worker i's own arguments
    after `worker_args` (e.g. its --mode prefill / decode: bench/dynamo_disagg.py)."""
    tmp.mkdir(parents=True, exist_ok=True)
    http = low_free_ports(1 + workers)
    # the event plane through a broker on loopback (docs/DEPLOYMENT.md): nothing listens beyond 127.0.0.1
    broker = None if "DYN_ZMQ_BROKER_URL" in os.environ else EventBroker().start()
    env = dict(os.environ, DYN_DISCOVERY_BACKEND="file", DYN_FILE_KV=str(tmp / "kv"), DYN_TCP_RPC_HOST="127.0.0.1",
               DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1", DYN_SYSTEM_HOST="127.0.0.1", DYN_LOG="warn",
               COLUMNS="400", HF_HUB_OFFLINE="1", ORT_DISABLE_TELEMETRY="1",
               **({"DYN_ZMQ_BROKER_URL": broker.url} if broker is not None else {}))
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []

    def start(name: str, args: list[str], **extra) -> subprocess.Popen:
        log = tmp / f"{name}.log"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen(args, cwd=str(tmp), stdout=f, stderr=subprocess.STDOUT,
                                          env=dict(env, **extra)))
        return procs[-1]

    c = Cluster(f"http://127.0.0.1:{http[0]}", [f"http://127.0.0.1:{p}/metrics" for p in http[1:]], env, logs,
                namespace)

    def start_worker(i: int) -> subprocess.Popen:
        n = sum(1 for p in logs if p.name.startswith(f"worker{i}"))  # worker0.log, then worker0-2.log, ...
        p = start(f"worker{i}" + (f"-{n + 1}" if n else ""),
                  [sys.executable, "-m", "kvexport.cli", "dynamo", str(build_dir), "--namespace", namespace,
                   "--served-model-name", model, "--threads", "1", *worker_args,
                   *(each_worker_args[i] if each_worker_args else ())], DYN_SYSTEM_PORT=str(http[1 + i]))
        if i < len(c.workers):
            c.workers[i] = p
        else:
            c.workers.append(p)
        return p

    c.start_worker = start_worker
    try:
        start("frontend", [sys.executable, "-m", "dynamo.frontend", "--router-mode", router_mode,
                           "--discovery-backend", "file", "--namespace", namespace, "--http-host", "127.0.0.1",
                           "--http-port", str(http[0]), *frontend_args])
        for i in range(workers):
            start_worker(i)

        def up() -> bool:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a process exited with {p.returncode}:\n{c.log_text()}")
            if not all(READY.search(log.read_text(errors="replace")) for log in logs[1:]):
                return False
            try:
                health = httpx.get(f"{c.base}/health", timeout=5).json()
                models = httpx.get(f"{c.base}/v1/models", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                return False
            return (sum(i["endpoint"] == "generate" for i in health.get("instances", [])) == workers
                    and any(m.get("id") == model for m in models.get("data", [])))

        wait_until(up, f"the frontend with {workers} kvexport worker(s)", c.log_text, timeout)
        yield c
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        if broker is not None:
            broker.close()


# ---- the workload ------------------------------------------------------------------------------
def workload(prefixes: int, prefix_tokens: int, rounds: int, suffix_tokens: int, seed: int = 0) -> list[list[int]]:
    """Prompts (token ids): `rounds` requests per prefix, each with its own suffix, shuffled."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1000, 40000) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    prompts = [h + [rng.randrange(1000, 40000) for _ in range(suffix_tokens)] for h in heads for _ in range(rounds)]
    rng.shuffle(prompts)
    return prompts


async def _one(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, usage = None, None
    async for d in completion_chunks(client, base, prompt, max_tokens, stream_options={"include_usage": True}):
        if ttft is None and d.get("choices") and d["choices"][0].get("text"):
            ttft = time.perf_counter() - t0
        usage = d.get("usage") or usage
    assert usage is not None, "no usage in the stream"
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


async def run_workload(base: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[dict]:
    todo = list(enumerate(prompts))
    out: list[dict] = [{}] * len(prompts)
    async with httpx.AsyncClient(timeout=300) as client:
        async def lane() -> None:
            while todo:
                i, p = todo.pop(0)
                out[i] = await _one(client, base, p, max_tokens)

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return out


# ---- the client and the report (bench/dynamo_disagg.py uses these too) ------------------------------
async def completion_chunks(client: httpx.AsyncClient, base: str, prompt: list[int], max_tokens: int,
                            **extra) -> AsyncIterator[dict]:
    """The chunks of one streamed `POST base/v1/completions` (model MODEL, greedy, ignore_eos; `extra`
    added to the body), each `data:` line parsed, up to `[DONE]`."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, **extra}
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                yield json.loads(line[5:])


def pct(xs: list[float], q: float) -> float | None:
    """The q quantile (0..1) of xs, the nearest rank; None when xs is empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def paged_build(build: str | None) -> Path:
    """--build, or (when not given) smollm2-135m as a paged build with 512 positions, built into
    bench/.cache once."""
    if build:
        return Path(build)
    from kvexport.exporter.build import BuildOptions, build as build_model

    build_dir = HERE / ".cache" / "smollm2-135m-paged"
    if not (build_dir / "kvexport.json").is_file():
        build_model("smollm2-135m", build_dir, BuildOptions(max_seq_len=512, validate=False, force=True))
    return build_dir


def write_report(args, build_dir: Path, workload_args: tuple[str, ...], rows: list[dict]) -> None:
    """Print the result as JSON (and write it to args.json when given): the date, the machine with its
    load average at the end, the build's name, the workload (those of args' fields) and the rows."""
    result = {"date": dt.date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end",
              "build": str(build_dir.name), "workload": {k: getattr(args, k) for k in workload_args}, "rows": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


def measure(build_dir: Path, tmp: Path, workers: int, router_mode: str, prompts: list[list[int]], args) -> dict:
    with local_cluster(build_dir, tmp, workers, router_mode, ("--kv-cache-memory", args.kv_cache_memory)) as c:
        t0 = time.perf_counter()
        res = asyncio.run(run_workload(c.base, prompts, args.max_tokens, args.concurrency))
        wall = time.perf_counter() - t0
        m = [c.worker_metrics(i) for i in range(workers)]
    ttft = [r["ttft_s"] for r in res if r["ttft_s"] is not None]
    q = sum(x["kvexport_prefix_cache_queries_total"] for x in m)
    return {"workers": workers, "router_mode": router_mode, "requests": len(res),
            "prompt_tokens_cached": sum(r["cached_tokens"] for r in res) / sum(r["prompt_tokens"] for r in res),
            "block_hit_rate": sum(x["kvexport_prefix_cache_hits_total"] for x in m) / q if q else 0.0,
            "requests_per_worker": [int(x["kvexport_requests_total"]) for x in m],
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", help="a paged build directory [smollm2-135m, built into bench/.cache]")
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--prefix-tokens", type=int, default=320)
    ap.add_argument("--suffix-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    build_dir = paged_build(args.build)
    prompts = workload(args.prefixes, args.prefix_tokens, args.rounds, args.suffix_tokens)
    tmp = HERE / ".cache" / "dynamo_routing"
    rows = [measure(build_dir, tmp / f"{mode}-{n}", n, mode, prompts, args)
            for n, mode in ((2, "kv"), (2, "round-robin"), (1, "kv"))]
    write_report(args, build_dir, ("prefixes", "prefix_tokens", "suffix_tokens", "rounds", "max_tokens",
                                   "concurrency", "kv_cache_memory"), rows)


if __name__ == "__main__":
    main()
