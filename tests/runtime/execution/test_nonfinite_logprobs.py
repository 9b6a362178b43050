"""Non-finite log-probabilities (runtime/execution/sampling.py): a pathological
repetition_penalty (overflowing to -inf or +inf) and a model with NaN weights give finite
logprobs (-inf reported as LOGPROB_FLOOR, as vLLM's OpenAI server does; a NaN logit never
chosen), and always valid JSON from the OpenAI app (in-process, a tiny real build), streamed
or not; a model whose every logit is NaN fails the request with an error naming the cause.
Also through `LLM`."""

import json
import math
import shutil

import pytest
import torch

from kvexport import LLM, SamplingParams
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.execution.sampling import LOGPROB_FLOOR

PROMPT = [1, 5, 9, 3, 5, 9]
NAN_TOKENS = range(3, 13)  # lm_head rows made NaN: these tokens' logits are NaN


def _strict(text: str):
    """JSON as a strict parser reads it: NaN / Infinity are not JSON."""
    def refuse(name):
        raise AssertionError(f"{name} in the JSON: {text[:300]}")
    return json.loads(text, parse_constant=refuse)


def _nan_folder(src, dst, *, everywhere: bool):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    if everywhere:
        w["model.norm.weight"][:] = float("nan")  # every hidden state, so every logit
    else:
        w["lm_head.weight"][list(NAN_TOKENS)] = float("nan")
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def builds(hf_folder, tmp_path_factory):
    src, root = hf_folder("llama"), tmp_path_factory.mktemp("nonfinite")
    opts = BuildOptions(max_seq_len=64, validate=False)
    return {"plain": build(str(src), root / "plain", opts)[0],
            "nan": build(str(_nan_folder(src, root / "nan-hf", everywhere=False)), root / "nan", opts)[0],
            "all-nan": build(str(_nan_folder(src, root / "all-nan-hf", everywhere=True)), root / "all-nan", opts)[0]}


def _finite_logprobs(values):
    assert values and all(isinstance(v, float) and math.isfinite(v) and v >= LOGPROB_FLOOR for v in values), values


# seen tokens' logits -> huge / -inf and NaN (0 x inf) / +inf (was NaN everywhere)
@pytest.mark.parametrize("penalty", [1e308, math.inf, 1e-320])
def test_pathological_penalty_through_llm(builds, penalty):
    (out,) = LLM(builds["plain"], kv_cache_memory="1MiB").generate(
        [PROMPT], SamplingParams(max_tokens=8, repetition_penalty=penalty, logprobs=5, ignore_eos=True))
    assert len(out.token_ids) == 8
    _finite_logprobs(out.logprobs)
    _finite_logprobs([lp for top in out.top_logprobs for _, lp in top])
    if penalty > 1:  # every seen token's logit -inf after the first step: reported at the floor, never chosen
        assert not set(out.token_ids[1:]) & set(PROMPT)


def test_nan_logits_never_chosen_through_llm(builds):
    llm = LLM(builds["nan"], kv_cache_memory="1MiB")
    for params in (SamplingParams(max_tokens=10, logprobs=20, ignore_eos=True),
                   SamplingParams(max_tokens=10, logprobs=20, ignore_eos=True, temperature=1.0, seed=3)):
        (out,) = llm.generate([PROMPT], params)
        assert len(out.token_ids) == 10 and not set(out.token_ids) & set(NAN_TOKENS)
        _finite_logprobs(out.logprobs + [lp for top in out.top_logprobs for _, lp in top])
    (bad,) = LLM(builds["all-nan"], kv_cache_memory="1MiB").generate([PROMPT], SamplingParams(max_tokens=4))
    assert bad.finish_reason == "error" and "no finite logit" in bad.error


def test_openai_app_gives_valid_json(builds):
    from fastapi.testclient import TestClient

    from kvexport.runtime.serving.server import create_app

    for name, penalty in (("plain", 1e-320), ("nan", 1.0)):
        body = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 5, "repetition_penalty": penalty, "ignore_eos": True}
        with TestClient(create_app(builds[name], served_model_name="tiny")) as c:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            lp = _strict(r.text)["choices"][0]["logprobs"]
            _finite_logprobs(lp["token_logprobs"] + [v for top in lp["top_logprobs"] for v in top.values()])
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                lines = [x[6:] for x in s.iter_lines() if x.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            got = [v for x in lines[:-1] for v in _strict(x)["choices"][0]["logprobs"]["token_logprobs"]]
            _finite_logprobs(got)
    with TestClient(create_app(builds["all-nan"], served_model_name="tiny")) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "logprobs": 1})
        err = _strict(r.text)
        assert r.status_code == 500 and "no finite logit" in err["error"]["message"], r.text
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True}) as s:
            lines = [x[6:] for x in s.iter_lines() if x.startswith("data: ")]
        assert any("no finite logit" in json.dumps(_strict(x)) for x in lines if x != "[DONE]"), lines
