"""lm-evaluation-harness against `kvexport serve`: the real `lm-eval` package runs a small
local multiple-choice task (tests/runtime/lm_eval_task/) with `local-completions` against a
`kvexport serve` subprocess on 127.0.0.1, and with its own `hf` model on the same weights;
accuracy and every per-choice loglikelihood must agree. The prompt log-probabilities that
`echo` returns must equal transformers' log_softmax of the same weights to 1e-3.

The model: a tiny random llama with smollm2-135m's tokenizer (real text in, milliseconds a
step), built with `--all-logits`. The server runs with 16-token steps, so lm-eval's prompts
are prefilled in several chunks, and the choices of one question share their context's
cached blocks (which a scoring request does not use: runtime/core/prompt_scores.py).
"""

import json
import math
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "kvx_tiny_mc"
NAME = "tiny-eval"
TOLERANCE = 1e-3  # max |Δ log-probability| against transformers (fp32 graphs: ~1e-6 measured)


@pytest.fixture(scope="module")
def eval_model(hf_folder, tmp_path_factory):
    """(HF folder with weights + tokenizer, its --all-logits build)."""
    from kvexport.exporter.build import BuildOptions, build
    from kvexport.exporter.source import load_tokenizer, resolve

    folder = tmp_path_factory.mktemp("eval-hf") / "tiny-eval"
    shutil.copytree(hf_folder("llama", vocab_size=49152), folder)
    load_tokenizer(resolve("smollm2-135m")).save_pretrained(folder)
    out, _ = build(str(folder), tmp_path_factory.mktemp("eval") / NAME,
                   BuildOptions(max_seq_len=256, validate=False, all_logits=True))
    return folder, out


@pytest.fixture(scope="module")
def server(eval_model, serve_module):
    return serve_module(eval_model[1], "--served-model-name", NAME, "--max-num-batched-tokens", "16",
                        "--kv-cache-memory", "16MiB").base


