"""`kvexport dynamo` end to end on loopback: a real `python -m dynamo.frontend --router-mode kv` and
two `kvexport dynamo` workers of one tiny build, found through Dynamo's file discovery in a temp
folder (no etcd, no NATS), each with Dynamo's system server on a free port (its /metrics carries
kvexport's metrics). An OpenAI-style client (httpx) gets kvexport's own greedy tokens (LLM on the
same build), streamed and not; the frontend's stop strings and Dynamo's error statuses for what
the worker refuses; a client that leaves mid-stream frees the request's blocks; a Dynamo KV router
in the test process sees the blocks a worker stored (the worker's KV events hash as the router
hashes the request) and the frontend's router sends shared prefixes back to that worker.

Tenant salts: a request's `cache_salt` reaches the worker through the frontend, its blocks are
reported under that salt (the router finds them for the salted request only), salted follow-ups
go back to their worker and hit, other salts and unsalted requests never share those blocks.

Faults (the frontend runs with `--migration-limit 3`, Dynamo's request migration): a worker
SIGKILLed mid-stream, its request continues on the other worker and the client gets exactly
kvexport's greedy tokens; the survivor is back to idle (no blocks held); the killed worker,
started again, registers again and serves, and ends idle too.

Skipped, saying why, where the `dynamo` extra is not installed (CI installs it:
scripts/install_dev.sh)."""

import asyncio
import json
import os
import signal
import threading
import time

import pytest

dynamo_llm = pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed (scripts/install_dev.sh "
                                                      "installs it; docs/DEPLOYMENT.md)")
httpx = pytest.importorskip("httpx")

NS = "kvxtest"
MODEL = "tiny"
from testkit.bench import script as bench_script  # noqa: E402



@pytest.fixture(scope="module")
def bench():
    """bench/dynamo_routing.py, whose `local_cluster` starts the frontend and the workers."""
    return bench_script("dynamo_routing")


@pytest.fixture(scope="module")
def cluster(bench, chat_build, tmp_path_factory):
    with bench.local_cluster(chat_build, tmp_path_factory.mktemp("dynamo"), 2, "kv", ("--kv-cache-memory", "4MiB"),
                             namespace=NS, model=MODEL, frontend_args=("--migration-limit", "3")) as c:
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


def worker_log(cluster) -> str:
    return "".join(p.read_text(errors="replace") for p in cluster.logs if p.name.startswith("worker"))


def test_what_the_worker_refuses_is_a_400_naming_the_field(cluster):
    r = httpx.post(f"{cluster.base}/v1/completions", json={"model": MODEL, "prompt": [5, 6], "n": 2}, timeout=30)
    assert r.status_code == 400 and "sampling_options.n" in r.text, r.text
    r = httpx.post(f"{cluster.base}/v1/completions", json={"model": MODEL, "prompt": [5] * 80}, timeout=30)
    assert r.status_code == 400 and "context holds 64" in r.text, r.text
    # one line in the worker's log per refused request, no traceback (a client cannot flood the log)
    log = worker_log(cluster)
    assert "Traceback" not in log, log
    # NOTE: sorted: the two workers' logs are read one after the other, and either worker may get either request
    assert sorted(x for x in log.splitlines() if "InvalidArgument" in x) == sorted([
        "dynamo._core.InvalidArgument: sampling_options.n=2: a kvexport Dynamo worker returns one choice per "
        "request; send n=1 (or several requests)",
        "dynamo._core.InvalidArgument: prompt: the prompt has 80 tokens but the context holds 64 (prompt + at least "
        "1 output token)"]), log


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

        env = {k: cluster.env[k] for k in ("DYN_FILE_KV", "DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_ZMQ_BROKER_URL")}
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


