"""Serving LoRA adapters (runtime/lora.py, issue 44 step 3): a build made with --lora-max-rank, two real PEFT 0.21
adapters loaded with `lora_modules`, one batch of the base and both adapters: each request's greedy tokens are
transformers + peft's for its adapter; a prompt's cached KV under one adapter is never reused by another adapter
or the base; unknown names and builds without adapter inputs are refused, naming the setting or field."""

import importlib.util
import json

import numpy as np
import pytest

from kvexport import LLM, SamplingParams, io, manifest
from kvexport.errors import ConfigError, KvExportError
from kvexport.exporter.build import BuildOptions, build

from testkit import parity
from testkit.families import TINY
from testkit.lora_adapters import make_adapter

# NOTE: peft imports triton; imported at collection it would set triton up before tests/plugins/conftest.py
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed (.[test])")


@pytest.fixture(scope="module")
def served(hf_folder, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_serving")
    folder = hf_folder("llama")
    out, _ = build(str(folder), d / "b", BuildOptions(max_seq_len=64, block_size=4, lora_max_rank=8))
    ref1 = make_adapter(folder, d / "a1", 1, r=4, lora_alpha=8, use_rslora=True,
                        target_modules=["q_proj", "v_proj", "down_proj"])
    ref2 = make_adapter(folder, d / "a2", 2, r=8, lora_alpha=16,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return out, d, ref1, ref2


def test_base_and_two_adapters_in_one_batch_give_peft_greedy_tokens(served):
    out, d, ref1, ref2 = served
    llm = LLM(out, lora_modules=f"one={d / 'a1'},two={d / 'a2'}", kv_cache_memory="8MiB")
    prompts = parity.random_prompts(6, TINY["vocab_size"], 5, 14, seed=11)
    names = [None, "one", "two", "two", None, "one"]
    got = llm.generate(prompts, [SamplingParams(max_tokens=6, ignore_eos=True, lora=n) for n in names])
    with ref1.disable_adapter():
        base = parity.hf_greedy(ref1, [p for p, n in zip(prompts, names) if n is None], 6)
    one = parity.hf_greedy(ref1, [p for p, n in zip(prompts, names) if n == "one"], 6)
    two = parity.hf_greedy(ref2, [p for p, n in zip(prompts, names) if n == "two"], 6)
    want = {None: iter(base), "one": iter(one), "two": iter(two)}
    assert [o.token_ids for o in got] == [next(want[n]) for n in names]
    with ref2.disable_adapter():
        assert parity.hf_greedy(ref2, prompts[2:4], 6) != two, "the adapter changes no token: a weak test"


def test_cached_prompts_are_kept_apart_by_adapter(served):
    out, d, _, _ = served
    llm = LLM(out, lora_modules=f"one={d / 'a1'},two={d / 'a2'}", kv_cache_memory="8MiB")
    prompt = parity.random_prompts(1, TINY["vocab_size"], 24, 25, seed=12)[0]

    def cached(name):
        return llm.generate([prompt], SamplingParams(max_tokens=2, lora=name))[0].num_cached_prompt_tokens

    assert cached("one") == 0
    assert cached("one") == 20  # its own blocks (the last, partial one and the last token are computed)
    assert cached(None) == 0 and cached("two") == 0  # never another adapter's KV, nor the base's
    assert cached(None) == 20 and cached("two") == 20


def test_tenants_and_adapters_are_both_in_the_key(served):
    """Two tenants (cache_salt) x two adapters: each of the four shares nothing with the other three."""
    out, d, _, _ = served
    llm = LLM(out, lora_modules=f"one={d / 'a1'},two={d / 'a2'}", kv_cache_memory="8MiB")
    prompt = parity.random_prompts(1, TINY["vocab_size"], 24, 25, seed=14)[0]

    def cached(tenant, name):
        p = {"prompt_token_ids": prompt, "cache_salt": tenant}
        return llm.generate([p], SamplingParams(max_tokens=2, lora=name))[0].num_cached_prompt_tokens

    pairs = [(t, a) for t in ("tenant-a", "tenant-b") for a in ("one", "two")]
    assert [cached(t, a) for t, a in pairs] == [0, 0, 0, 0]
    assert [cached(t, a) for t, a in pairs] == [20, 20, 20, 20]


def test_unknown_adapters_and_builds_without_adapter_inputs_are_refused(served, hf_folder, tmp_path):
    out, d, _, _ = served
    llm = LLM(out, lora_modules=f"one={d / 'a1'}", kv_cache_memory="8MiB")
    with pytest.raises(KvExportError, match=r"lora: no adapter 'three' is loaded; the adapters served: one"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, lora="three"))
    with pytest.raises(KvExportError, match="lora: this engine serves no adapters"):
        LLM(out, kv_cache_memory="8MiB").generate([[5, 6, 7]], SamplingParams(max_tokens=2, lora="one"))
    with pytest.raises(ConfigError, match=r"lora_modules \(one\) .*no such folder"):
        LLM(out, lora_modules=f"one={tmp_path / 'missing'}")
    with pytest.raises(ConfigError, match="more than max_loras 1"):
        LLM(out, lora_modules=f"one={d / 'a1'},two={d / 'a2'}", max_loras=1)
    plain, _ = build(str(hf_folder("llama")), tmp_path / "plain", BuildOptions(max_seq_len=64, block_size=4))
    with pytest.raises(ConfigError, match="takes no adapters .*--lora-max-rank"):
        LLM(plain, lora_modules=f"one={d / 'a1'}")
    assert io.LORA_INDEX not in {t.name for t in manifest.load(plain).graphs["prefill"].inputs}


def test_the_openai_server_serves_adapters_by_model_name(served):
    """`kvexport serve --lora-modules`: the request's `model` picks the adapter (vLLM's rule), /v1/models lists
    each adapter with the base as its parent; a model name not served is a 404 naming `model`."""
    from fastapi.testclient import TestClient

    from kvexport.runtime.config import EngineConfig
    from kvexport.runtime.serving.server import create_app

    out, d, ref1, _ = served
    prompt = parity.random_prompts(1, TINY["vocab_size"], 8, 9, seed=13)[0]
    config = EngineConfig(lora_modules=f"one={d / 'a1'}", kv_cache_memory="8MiB")
    with TestClient(create_app(out, config, served_model_name="tiny")) as c:
        models = c.get("/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("one", "tiny")]

        def tokens(model):
            """The completion's token ids (the tiny build has no tokenizer: logprobs name tokens by id)."""
            r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                "ignore_eos": True, "logprobs": 0})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == (model or "tiny")  # the adapter asked for, as vLLM answers (before: "tiny")
            return [int(t) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

        with ref1.disable_adapter():
            base = parity.hf_greedy(ref1, [prompt], 5)[0]
        adapted = parity.hf_greedy(ref1, [prompt], 5)[0]
        assert base != adapted
        assert tokens("one") == adapted and tokens("tiny") == base and tokens(None) == base
        r = c.post("/v1/completions", json={"model": "two", "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "'one'" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": "one", "prompt": prompt, "max_tokens": 2, "stream": True})
        assert all(json.loads(line[6:])["model"] == "one" for line in r.text.splitlines()
                   if line.startswith("data: {")), r.text
    with pytest.raises(ConfigError, match="the adapter name 'one' is the served model's name"):
        create_app(out, config, served_model_name="one")


@pytest.mark.parametrize("damage", ["nan", "huge"])
def test_a_damaged_adapter_is_refused_at_start(served, tmp_path, damage):
    """An adapter whose factors hold NaN / infinity or values past float16's range (hostile trial, issue 48): every
    step multiplies each token by every loaded adapter's factors and masks the others' with zeros, so before, one
    such adapter made every request's logits NaN, the base model's too ("check the build"). Now refused at start,
    naming the adapter and the tensor."""
    import shutil

    from safetensors.numpy import load_file, save_file

    out, d, _, _ = served
    bad = tmp_path / "bad"
    shutil.copytree(d / "a1", bad)
    w = load_file(str(bad / "adapter_model.safetensors"))
    key = sorted(k for k in w if "lora_B" in k)[0]
    w[key] = w[key].copy()
    w[key].flat[3] = np.nan if damage == "nan" else 1e30
    save_file(w, str(bad / "adapter_model.safetensors"))
    with pytest.raises(KvExportError, match=r"lora_modules \(bad\).*" + ("NaN or infinity" if damage == "nan"
                                                                          else "beyond 65504")) as e:
        LLM(out, lora_modules=f"one={d / 'a1'},bad={bad}", kv_cache_memory="8MiB")
    assert key in str(e.value)


def test_kvexport_generate_runs_the_prompts_under_the_adapter_named(served):
    """`kvexport generate --lora-modules ... --lora NAME`: before, generate loaded the adapters and had no way to use
    them (every prompt ran the base model); an adapter not given is refused by name before the build loads."""
    from click.testing import CliRunner

    from kvexport.cli import main

    out, d, ref1, _ = served
    run = CliRunner().invoke
    mods = f"one={d / 'a1'},two={d / 'a2'}"
    r = run(main, ["generate", str(out), "5 6 7", "--max-tokens", "3", "--lora-modules", mods, "--lora", "three"])
    assert r.exit_code == 2 and "--lora" in r.output and "no adapter 'three'" in r.output and "(one, two)" in r.output
    r = run(main, ["generate", str(out), "5 6 7", "--max-tokens", "3", "--lora", "one"])
    assert r.exit_code == 2 and "no adapter 'one' is given by --lora-modules" in r.output


def test_adapters_loaded_and_unloaded_while_serving(served):
    """Runtime loading (vLLM's load/unload, issue 44 §3) on the Python API and the engine: an adapter loaded into a
    running engine gives peft's tokens; it cannot be unloaded while a request runs under it; a name reloaded with
    other weights never hits the KV cached under the old ones (the weights' hash is in the key); max_loras holds."""
    out, d, ref1, _ = served
    llm = LLM(out, kv_cache_memory="8MiB", max_loras=1)  # no --lora-modules: the set starts empty
    prompt = parity.random_prompts(1, TINY["vocab_size"], 24, 25, seed=21)[0]
    with pytest.raises(KvExportError, match="this engine serves no adapters"):
        llm.generate([prompt], SamplingParams(max_tokens=2, lora="one"))
    llm.load_lora("one", d / "a1")
    got = llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True, lora="one"))[0]
    assert got.token_ids == parity.hf_greedy(ref1, [prompt], 5)[0] and got.num_cached_prompt_tokens == 0
    with pytest.raises(ConfigError, match=r"lora_name: 1 adapters are loaded \(max_loras\)"):
        llm.load_lora("two", d / "a2")
    with pytest.raises(ConfigError, match="an adapter named 'one' is loaded"):
        llm.load_lora("one", d / "a2")
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(max_tokens=3, lora="one"))
    with pytest.raises(KvExportError, match="in use by 1 unfinished request"):
        llm.unload_lora("one")
    while engine.has_unfinished():
        engine.step()
    engine.pop_output(rid)
    llm.unload_lora("one")
    with pytest.raises(KvExportError, match="lora: this engine serves no adapters"):
        llm.generate([prompt], SamplingParams(max_tokens=2, lora="one"))
    llm.load_lora("one", d / "a2")  # the same name, other weights: a new key
    again = llm.generate([prompt], SamplingParams(max_tokens=2, lora="one"))[0]
    assert again.num_cached_prompt_tokens == 0
    assert llm.generate([prompt], SamplingParams(max_tokens=2, lora="one"))[0].num_cached_prompt_tokens == 20


