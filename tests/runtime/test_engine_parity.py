"""The runtime's greedy outputs equal transformers' greedy `generate` for many prompts of
different lengths served at once with continuous batching — also when the KV pool is so
small that requests get preempted, when prompts share prefixes (prefix-cache hits), and
when a small token budget forces chunked prefill. Tiny random models of each family and
the real smollm2-135m; `onnx` attention builds and `plugin` builds (the native CPU
PagedAttention op, plugins/paged_attention/cpu)."""

import pytest

from kvexport import LLM, SamplingParams, io
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from testkit.parity import hf_greedy, random_prompts

STEPS = 10


@pytest.fixture(scope="module")
def tiny_builds(tmp_path_factory, hf_folder):
    cache = {}

    def get(family, attention="onnx", **overrides):
        key = (family, attention, tuple(sorted(overrides.items())))
        if key not in cache:
            src = hf_folder(family, **overrides)
            out, _ = build(str(src), tmp_path_factory.mktemp("rt") / family,
                           BuildOptions(block_size=4, max_seq_len=128, validate=False,
                                        attention=io.Attention(attention)))
            cache[key] = (out, source.load_model(source.resolve(str(src))))
        return cache[key]

    return get


FAMILIES = [("llama", dict(num_key_value_heads=2)), ("mistral", dict(num_key_value_heads=2, sliding_window=8)),
            ("qwen2", dict(num_key_value_heads=2)), ("phi3", dict(num_key_value_heads=1)), ("gpt2", {})]


@pytest.mark.parametrize("attention", ["onnx", "plugin"])
@pytest.mark.parametrize("family,overrides", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_continuous_batching_matches_transformers(tiny_builds, family, overrides, attention, request):
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    out, model = tiny_builds(family, attention, **overrides)
    prompts = random_prompts(8, 128, 3, 40)
    llm = LLM(out, kv_cache_memory="1MiB", max_num_batched_tokens=64, max_num_seqs=8)
    assert (llm.engine.backend.attention_impl == "plugin (native CPU op)") == (attention == "plugin")
    got = llm.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, STEPS)
    assert all(o.finish_reason == "length" for o in got)
    assert llm.engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("attention", ["onnx", "plugin"])
def test_preemption_keeps_outputs_exact(tiny_builds, attention, request):
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    out, model = tiny_builds("llama", attention, num_key_value_heads=2)
    prompts = random_prompts(6, 128, 10, 30, seed=1)
    # 512 bytes/token x 4 tokens/block: 14 blocks (13 usable) = 52 tokens for 6 sequences of up to 40
    llm = LLM(out, kv_cache_memory=14 * 4 * 512, max_num_batched_tokens=64)
    got = llm.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, STEPS)
    assert llm.engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("attention", ["onnx", "plugin"])
def test_shared_prefixes_hit_the_cache(tiny_builds, attention, request):
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    out, model = tiny_builds("llama", attention, num_key_value_heads=2)
    prefix = random_prompts(1, 128, 17, 18, seed=5)[0]
    prompts = random_prompts(5, 128, 2, 9, seed=2, prefix=prefix)
    llm = LLM(out, kv_cache_memory="1MiB", max_num_seqs=1)  # one at a time: later ones find the prefix cached
    got = llm.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, STEPS)
    assert llm.engine.pool.stats.hits >= 4 * (len(prefix) // 4)
    assert all(o.num_cached_prompt_tokens == 16 for o in got[1:])


@pytest.mark.parametrize("attention", ["onnx", "plugin"])
def test_chunked_prefill_with_a_small_token_budget(tiny_builds, attention, request):
    if attention == "plugin":
        request.getfixturevalue("cpu_op")
    out, model = tiny_builds("qwen2", attention, num_key_value_heads=2)
    prompts = random_prompts(4, 128, 30, 60, seed=3)
    llm = LLM(out, kv_cache_memory="1MiB", max_num_batched_tokens=8)
    got = llm.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, STEPS)


def test_seeded_sampling_is_independent_of_the_batch(tiny_builds):
    out, _ = tiny_builds("llama", num_key_value_heads=2)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    prompts = random_prompts(5, 128, 3, 20, seed=4)
    alone = LLM(out).generate([prompts[0]], params)[0].token_ids
    crowd = LLM(out, max_num_batched_tokens=16).generate(prompts, params)[0].token_ids
    assert alone == crowd