async def _router_scores(cluster, prompts: list[list[int]], namespaces: list[str | None]) -> list[dict[int, int]]:
    """Per (prompt, cache namespace): {worker id: device blocks} from a Dynamo KV router in this
    process, fed by the workers' KV events only."""
    from dynamo.runtime import DistributedRuntime

    env = {k: cluster.env[k] for k in ("DYN_FILE_KV", "DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_ZMQ_BROKER_URL")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
        router = dynamo_llm.KvRouter(rt.endpoint(f"{NS}.backend.generate"), 16, dynamo_llm.KvRouterConfig())
        await asyncio.sleep(1.0)  # subscribed to the workers' event streams (replayed from their local indexers)
        out = []
        for prompt, ns in zip(prompts, namespaces):
            res = await router.get_overlap_scores(prompt, cache_namespace=ns)
            out.append({w["worker_id"]: w["device_blocks"] for w in res["workers"]})
        rt.shutdown()
        return out
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_salted_requests_share_blocks_within_their_salt_only_and_route_by_it(cluster):
    prefix = [2000 + i for i in range(32)]  # two 16-token blocks
    cached = lambda body: complete(cluster, **body)["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    assert cached(dict(prompt=prefix + [9], max_tokens=2, cache_salt="tenant-a")) == 0
    time.sleep(0.5)  # the stored blocks reach the router (KV events are asynchronous)
    probe = prefix + [5, 6, 7]
    salted, other, plain = asyncio.run(_router_scores(cluster, [probe] * 3, ["tenant-a", "tenant-b", None]))
    # the router finds the blocks for the salted request only, on the worker that stored them
    assert sorted(salted.values()) == [0, 2] and not any(other.values()) and not any(plain.values()), \
        (salted, other, plain)
    hits = [cached(dict(prompt=prefix + s, max_tokens=2, cache_salt="tenant-a")) for s in ([1, 2], [3], [4, 5, 6])]
    hits.append(cached(dict(prompt=prefix + [1, 2], max_tokens=2, nvext={"cache_salt": "tenant-a"})))
    assert hits == [32] * 4  # every salted follow-up went to its worker and hit there
    # another tenant's salt, or none: the same tokens never reuse tenant-a's blocks
    assert cached(dict(prompt=prefix + [1, 2], max_tokens=2, cache_salt="tenant-b")) == 0
    assert cached(dict(prompt=prefix + [3], max_tokens=2)) == 0


def _stream_ids(cluster, body: dict, on_chunk) -> list[int]:
    """Token ids of a streamed completion (logprobs, token ids as text); `on_chunk(ids so far)`
    after each chunk."""
    got: list[int] = []
    with httpx.stream("POST", f"{cluster.base}/v1/completions", json={"model": MODEL, "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or "[DONE]" in line:
                continue
            d = json.loads(line[5:])
            assert "choices" in d, d  # an error event instead of a chunk
            got += _ids(d["choices"][0])
            on_chunk(got)
    return got


def _idle(m: dict) -> bool:
    return m["kvexport_kv_blocks_used"] == 0 and m["kvexport_requests_running"] == 0


def _instances(cluster) -> set[int]:
    return {i["instance_id"] for i in httpx.get(f"{cluster.base}/health", timeout=10).json()["instances"]
            if i["endpoint"] == "generate"}


def _restart(cluster, bench, i: int, before: set[int]) -> None:
    """Start worker i again; return once the frontend lists it (a new instance) and not the dead one."""
    cluster.start_worker(i)
    log = cluster.logs[-1]

    def registered() -> bool:
        if cluster.workers[i].poll() is not None:
            raise AssertionError(f"the restarted worker exited:\n{cluster.log_text()}")
        ids = _instances(cluster)
        return bool(bench.READY.search(log.read_text(errors="replace"))) and len(ids) == 2 and bool(ids - before)

    bench.wait_until(registered, "the restarted worker listed (and the killed one gone)", cluster.log_text, 120)


def test_a_worker_killed_mid_stream_migrates_its_request_and_restarts(cluster, bench, chat_build):
    from kvexport import LLM, SamplingParams

    llm = LLM(chat_build, threads=1, kv_cache_memory="4MiB")
    for attempt in range(2):  # NOTE: a second try only when the first request ended before the kill landed
        prefix = [3000 + 100 * attempt + i for i in range(16)]  # one block: the kv router sends its kin back
        prompt = prefix + [7]
        want = llm.generate([prompt], SamplingParams(max_tokens=47, ignore_eos=True))[0].token_ids
        before = _instances(cluster)
        served = [cluster.worker_metrics(i)["kvexport_requests_total"] for i in (0, 1)]
        complete(cluster, prompt=prefix + [9], max_tokens=2)  # stores the block on one worker
        bench.wait_until(lambda: sum(cluster.worker_metrics(i)["kvexport_requests_total"] for i in (0, 1))
                         > sum(served), "the first request counted", cluster.log_text, 30)
        dead = next(i for i in (0, 1) if cluster.worker_metrics(i)["kvexport_requests_total"] > served[i])
        alive = 1 - dead
        time.sleep(0.5)  # its stored block reaches the router (KV events are asynchronous)
        prompt_tokens = cluster.worker_metrics(alive)["kvexport_prompt_tokens_total"]

        def kill_at_the_first_chunk(got: list[int]) -> None:
            if got and cluster.workers[dead].poll() is None:
                os.kill(cluster.workers[dead].pid, signal.SIGKILL)

        body = dict(prompt=prompt, max_tokens=47, ignore_eos=True, temperature=0, logprobs=0,
                    return_tokens_as_token_ids=True)
        got = _stream_ids(cluster, body, kill_at_the_first_chunk)
        assert got == want  # whatever happened, the client got kvexport's greedy tokens, once each
        cluster.workers[dead].wait(timeout=10)
        bench.wait_until(lambda: _idle(cluster.worker_metrics(alive)), "the survivor idle", cluster.log_text, 30)
        m = cluster.worker_metrics(alive)  # it holds nothing now
        # migrated: Dynamo re-sent prompt + the tokens so far to the survivor, which continued greedily
        migrated = m["kvexport_prompt_tokens_total"] - prompt_tokens > len(prompt)
        _restart(cluster, bench, dead, before)  # the killed worker, started again, registers and serves
        if migrated:
            break
    else:
        raise AssertionError(f"the request was never migrated (it ended before the kill twice):\n{cluster.log_text()}")
    served = cluster.worker_metrics(dead)["kvexport_requests_total"]
    assert served == 0
    # two long requests at once: the router's load accounting puts them on different workers
    for attempt in range(3):
        outs: list = []
        threads = [threading.Thread(target=lambda p=p: outs.append(complete(cluster, prompt=p, max_tokens=40,
                                                                             ignore_eos=True)))
                   for p in ([41 + attempt, 42, 43], [51 + attempt, 52, 53])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [o["usage"]["completion_tokens"] for o in outs] == [40, 40]
        if cluster.worker_metrics(dead)["kvexport_requests_total"] >= 1:
            break
    else:
        raise AssertionError(f"the restarted worker served nothing:\n{cluster.log_text()}")
    bench.wait_until(lambda: all(_idle(cluster.worker_metrics(i)) for i in (0, 1)), "both workers idle",
                     cluster.log_text, 30)
