"""A hybrid (gated DeltaNet) build on every front end: a tiny random qwen3_5_text model (3 linear : 1 gated
attention layer) with smollm2-135m's tokenizer and chat template, served by `kvexport serve` (a real uvicorn
subprocess on 127.0.0.1), by the real `tritonserver` (nvidia-pytriton, CPU) and by a real Dynamo frontend +
`kvexport dynamo` worker (file discovery, loopback). Each returns the runtime's own greedy tokens (LLM on the
same build), and a repeated prompt resumes from a recurrent-state checkpoint (prefix-cache hits on a hybrid,
with the same tokens). Disaggregated prefill -> decode through Dynamo hands the recurrent state over with the
KV blocks (the KV tiers carrying checkpoints: tests/runtime/test_hybrid_tiers.py)."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvexport import LLM, SamplingParams
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
TRITON_ENV = Path(os.environ.get("KVEXPORT_TRITON_ENV", REPO_ROOT / ".venv-triton"))
# a 26-token prompt: with 4-token blocks and a checkpoint every 2 blocks, a repeat resumes at token 24
PROMPT = [1, 5, 9, 3, 7, 7, 2, 11, 40, 41, 42, 100, 3, 900, 901, 902, 17, 18, 19, 20, 4000, 4001, 4002, 33, 34, 35]
SYSTEM = "You are a helpful assistant who answers every question briefly and politely."


@pytest.fixture(scope="module")
def hybrid_build(hf_folder, tmp_path_factory):
    """qwen3_5_text, tiny and random, vocab of smollm2-135m's tokenizer (saved beside it), 4-token blocks."""
    from kvexport.exporter.source import load_tokenizer, resolve

    folder = tmp_path_factory.mktemp("hyb-hf") / "tiny-hybrid"
    shutil.copytree(hf_folder("qwen3_5_text", vocab_size=49152), folder)
    load_tokenizer(resolve("smollm2-135m")).save_pretrained(folder)
    out, _ = build(str(folder), tmp_path_factory.mktemp("hyb") / "tiny-hybrid",
                   BuildOptions(max_seq_len=128, block_size=4, validate=False))
    return out


@pytest.fixture(scope="module")
def want(hybrid_build):
    """The runtime's greedy tokens for PROMPT (no prefix caching: recomputation)."""
    llm = LLM(hybrid_build, kv_cache_memory="1MiB", enable_prefix_caching=False)
    return llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]


def test_openai_server_serves_a_hybrid_and_hits_its_checkpoints(hybrid_build, want, serve_process):
    srv = serve_process(hybrid_build, "--kv-cache-memory", "4MiB", "--state-checkpoint-blocks", "2")
    body = {"model": "tiny-hybrid", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    got = [httpx.post(f"{srv.base}/v1/completions", json=body, timeout=60).json() for _ in range(2)]
    assert [g["choices"][0]["text"] for g in got] == [want.text, want.text]
    assert [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got] == [0, 24]
    # chat: the second turn-1 request shares the templated system prompt (resumes from a checkpoint), same text
    chat = {"model": "tiny-hybrid", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]}
    a, b = (httpx.post(f"{srv.base}/v1/chat/completions", json=chat, timeout=60).json() for _ in range(2))
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # streamed: the same text
    lines = httpx.post(f"{srv.base}/v1/completions", json={**body, "stream": True}, timeout=60).text.splitlines()
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text and "data: [DONE]" in lines


def test_dynamo_disaggregates_a_hybrid(hybrid_build, want, tmp_path):
    """A real Dynamo frontend, a `--mode prefill` and a `--mode decode` worker (request-plane hand-off, no
    NIXL needed): the prompt's 6 KV blocks and the recurrent state after them (io.STATE_GROUP) move to the
    decode worker, which resumes there (its prefix-cache hits) and gives the runtime's own tokens."""
    pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed (scripts/install_dev.sh)")
    from testkit.bench import script

    bench = script("dynamo_routing")
    with bench.local_cluster(hybrid_build, tmp_path / "dynamo", 2, "kv",
                             ("--kv-cache-memory", "4MiB", "--state-checkpoint-blocks", "2",
                              "--kv-transfer", "request-plane"),
                             namespace="kvxhybdis", model="hyb",
                             each_worker_args=[("--mode", "prefill"), ("--mode", "decode")]) as c:
        body = {"model": "hyb", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0,
                "logprobs": 0, "return_tokens_as_token_ids": True}
        r = httpx.post(f"{c.base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text + c.log_text()
        assert [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]] \
            == want.token_ids
        prefill, decode = c.worker_metrics(0), c.worker_metrics(1)
        assert prefill["kvexport_disagg_offered_blocks_total"] == 7  # (26 - 1) // 4 KV blocks + the state
        assert decode["kvexport_disagg_pulled_blocks_total"] == 7 and decode["kvexport_disagg_recomputed_total"] == 0
        assert decode["kvexport_prefix_cache_hits_total"] == 6  # resumed at token 24, not recomputed


