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
