"""/metrics counts requests and cancellations in one unit, sequences (runtime/serving/metrics.py
help texts): a streamed request with n = 3 that its client leaves counts 3 admitted and 3
cancelled, over a real `kvexport serve` subprocess of a tiny real build. (In-process, the test
client reports a disconnect only once the response is complete, too late to cancel anything.)"""

import time

import httpx

from kvexport.exporter.build import BuildOptions, build


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {k: float(v) for k, v in (line.split() for line in text.splitlines() if line and not line.startswith("#"))}


def test_n_samples_count_n_requests_and_n_cancellations(hf_folder, tmp_path, serve_process):
    out, _ = build(str(hf_folder("llama")), tmp_path / "b", BuildOptions(max_seq_len=1024, validate=False))
    base = serve_process(out, "--kv-cache-memory", "8MiB").wait_ready().removesuffix("/v1")
    # NOTE: logprobs: a build without a tokenizer has no text, so only logprobs make a chunk per token
    body = {"prompt": [1, 5, 9], "max_tokens": 1000, "n": 3, "ignore_eos": True, "stream": True, "logprobs": 0}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                break  # the client goes away after the first chunk
    deadline = time.monotonic() + 60
    while (m := _metrics(base))["kvexport_requests_cancelled_total"] == 0 or m["kvexport_kv_blocks_used"]:
        assert time.monotonic() < deadline, str(m)
        time.sleep(0.1)
    assert m["kvexport_requests_total"] == 3 and m["kvexport_requests_cancelled_total"] == 3
    assert m["kvexport_generation_tokens_total"] < 3 * 1000  # stopped well before max_tokens