def _hf_logprobs(folder: Path, ids: list[int]) -> np.ndarray:
    """transformers' log-probability of each token after the first, given those before it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)  # [T, vocab]
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


def _evaluate(model: str, model_args: dict, monkeypatch) -> tuple[float, list[list[float]]]:
    """lm-eval's acc on the task and each doc's per-choice loglikelihoods, in doc order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASK_DIR)  # the task's data_files are relative
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], num_fewshot=0,
                                  task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
                                  log_samples=True, bootstrap_iters=0)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return out["results"][TASK]["acc,none"], [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
def test_local_completions_against_serve_matches_the_hf_model(eval_model, server, monkeypatch, tokenized):
    folder, build_dir = eval_model
    t0 = time.monotonic()
    acc_hf, ll_hf = _evaluate("hf", {"pretrained": str(folder), "dtype": "float32", "device": "cpu",
                                     "batch_size": 4}, monkeypatch)
    t1 = time.monotonic()
    acc_kvx, ll_kvx = _evaluate("local-completions", {
        "model": NAME, "base_url": f"{server}/v1/completions", "tokenizer_backend": "huggingface",
        "tokenizer": str(build_dir / "tokenizer"), "tokenized_requests": tokenized,
        # text requests go one by one (lm-eval's rule for them), token ids in batches of 4 prompts
        "batch_size": 4 if tokenized else 1, "num_concurrent": 1 if tokenized else 2, "max_retries": 1,
        "max_length": 256}, monkeypatch)
    t2 = time.monotonic()
    n = sum(1 for _ in open(TASK_DIR / f"{TASK}.jsonl"))
    assert len(ll_kvx) == len(ll_hf) == n and all(len(a) == len(b) == 4 for a, b in zip(ll_kvx, ll_hf))
    diff = max(abs(a - b) for x, y in zip(ll_kvx, ll_hf) for a, b in zip(x, y))
    print(f"\nacc hf {acc_hf:.4f} local-completions {acc_kvx:.4f}; max |Δ loglikelihood| {diff:.2e}; "
          f"hf {t1 - t0:.1f} s, serve {t2 - t1:.1f} s")
    assert diff <= TOLERANCE, diff
    assert acc_kvx == acc_hf
    # the choices' loglikelihoods are not all alike (a broken scorer returning one value would pass above)
    assert len({round(v, 3) for x in ll_hf for v in x}) > n


def test_echo_logprobs_equal_transformers(eval_model, server):
    folder, _ = eval_model
    from transformers import AutoTokenizer

    text = "The harbour was quiet at dawn; gulls circled the masts while the first boats slipped out to sea."
    ids = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    assert len(ids) > 16  # more than one 16-token step: chunked prefill
    ref = _hf_logprobs(folder, ids)
    for prompt in (text, ids):
        r = httpx.post(f"{server}/v1/completions", json={"model": NAME, "prompt": prompt, "echo": True, "logprobs": 1,
                                                          "max_tokens": 0, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        lp = choice["logprobs"]
        assert choice["text"] == text and choice["finish_reason"] == "length"
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == len(ids)
        got = np.array(lp["token_logprobs"][1:])
        kind = "text" if prompt is text else "ids"
        print(f"\nmax |Δ logprob| vs transformers ({kind}): {np.abs(got - ref).max():.2e}")
        assert np.abs(got - ref).max() <= TOLERANCE
        assert "".join(lp["tokens"]) == text and lp["text_offset"][:3] == [0, len(lp["tokens"][0]),
                                                                           len(lp["tokens"][0]) + len(lp["tokens"][1])]
        for tok, v, top in zip(lp["tokens"][1:], got, lp["top_logprobs"][1:]):
            assert top[tok] == v and max(top.values()) >= v and len(top) <= 2  # top-1 and the prompt token


def test_echo_with_completion_and_prompt_logprobs(eval_model, server):
    folder, _ = eval_model
    ids = [1, 504, 3543, 314, 1345, 30, 378, 1135, 28, 260, 5011, 314, 253, 1761, 30, 216, 690, 1033]
    ref = _hf_logprobs(folder, ids)
    body = {"model": NAME, "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 3, "prompt_logprobs": 3,
            "temperature": 0, "ignore_eos": True}
    first = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    again = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()  # its prefix is cached now
    (c,) = first["choices"]
    lp, plp = c["logprobs"], c["prompt_logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 and first["usage"]["completion_tokens"] == 3
    assert c["text"] == "".join(lp["tokens"])  # the prompt's text, then the completion's
    assert np.abs(np.array(lp["token_logprobs"][1:len(ids)]) - ref).max() <= TOLERANCE
    assert again["choices"][0]["logprobs"] == lp and again["choices"][0]["prompt_logprobs"] == plp
    # vLLM's form: per position the prompt token (its rank) and the top 3
    assert plp[0] is None and len(plp) == len(ids)
    for i, d in enumerate(plp[1:], start=1):
        mine = d[str(ids[i])]
        assert math.isclose(mine["logprob"], ref[i - 1], abs_tol=TOLERANCE)
        ranked = sorted(d.values(), key=lambda x: x["rank"])
        assert [x["rank"] for x in ranked][:3] == [1, 2, 3] and len(d) in (3, 4)
        above = [x for k, x in d.items() if k != str(ids[i]) and x["logprob"] > mine["logprob"]]
        assert mine["rank"] == 1 + len(above) if mine["rank"] <= 3 else len(above) == 3
    # streaming: the first chunk carries the prompt's text and logprobs
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    head = chunks[0]["choices"][0]
    assert head["logprobs"]["token_logprobs"][:len(ids)] == lp["token_logprobs"][:len(ids)]
    assert head["prompt_logprobs"] == plp
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == c["text"]
    # a one-token prompt: nothing to score, its echo has the null entry only
    r = httpx.post(f"{server}/v1/completions", json={"model": NAME, "prompt": ids[:1], "echo": True, "logprobs": 1,
                                                      "max_tokens": 1, "prompt_logprobs": 0}, timeout=60).json()
    one = r["choices"][0]
    assert one["logprobs"]["token_logprobs"][0] is None and len(one["logprobs"]["tokens"]) == 2
    assert one["logprobs"]["top_logprobs"][0] is None and one["prompt_logprobs"] == [None]
    for bad, param in (({"prompt_logprobs": 21}, "prompt_logprobs"), ({"echo": True, "logprobs": 21}, "logprobs"),
                       ({"prompt_logprobs": True}, "prompt_logprobs")):
        r = httpx.post(f"{server}/v1/completions", json={"model": NAME, "prompt": ids, **bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_prompt_logprobs_on_a_build_without_all_logits_are_served(chat_build):
    """Builds made now return the prompt rows' logits on request (io.LOGITS_INDICES), so echo and
    prompt_logprobs need no --all-logits; builds made before refuse them (test_server_edges.py)."""
    from fastapi.testclient import TestClient

    from kvexport.runtime.serving.server import create_app

    with TestClient(create_app(chat_build, served_model_name="tiny")) as c:
        r = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 1, "echo": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:]), lp
        r = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 1, "prompt_logprobs": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["prompt_logprobs"][0] is None, r.text
        r = c.post("/v1/completions", json={"prompt": "hello", "echo": True, "max_tokens": 0})  # no scores: served
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello"
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "needs echo" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "hello", "prompt_logprobs": 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