def test_an_unloaded_adapter_leaves_a_hole_the_next_one_takes(served):
    """Slots never move: unloading the first of two adapters leaves its slot empty (the second keeps its slot and
    its tokens), the next adapter loaded takes the hole; a trailing hole is dropped (fewer slots per step)."""
    out, d, ref1, ref2 = served
    llm = LLM(out, kv_cache_memory="8MiB", max_loras=2)
    prompt = parity.random_prompts(1, TINY["vocab_size"], 10, 11, seed=23)[0]
    llm.load_lora("one", d / "a1")
    llm.load_lora("two", d / "a2")
    two = parity.hf_greedy(ref2, [prompt], 5)[0]
    tokens = lambda name: llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True, lora=name))[0].token_ids  # noqa: E731
    assert tokens("two") == two
    llm.unload_lora("one")
    assert [a.slot for a in llm.engine.loras.adapters] == [1] and tokens("two") == two
    llm.load_lora("three", d / "a1")
    assert {a.name: a.slot for a in llm.engine.loras.adapters} == {"three": 0, "two": 1}
    assert tokens("three") == parity.hf_greedy(ref1, [prompt], 5)[0] and tokens("two") == two
    width = next(iter(llm.engine.loras.factors.values())).shape[1]  # two slots, side by side
    llm.unload_lora("two")
    assert next(iter(llm.engine.loras.factors.values())).shape[1] == width // 2  # the trailing slot dropped


