"""The parity harness shared by the runtime's and the families' tests: transformers' greedy
tokens for a list of prompts, and deterministic random prompts (optionally sharing a prefix)."""

from __future__ import annotations

import numpy as np
import torch


def hf_greedy(model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """transformers' `generate` (greedy, exactly `steps` new tokens: end tokens ignored) per prompt."""
    model.generation_config.eos_token_id = None  # forced length, like ignore_eos
    model.generation_config.pad_token_id = 0
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False)
            out.append(g[0, len(p):].tolist())
    return out


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0, prefix=()) -> list[list[int]]:
    """`n` prompts of ids in [3, vocab) (clear of pad/bos/eos), lengths in [lo, hi), after `prefix`."""
    rng = np.random.default_rng(seed)
    return [list(prefix) + rng.integers(3, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def check_hybrid_prefix_resume(build_dir, model) -> None:
    """A hybrid (gated DeltaNet) build on its default `plugin` attention: four prompts sharing a 27-token
    prefix, one at a time, a state checkpoint every 2 blocks of 4 (8 tokens): the later three resume from
    the checkpoint at 24 tokens, with the tokens of recomputation (no prefix caching) and of transformers."""
    from kvexport import LLM, SamplingParams

    prefix = random_prompts(1, 128, 27, 28, seed=5)[0]
    prompts = random_prompts(4, 128, 2, 9, seed=2, prefix=prefix)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    llm = LLM(build_dir, kv_cache_memory="1MiB", max_num_seqs=1, state_checkpoint_blocks=2, state_checkpoints=8)
    assert llm.engine.runner.backend.attention_impl == "plugin (native CPU op)"
    got = llm.generate(prompts, params)
    assert llm.engine.kv.state.hits == 3 and [o.num_cached_prompt_tokens for o in got] == [0, 24, 24, 24]
    again = LLM(build_dir, kv_cache_memory="1MiB", max_num_seqs=1, enable_prefix_caching=False).generate(prompts,
                                                                                                      params)
    assert [o.token_ids for o in got] == [o.token_ids for o in again] == hf_greedy(model, prompts, 10)


def check_hybrid_served(build_dir, manifest, model):
    """A hybrid build served as transformers computes it: 6 prompts of 10..30 tokens in 8-token chunks on 14
    usable 4-token blocks (batching, state carried across chunks, preemption by recompute), then a 150-token
    prompt in one step beside short ones. Returns (the pressed LLM, transformers' tokens for the 6 prompts)."""
    from kvexport import LLM, SamplingParams, io

    m = manifest
    prompts = random_prompts(6, 128, 10, 31, seed=1)
    per_token = io.kv_bytes_per_token(1, m.kv.num_kv_heads, m.kv.head_dim, io.DType(m.kv.dtype))  # one KV layer
    llm = LLM(build_dir, kv_cache_memory=15 * 4 * per_token, max_num_batched_tokens=8)
    got = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    want = hf_greedy(model, prompts, 12)
    assert [o.token_ids for o in got] == want
    long = random_prompts(1, 128, 150, 151, seed=3) + random_prompts(2, 128, 5, 9, seed=4)
    roomy = LLM(build_dir, kv_cache_memory="2MiB", max_num_batched_tokens=256, enable_prefix_caching=False)
    got = roomy.generate(long, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in got] == hf_greedy(model, long, 8)
    return llm, want


def float64_reference(folder, steps: int = 16) -> tuple[list[list[int]], list[list[int]], list[np.ndarray]]:
    """(prompts, greedy tokens, logits per step) of the validation's check (exporter/validate.py: its
    random prompts of a tokenizer-less tiny model, `steps` steps) from transformers run in float64: the
    exact model (its logits returned in float32: 1e-7), so `float64_gap` measures a build's own rounding alone.

    NOTE: the build's validation compares with transformers in float32, whose own rounding is part
    of that |Δ|: on tiny Gemma 4 models (attention scale 1, random norm weights, 6 layers) it is
    1e-5..2e-4 from float64 alone, where gemma3_text's is 1.5e-6. sdpa: eager attention rounds its
    softmax to float32 whatever the model's dtype."""
    from transformers import AutoModelForCausalLM

    from kvexport.exporter import validate

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="sdpa").eval()
    prompts = validate.prompt_ids(None, model.config.vocab_size)
    forced, logits = validate.reference(model, prompts, steps)
    return prompts, forced, logits


def float64_gap(build_dir, manifest, reference) -> float:
    """Max |Δ logits| of a fp32 build against `float64_reference`'s logits, run as the validation runs
    it (paged: prefill in two chunks, then the decode graph fed the reference's tokens; plugin graphs
    on the native op where it is built)."""
    from pathlib import Path

    from kvexport import io
    from kvexport.exporter import validate

    prompts, forced, exact = reference
    steps = len(exact) - 1
    paged = manifest.kv.layout == io.KVLayout.PAGED.value
    driver = (validate.PagedDriver(Path(build_dir), manifest) if paged
              else validate.ContiguousDriver(Path(build_dir), manifest))
    ours = driver.run(prompts, forced, steps)
    return max(float(np.abs(a.astype(np.float64) - r).max()) for a, r in zip(ours, exact))
