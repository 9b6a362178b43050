"""`kvexport dynamo` end to end on loopback: a real `python -m dynamo.frontend --router-mode kv` and
two `kvexport dynamo` workers of one tiny build, found through Dynamo's file discovery in a temp
folder (no etcd, no NATS), each with Dynamo's system server on a free port (its /metrics carries
kvexport's metrics). An OpenAI-style client (httpx) gets kvexport's own greedy tokens (LLM on the
same build), streamed and not; the frontend's stop strings and Dynamo's error statuses for what
the worker refuses; a client that leaves mid-stream frees the request's blocks; a Dynamo KV router
in the test process sees the blocks a worker stored (the worker's KV events hash as the router
hashes the request) and the frontend's router sends shared prefixes back to that worker.

Skipped, saying why, where the `dynamo` extra is not installed (CI installs it:
scripts/install_dev.sh)."""

import asyncio
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

dynamo_llm = pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed (scripts/install_dev.sh "
                                                      "installs it; docs/DEPLOYMENT.md)")
httpx = pytest.importorskip("httpx")

NS = "kvxtest"
MODEL = "tiny"
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "dynamo_routing.py"


def _bench():
    """bench/dynamo_routing.py, whose `local_cluster` starts the frontend and the workers."""
    spec = importlib.util.spec_from_file_location("kvexport_bench_dynamo_routing", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _bench()


@pytest.fixture(scope="module")
def cluster(bench, chat_build, tmp_path_factory):
    with bench.local_cluster(chat_build, tmp_path_factory.mktemp("dynamo"), 2, "kv", ("--kv-cache-memory", "4MiB"),
                             namespace=NS, model=MODEL) as c:
        yield c


def complete(cluster, **body) -> dict:
    r = httpx.post(f"{cluster.base}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(choice: dict) -> list[int]:
    """Token ids of a completion asked for with logprobs and return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def test_the_frontend_serves_kvexports_greedy_tokens(cluster, chat_build):
    from kvexport import LLM, SamplingParams

    prompts = [[100 + i for i in range(12)], [7, 7, 8, 9, 30000, 12, 5]]
    ref = LLM(chat_build, threads=1, kv_cache_memory="4MiB").generate(prompts, SamplingParams(max_tokens=10))
    for prompt, want in zip(prompts, ref):
        body = dict(prompt=prompt, max_tokens=10, temperature=0, logprobs=0, return_tokens_as_token_ids=True)
        out = complete(cluster, **body)
        assert _ids(out["choices"][0]) == want.token_ids
        assert out["usage"]["completion_tokens"] == len(want.token_ids)
        # streamed: the same tokens, chunk by chunk
        with httpx.stream("POST", f"{cluster.base}/v1/completions", json={"model": MODEL, "stream": True, **body},
                          timeout=60) as r:
            got = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
        assert [t for c in got for t in _ids(c["choices"][0])] == want.token_ids
        assert got[-1]["choices"][0]["finish_reason"] == "length"
    # a stop string (the frontend's job): the text ends before it and the request ends with "stop"
    text = complete(cluster, prompt=prompts[0], max_tokens=10, temperature=0)["choices"][0]["text"]
    cut = text[len(text) // 2:].strip()[:4]
    stopped = complete(cluster, prompt=prompts[0], max_tokens=10, temperature=0, stop=[cut])["choices"][0]
    assert (stopped["text"], stopped["finish_reason"]) == (text[:text.index(cut)], "stop")


def test_what_the_worker_refuses_is_a_400_naming_the_field(cluster):
    r = httpx.post(f"{cluster.base}/v1/completions", json={"model": MODEL, "prompt": [5, 6], "n": 2}, timeout=30)
    assert r.status_code == 400 and "sampling_options.n" in r.text, r.text
    r = httpx.post(f"{cluster.base}/v1/completions", json={"model": MODEL, "prompt": [5] * 80}, timeout=30)
    assert r.status_code == 400 and "context holds 64" in r.text, r.text


def test_a_client_leaving_mid_stream_frees_its_blocks(cluster, bench):
    before = [cluster.worker_metrics(i)["kvexport_requests_cancelled_total"] for i in (0, 1)]
    body = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster.base}/v1/completions", json=body, timeout=60) as r:
        for n, line in enumerate(r.iter_lines()):
            if n >= 2:
                break  # leave: the frontend kills the request's context on the worker

    def freed() -> bool:
        m = [cluster.worker_metrics(i) for i in (0, 1)]
        return (sum(x["kvexport_requests_cancelled_total"] for x in m) == sum(before) + 1
                and all(x["kvexport_kv_blocks_used"] == 0 and x["kvexport_requests_running"] == 0 for x in m))

    bench.wait_until(freed, "the cancelled request's blocks freed", cluster.log_text, timeout=30)
    m = [cluster.worker_metrics(i) for i in (0, 1)]
    assert sum(x["kvexport_generation_tokens_total"] for x in m) < 1000  # it did not run to the end unobserved


def test_kv_events_reach_dynamos_router_and_shared_prefixes_go_back_to_their_worker(cluster):
    prefixes = [[1000 + 100 * p + i for i in range(32)] for p in range(3)]  # two 16-token blocks each

    async def overlap_after(prompt: list[int]) -> dict[int, int]:
        # the KV router the frontend runs, in this process, fed by the workers' KV events only
        from dynamo.runtime import DistributedRuntime

        env = {k: cluster.env[k] for k in ("DYN_FILE_KV", "DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST")}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
            router = dynamo_llm.KvRouter(rt.endpoint(f"{NS}.backend.generate"), 16, dynamo_llm.KvRouterConfig())
            await asyncio.sleep(1.0)  # subscribed to the workers' event streams
            await asyncio.to_thread(complete, cluster, prompt=prompt, max_tokens=2)
            deadline = time.monotonic() + 20
            while True:
                scores = {w["worker_id"]: w["device_blocks"] for w in (await router.get_overlap_scores(prompt))["workers"]}
                if any(scores.values()) or time.monotonic() > deadline:
                    rt.shutdown()
                    return scores
                await asyncio.sleep(0.2)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    probe = prefixes[0] + [5, 6, 7]
    scores = asyncio.run(overlap_after(probe))
    # one worker holds the prompt's two full blocks, as the router hashes them; the other none
    assert sorted(scores.values()) == [0, 2], scores

    hits = []
    for prefix in prefixes[1:]:
        complete(cluster, prompt=prefix + [9], max_tokens=2)
        time.sleep(0.3)  # the stored blocks reach the router (KV events are asynchronous)
        for suffix in ([1, 2, 3], [4, 5, 6, 7], [8]):
            hits.append(complete(cluster, prompt=prefix + suffix, max_tokens=2)["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert hits == [32] * 6  # every follow-up went to the worker holding its prefix
