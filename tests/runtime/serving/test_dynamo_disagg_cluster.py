"""Disaggregated serving end to end on loopback (issue 26 §3): a real `python -m dynamo.frontend`,
one `kvexport dynamo --mode prefill` and one `--mode decode` worker of one tiny build (Dynamo's
file discovery in a temp folder), the KV handed over through NIXL (UCX, host memory). Greedy
tokens through the frontend equal kvexport's own (LLM on the same build) for several prompts,
one shorter than a block (nothing to hand over) and two longer (blocks handed over), on an
int8-KV build (fp32, int4 and a hybrid build's two KV cache groups: test_dynamo_disagg.py, in
one process); the decode worker's metrics show the blocks it pulled (and, for a repeated
prompt, reused instead of pulling) and none left held, the prefill worker's that every offer
was taken (no room left open, none expired).

Skipped, saying why, where the `dynamo` extra (ai-dynamo, nixl) is not installed."""

import shutil

import pytest

pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed (scripts/install_dev.sh)")
httpx = pytest.importorskip("httpx")
try:
    from kvexport.runtime.serving.kv_transfer import import_nixl

    import_nixl()
except Exception as e:  # noqa: BLE001 - ConfigError: nixl is not installed
    pytest.skip(str(e), allow_module_level=True)

MODEL = "tiny"
from testkit.bench import script as bench_script  # noqa: E402

PROMPTS = [[100 + i for i in range(40)],  # 2 full blocks of 16 handed over, 8 tokens computed on decode
           [7, 7, 8, 9, 30000, 12, 5],  # shorter than a block: decode computes it all
           [200 + (i * 37) % 3000 for i in range(33)]]  # 2 blocks + 1 token


@pytest.fixture(scope="module")
def build_dir(hf_folder, tmp_path_factory):
    """chat_build's tiny llama with int8 KV."""
    from kvexport import io
    from kvexport.exporter.build import BuildOptions, build
    from kvexport.exporter.source import load_tokenizer, resolve

    folder = tmp_path_factory.mktemp("chat8-hf") / "tiny-chat8"
    shutil.copytree(hf_folder("llama", vocab_size=49152), folder)
    load_tokenizer(resolve("smollm2-135m")).save_pretrained(folder)
    out, _ = build(str(folder), tmp_path_factory.mktemp("chat8") / "tiny-chat8",
                   BuildOptions(max_seq_len=64, validate=False, kv_dtype=io.DType.INT8))
    return out


@pytest.fixture(scope="module")
def cluster(build_dir, tmp_path_factory):
    bench = bench_script("dynamo_routing")
    with bench.local_cluster(build_dir, tmp_path_factory.mktemp("disagg"), 2, "kv", ("--kv-cache-memory", "4MiB"),
                             namespace="kvxdisagg", model=MODEL,
                             each_worker_args=[("--mode", "prefill"), ("--mode", "decode")]) as c:
        yield c


def test_prefill_and_decode_workers_give_aggregated_tokens(cluster, build_dir):
    from kvexport import LLM, SamplingParams

    ref = LLM(build_dir, threads=1, kv_cache_memory="4MiB").generate(PROMPTS, SamplingParams(max_tokens=8))
    got = []
    for prompt in PROMPTS + PROMPTS[:1]:  # the first again: the decode worker holds its blocks now
        r = httpx.post(f"{cluster.base}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text + cluster.log_text()
        choice = r.json()["choices"][0]
        got.append([int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]])
    assert got == [o.token_ids for o in ref] + [ref[0].token_ids]
    bench = bench_script("dynamo_routing")
    bench.wait_until(lambda: cluster.worker_metrics(0)["kvexport_disagg_rooms_open"] == 0,
                     "every offer taken (the decode side's notifications)", cluster.log_text, timeout=20)
    prefill, decode = cluster.worker_metrics(0), cluster.worker_metrics(1)
    # every request ran its prompt on the prefill worker, and its decode on the decode worker
    assert prefill["kvexport_disagg_offered_total"] == 4 and prefill["kvexport_disagg_offered_blocks_total"] == 6
    assert decode["kvexport_disagg_pulled_blocks_total"] == 4  # 2 + 0 + 2; the repeat pulled nothing
    assert decode["kvexport_disagg_reused_blocks_total"] == 2
    assert decode["kvexport_generation_tokens_total"] == 4 * 8 and prefill["kvexport_generation_tokens_total"] == 4
    assert prefill["kvexport_disagg_rooms_open"] == 0 and prefill["kvexport_disagg_rooms_expired_total"] == 0
    assert decode["kvexport_kv_blocks_used"] == 0  # the held blocks were released