def test_bad_requests_fail_alone(tiny_builds):
    out, _ = tiny_builds("llama", num_key_value_heads=2)
    llm = LLM(out, kv_cache_memory=8 * 4 * 512)
    res = llm.generate([[5, 6, 7], list(range(3, 120)), [], [9, 10]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert res[0].finish_reason == "length" and len(res[0].token_ids) == 4
    assert res[1].finish_reason == "error" and "pool" in res[1].error
    assert res[2].finish_reason == "error" and "empty" in res[2].error
    assert res[3].finish_reason == "length"
    too_long = LLM(out).generate([[3 + i % 100 for i in range(128)]], SamplingParams(max_tokens=4))[0]
    assert too_long.finish_reason == "error" and "context" in too_long.error


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    out, _ = build("smollm2-135m", tmp_path_factory.mktemp("smol") / "b", BuildOptions(max_seq_len=512, validate=False,
                                                                                      attention=io.Attention.ONNX))
    return out, source.load_model(source.resolve("smollm2-135m"))


@pytest.fixture(scope="module")
def smol_plugin(tmp_path_factory, smol, cpu_op):
    out, _ = build("smollm2-135m", tmp_path_factory.mktemp("smolp") / "b",
                   BuildOptions(max_seq_len=512, validate=False, attention=io.Attention.PLUGIN))
    return out, smol[1]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smol", "smol_plugin"])
def test_smollm2_continuous_batching_matches_transformers(request, which):
    out, model = request.getfixturevalue(which)
    llm = LLM(out, kv_cache_memory="256MiB", max_num_batched_tokens=48)
    tok = llm.engine.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, a young",
             "List three colors:", "Water boils at", "The quick brown fox jumps over the lazy dog because it"]
    prompts = [tok(t)["input_ids"] for t in texts]
    got = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, 16)
    assert got[0].text == tok.decode(got[0].token_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_preemption_and_prefix_hits_keep_outputs_exact(smol):
    """Chat prompts share the template's system prefix (prefix-cache hits); a pool of 9
    blocks (8 usable x 16 tokens) cannot hold them all (preemption by recompute)."""
    out, model = smol
    llm = LLM(out, kv_cache_memory=9 * 16 * 46080, max_num_batched_tokens=64)
    questions = ["What is 2+2?", "Name a fruit.", "Say hello.", "Why is the sky blue?"]
    prompts = [llm._tokens([{"role": "user", "content": q}]) for q in questions]
    assert len(prompts[0]) > 16 and all(p[:16] == prompts[0][:16] for p in prompts)
    got = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.stats.hits > 0
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, 24)


def test_runtime_refuses_bad_build_directories(tiny_builds, hf_folder, tmp_path):
    from kvexport.errors import KvExportError, ManifestError

    with pytest.raises(ManifestError, match="kvexport.json"):
        LLM(tmp_path)
    contiguous, _ = build(str(hf_folder("llama")), tmp_path / "c",
                          BuildOptions(layout=__import__("kvexport").io.KVLayout.CONTIGUOUS, max_seq_len=64,
                                       validate=False))
    with pytest.raises(KvExportError, match="paged"):
        LLM(contiguous)


def test_sliding_window_keeps_kv_memory_bounded(tiny_builds):
    """Mistral, window 8, blocks of 4: a 100-token generation never holds more than the
    blocks covering the window (+1 partly filled, +1 being written)."""
    out, model = tiny_builds("mistral", num_key_value_heads=2, sliding_window=8)
    llm = LLM(out, kv_cache_memory="1MiB")
    eng = llm.engine
    rid = eng.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=100, ignore_eos=True))
    peak = 0
    while eng.has_unfinished():
        eng.step()
        peak = max(peak, eng.pool.num_used_blocks)
    got = eng.pop_output(rid).token_ids
    assert len(got) == 100 and peak <= 8 // 4 + 2
    assert got == hf_greedy(model, [[5, 6, 7, 8, 9]], 100)[0]


def test_streaming_yields_tokens_as_they_come(tiny_builds):
    import asyncio

    out, _ = tiny_builds("llama", num_key_value_heads=2)
    llm = LLM(out)
    seen = [(list(c.new_token_ids), c.finished) for c in llm.stream([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))]
    assert [len(t) for t, _ in seen] == [1] * 5 and [f for _, f in seen] == [False] * 4 + [True]
    tokens = [t[0] for t, _ in seen]

    async def collect():
        return [c.new_token_ids[0] async for c in llm.astream([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))]

    assert asyncio.run(collect()) == tokens


def test_parallel_samples_share_the_prompt_blocks(tiny_builds):
    out, _ = tiny_builds("llama", num_key_value_heads=2)
    llm = LLM(out, kv_cache_memory="1MiB")
    prompt = list(range(3, 3 + 21))  # 5 full blocks of 4
    res = llm.generate([prompt], SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True))
    assert len(res) == 4 and all(len(r.token_ids) == 6 for r in res)
    assert [r.num_cached_prompt_tokens for r in res] == [0, 20, 20, 20]
    assert len({tuple(r.token_ids) for r in res}) > 1  # different streams
    again = LLM(out, kv_cache_memory="1MiB").generate([prompt], SamplingParams(n=4, max_tokens=6, temperature=1.0,
                                                                               seed=3, ignore_eos=True))
    assert [r.token_ids for r in again] == [r.token_ids for r in res]
