"""A `kvexport dynamo` worker paused past its discovery lease (issue 36 §2), end to end on
loopback: a real `python -m dynamo.frontend` and one worker of a tiny build (Dynamo's file
discovery in a temp folder). The worker is SIGSTOPped mid-stream (a GC pause, a stalled disk, a
throttled container) until the frontend no longer lists it (file discovery's lease, about 10 s),
then SIGCONTed. Dynamo 1.6.1 never registers it again (its keep-alive fails for good), so the
worker says why in one line and exits non-zero within seconds, instead of sitting alive, unlisted
and idle; the stream that was in flight ends (completed or with an error), never hangs; the
worker, started again as a supervisor would, registers as a new instance and serves, from an
empty cache (the frontend's router dropped the old instance and its blocks). A listed worker's
/health (Dynamo's system server) says "ready".

Skipped, saying why, where the `dynamo` extra is not installed (scripts/install_dev.sh)."""

import json
import os
import signal
import threading
import time

import pytest

pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed (scripts/install_dev.sh)")
httpx = pytest.importorskip("httpx")

MODEL = "tiny"
from testkit.bench import script as bench_script  # noqa: E402



@pytest.fixture(scope="module")
def bench():
    """bench/dynamo_routing.py, whose `local_cluster` starts the frontend and the workers."""
    return bench_script("dynamo_routing")


@pytest.fixture(scope="module")
def cluster(bench, chat_build, tmp_path_factory):
    with bench.local_cluster(chat_build, tmp_path_factory.mktemp("pause"), 1, "kv", ("--kv-cache-memory", "4MiB"),
                             namespace="kvxpause", model=MODEL) as c:
        yield c


def _served(cluster) -> bool:
    models = httpx.get(f"{cluster.base}/v1/models", timeout=10).json()
    return any(m.get("id") == MODEL for m in models.get("data", []))


def _health(cluster) -> str:
    """The worker's Dynamo system server's /health status ("ready" / "notready")."""
    return httpx.get(cluster.metrics[0].removesuffix("/metrics") + "/health", timeout=10).json()["status"]


def _cached(cluster, prompt: list[int]) -> int:
    r = httpx.post(f"{cluster.base}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text + cluster.log_text()
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_worker_paused_past_its_lease_exits_non_zero_and_a_restart_serves(cluster, bench):
    prefix = [4000 + i for i in range(16)]  # one block
    assert _cached(cluster, prefix + [1]) == 0
    time.sleep(0.5)  # its KV events reach the router
    assert _cached(cluster, prefix + [2]) == 16
    assert _health(cluster) == "ready"  # once listed (Dynamo 1.6.1 alone leaves it "notready")
    worker = cluster.workers[0]
    paused = threading.Event()
    stream: dict = {"chunks": 0, "error": None, "done": False}

    def client() -> None:
        body = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 50, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{cluster.base}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    if "[DONE]" in line:
                        stream["done"] = True
                        continue
                    d = json.loads(line[5:])
                    if "choices" not in d:
                        stream["error"] = d  # an error event instead of a chunk
                        continue
                    stream["chunks"] += 1
                    if not paused.is_set():
                        os.kill(worker.pid, signal.SIGSTOP)  # mid-stream
                        paused.set()
        except httpx.HTTPError as e:
            stream["error"] = repr(e)

    t = threading.Thread(target=client, daemon=True)
    t.start()
    assert paused.wait(60), cluster.log_text()
    try:  # paused until the lease expires: the frontend lists no worker
        bench.wait_until(lambda: cluster.ready_workers() == 0, "the paused worker dropped from discovery",
                         cluster.log_text, timeout=60)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    resumed = time.monotonic()
    rc = worker.wait(timeout=30)  # not alive and unlisted forever
    log = cluster.logs[1].read_text(errors="replace")
    assert rc != 0 and "lost its registration" in log, log
    assert time.monotonic() - resumed < 15
    t.join(30)
    assert not t.is_alive(), f"the in-flight stream hangs: {stream}\n{cluster.log_text()}"
    assert stream["done"] or stream["error"] is not None, stream  # ended, one way or the other
    # started again (a supervisor's job): a new instance, listed, serving
    cluster.start_worker(0)
    bench.wait_until(lambda: cluster.ready_workers() == 1 and cluster.workers[0].poll() is None
                     and bool(bench.READY.search(cluster.logs[-1].read_text(errors="replace"))) and _served(cluster),
                     "the restarted worker listed, its model served", cluster.log_text, timeout=120)
    # the router's view: the old instance's blocks are gone with it, the new one's are reported anew
    assert _cached(cluster, prefix + [3]) == 0
    time.sleep(0.5)
    assert _cached(cluster, prefix + [4]) == 16
    assert _health(cluster) == "ready"
