"""The runtime on `--attention plugin` builds (pools updated by the graph, full block
tables; run on CPU with the reference PagedAttention custom op) and on int8-KV builds
(int8 pools), with continuous batching, preemption and prefix caching."""

import numpy as np
import pytest
import torch

from kvexport import LLM, SamplingParams, io
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build


def hf_greedy(model, prompts, steps):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def prompts_(n, seed, lo=3, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def llama(hf_folder):
    src = str(hf_folder("llama", num_key_value_heads=2))
    return src, source.load_model(source.resolve(src))


def test_plugin_build_serves_exact_tokens_with_preemption(llama, tmp_path):
    src, model = llama
    out, m = build(src, tmp_path / "p", BuildOptions(attention=io.Attention.PLUGIN, block_size=4,
                                                     max_seq_len=128, validate=False))
    prompts = prompts_(6, seed=1, lo=10, hi=30)
    # 14 blocks of 4 tokens (13 usable) cannot hold 6 sequences of up to 40: preemption
    llm = LLM(out, kv_cache_memory=14 * 4 * m.kv.bytes_per_token, max_num_batched_tokens=32)
    assert llm.engine.backend.full_block_tables
    got = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, 8)
    assert llm.engine.pool.num_used_blocks == 0


@pytest.fixture(scope="module")
def int8_build(llama, tmp_path_factory):
    src, model = llama
    out, m = build(src, tmp_path_factory.mktemp("i8") / "b",
                   BuildOptions(kv_dtype=io.DType.INT8, block_size=4, max_seq_len=128, validate=False,
                                attention=io.Attention.ONNX))
    return out, m, model


def test_int8_pool_is_int8_and_a_quarter_of_fp32(int8_build):
    out, m, _ = int8_build
    llm = LLM(out, kv_cache_memory="1MiB")
    pools = llm.engine.backend.pools
    assert all(p.dtype == np.int8 for p in pools)
    assert m.kv.bytes_per_token == 2 * 2 * 2 * 16  # layers x (K, V) x kv_heads x head_dim x 1 byte
    # the same budget holds 4x the blocks of an fp32 pool
    assert llm.engine.backend.num_blocks == (1 << 20) // (4 * m.kv.bytes_per_token)


def test_int8_outputs_do_not_depend_on_batching(int8_build):
    """Quantization is deterministic per token: a prompt's greedy output is the same alone,
    in a crowd with chunked prefill, and after preemption; and close to fp32 transformers."""
    out, m, model = int8_build
    prompts = prompts_(6, seed=2, lo=10, hi=30)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = [LLM(out).generate([p], params)[0].token_ids for p in prompts[:2]]
    llm = LLM(out, kv_cache_memory=14 * 4 * m.kv.bytes_per_token, max_num_batched_tokens=16)
    crowd = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in crowd[:2]] == alone
    ref = hf_greedy(model, prompts, 10)
    agree = np.mean([a == b for o, r in zip(crowd, ref) for a, b in zip(o.token_ids, r)])
    assert agree >= 0.8, agree


def test_int8_plugin_build_serves_the_same_tokens_as_the_int8_onnx_build(llama, int8_build, tmp_path, cpu_op):
    """The native CPU PagedAttention op with int8 pools (quantized stores, dequantized reads
    folded into the scales) against the `onnx` attention's QuantizeLinear/DequantizeLinear,
    both served with continuous batching, chunked prefill and preemption."""
    src, _ = llama
    onnx_out, m, _ = int8_build
    out, mp = build(src, tmp_path / "p8", BuildOptions(attention=io.Attention.PLUGIN, kv_dtype=io.DType.INT8,
                                                       block_size=4, max_seq_len=128, validate=False))
    assert mp.kv.quantization["scales"] == m.kv.quantization["scales"]  # same calibration
    prompts = prompts_(6, seed=3, lo=10, hi=30)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    llm = LLM(out, kv_cache_memory=14 * 4 * mp.kv.bytes_per_token, max_num_batched_tokens=16)
    assert llm.engine.backend.attention_impl == "plugin (native CPU op)" and llm.engine.backend.pools[0].dtype == np.int8
    got = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    want = LLM(onnx_out).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