def test_tritonserver_serves_a_hybrid(hybrid_build, want, tmp_path, free_ports):
    from kvexport.runtime.serving.triton_local import (Ports, ServerStartError, backend_dir, find_triton,
                                                       python_version, server_command, wait_http_ready)
    from kvexport.runtime.serving.triton_repo import TritonRepoOptions, write_repository

    if not (TRITON_ENV / "bin" / "python3").exists():
        pytest.skip(f"no Triton execution environment at {TRITON_ENV}: run scripts/install.sh --dev")
    write_repository(hybrid_build, tmp_path / "repo", TritonRepoOptions(
        engine=EngineConfig(kv_cache_memory="1MiB", threads=1, state_checkpoint_blocks=2), name="hyb",
        execution_env=str(TRITON_ENV)))
    triton = find_triton(TRITON_ENV)
    ports = Ports(*free_ports(3))
    argv, env = server_command(triton, tmp_path / "repo", backend_dir(triton, python_version(TRITON_ENV),
                                                                      tmp_path / "backends"), ports)
    log = tmp_path / "tritonserver.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path,
                                start_new_session=True)
    try:
        try:
            wait_http_ready(f"http://127.0.0.1:{ports.http}/v2/health/ready", proc, 180)
        except ServerStartError as e:
            pytest.fail(f"tritonserver did not become ready ({e}):\n{log.read_text(errors='replace')[-4000:]}")
        url = f"http://127.0.0.1:{ports.http}/v2/models/hyb/generate"
        got = [httpx.post(url, json={"input_ids": PROMPT, "max_tokens": 8, "ignore_eos": True}, timeout=60).json()
               for _ in range(2)]
        assert [g["token_ids"] for g in got] == [want.token_ids, want.token_ids]
        deadline = time.monotonic() + 30  # Triton's metrics are refreshed on their own interval
        while True:
            text = httpx.get(f"http://127.0.0.1:{ports.metrics}/metrics", timeout=10).text
            hits = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("kvexport_prefix_cache_hits_total{"))
            if hits or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert hits == 24 // 4  # the repeat resumed from the checkpoint at 24 tokens (6 blocks)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_dynamo_worker_serves_a_hybrid(hybrid_build, want, tmp_path):
    pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed (scripts/install_dev.sh)")
    from testkit.bench import script

    bench = script("dynamo_routing")
    with bench.local_cluster(hybrid_build, tmp_path / "dynamo", 1, "kv",
                             ("--kv-cache-memory", "4MiB", "--state-checkpoint-blocks", "2"),
                             namespace="kvxhybrid", model="hyb") as c:
        body = {"model": "hyb", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0,
                "logprobs": 1, "return_tokens_as_token_ids": True}
        ids = []
        for stream in (False, True):
            r = httpx.post(f"{c.base}/v1/completions", json={**body, "stream": stream}, timeout=60)
            assert r.status_code == 200, r.text
            if stream:
                chunks = [json.loads(x.removeprefix("data:")) for x in r.text.splitlines()
                          if x.startswith("data:") and x.strip() != "data: [DONE]"]
                ids.append([int(t.removeprefix("token_id:")) for c in chunks for ch in c["choices"]
                            if ch.get("logprobs") for t in ch["logprobs"]["tokens"]])
            else:
                ids.append([int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]])
        assert ids == [want.token_ids, want.token_ids]


def test_chat_bench_on_a_hybrid_hits_and_equals_recomputation(hybrid_build):
    """`kvexport bench --chat` on a hybrid: the KV tiers' runs (the state checkpoints go to the tiers with the
    blocks; the pool keeps only as many checkpoints as conversations it holds) and recomputation: every run's
    answers equal, most prompt tokens cached, the host tier's run hitting at least as much as the pool alone."""
    from kvexport.runtime.serving.chat_bench import ChatShape, markdown, run_chat

    shape = ChatShape(conversations=4, turns=3, system_tokens=24, user_tokens=6, answer_tokens=5,
                      pool_conversations=2)
    r = run_chat(hybrid_build, EngineConfig(threads=1), shape)
    assert r["hybrid"] and r["kv_bytes_per_token"] == 2 * 2 * 16 * 4 and r["state_checkpoints"] == 1 + 2 * 6
    assert list(r["runs"]) == ["off", "host", "host+disk", "restart", "recompute"]
    runs = r["runs"]
    assert all(run["answers_equal_off"] for run in runs.values())
    assert runs["recompute"]["cached_prompt_tokens"] == 0 and runs["off"]["hit_rate"] > 0.4
    assert runs["host"]["hit_rate"] >= runs["off"]["hit_rate"] and runs["host"]["tier_hits"]["host"] > 0
    assert runs["restart"]["tier_hits"]["disk"] > 0  # warm from the disk tier after a restart
    assert "| recompute |" in markdown(r)