def test_the_openai_server_loads_adapters_when_allowed(served, tmp_path):
    """`kvexport serve --allow-runtime-lora`: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter; without
    the flag the routes do not exist; with --api-keys the flag is refused (no admin keys yet)."""
    from fastapi.testclient import TestClient

    from kvexport.runtime.config import EngineConfig
    from kvexport.runtime.serving.auth import ApiKeys
    from kvexport.runtime.serving.server import create_app

    out, d, ref1, _ = served
    prompt = parity.random_prompts(1, TINY["vocab_size"], 8, 9, seed=22)[0]
    config = EngineConfig(kv_cache_memory="8MiB")
    with TestClient(create_app(out, config, served_model_name="tiny")) as c:
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "one", "lora_path": str(d / "a1")}).status_code == 404
    with TestClient(create_app(out, config, served_model_name="tiny", allow_runtime_lora=True)) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "one", "lora_path": str(d / "a1")})
        assert r.status_code == 200 and "added" in r.text, r.text
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "one"]
        r = c.post("/v1/completions", json={"model": "one", "prompt": prompt, "max_tokens": 5, "temperature": 0,
                                            "ignore_eos": True, "logprobs": 0})
        assert r.status_code == 200 and r.json()["model"] == "one"
        assert [int(t) for t in r.json()["choices"][0]["logprobs"]["tokens"]] == parity.hf_greedy(ref1, [prompt], 5)[0]
        for body, status, param in (({"lora_name": "one", "lora_path": str(d / "a2")}, 400, "lora_name"),
                                    ({"lora_name": "tiny", "lora_path": str(d / "a2")}, 400, "lora_name"),
                                    ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 400, "lora_path"),
                                    ({"lora_name": "x"}, 400, "lora_path")):
            r = c.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "one"}).status_code == 200
        assert c.post("/v1/completions", json={"model": "one", "prompt": prompt, "max_tokens": 2}).status_code == 404
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "one"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    keys = ApiKeys.parse("0123456789abcdef0123 tenant-a")
    with pytest.raises(ConfigError, match="--allow-runtime-lora with --api-keys"):
        create_app(out, config, api_keys=keys, allow_runtime_lora=True)
