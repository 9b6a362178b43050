"""/health latency of a `kvexport serve` subprocess while four big requests arrive at once: how
long the event loop is held by work it should not do (issue 22). Each kind of request is sent by
four threads at once; meanwhile /health is asked one request after another, over a kept-alive
connection and over a new connection each time. Prints one line per kind.

    .venv/bin/python bench/serve_health.py BUILD   (a build with a tokenizer, e.g. the tests' tiny chat build)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

KINDS = {  # each body is about 1 MiB (the body limit) or, for the last, 0.5 MiB of a valid prompt count
    "25,000 prompts": {"prompt": ["hello world " * 3] * 25000, "max_tokens": 1},
    "40 long prompts": {"prompt": ["hello world " * 2000] * 40, "max_tokens": 1},
    "one long chat message": {"messages": [{"role": "user", "content": "hello world " * 80000}], "max_tokens": 1},
    "16 prompts x 30,000 chars": {"prompt": ["word " * 6000] * 16, "max_tokens": 1},
}


def start(build: str, log: Path) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvexport.cli", "serve", build, "--port", "0", "--threads", "1"],
                                stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, COLUMNS="400"))
    while not (m := re.search(r"serving .* on (http://\S+)/v1", log.read_text())):
        if proc.poll() is not None:
            sys.exit(log.read_text())
        time.sleep(0.1)
    return proc, m.group(1)


def measure(base: str, body: dict, fresh: bool) -> tuple[list[float], float, int]:
    raw = json.dumps(body).encode()
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    codes: list[int] = []
    threads = [threading.Thread(target=lambda: codes.append(httpx.post(
        base + route, content=raw, headers={"content-type": "application/json"}, timeout=300).status_code))
        for _ in range(4)]
    client, lat = httpx.Client(timeout=300), []
    t0 = time.monotonic()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        h0 = time.monotonic()
        (httpx.get if fresh else client.get)(base + "/health", timeout=300)
        lat.append(time.monotonic() - h0)
    for t in threads:
        t.join()
    return lat or [0.0], time.monotonic() - t0, codes[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, base = start(args.build, Path(tmp) / "serve.log")
        try:
            for fresh in (False, True):
                way = "a new connection each" if fresh else "kept alive"
                client = httpx.Client(timeout=60)
                idle = []
                for _ in range(10):
                    h0 = time.monotonic()
                    (httpx.get if fresh else client.get)(base + "/health", timeout=60)
                    idle.append(time.monotonic() - h0)
                print(f"/health over {way}: idle median {statistics.median(idle):.3f} s")
                for name, body in KINDS.items():
                    lat, took, code = measure(base, body, fresh)
                    print(f"  4 x {name}: answered {code} in {took:.1f} s; /health x{len(lat)}: median "
                          f"{statistics.median(lat):.3f} s, max {max(lat):.3f} s")
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
