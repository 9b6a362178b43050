"""Importance eviction with speculative decoding (issue 48 §4; runtime/core/importance.py "Speculative
decoding"). h2o scores each decoded token's own attention row and may release a block between two
tokens; a speculative step computes the token and its drafts together and the attention op returns
the observed rows summed, so `--kv-eviction h2o --speculative ngram` changed greedy text (smollm2-135m,
budget 64: a code prompt diverged at its 185th token) — refused now, naming both options, wherever an
engine's settings are given. snapkv scores only the chunk that completes a prompt, which never carries
drafts: on the real smollm2 build its greedy text is the same with and without speculation while the
budget binds."""

from __future__ import annotations

import pytest

from kvexport.errors import ConfigError
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.llm import LLM
from kvexport.runtime.sampling_params import SamplingParams

REFUSAL = (r"--kv-eviction h2o cannot be combined with --speculative {}: h2o scores every decoded token's attention "
           r"on its own step.*give --speculative none, or --kv-eviction snapkv")

# 88 smollm2 tokens: more than the 48-token budget, so snapkv evicts when the prompt completes; code repeats,
# so the n-gram proposer drafts often (and is sometimes wrong, which exercises the rollback)
PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
          "def is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2, n):\n        if n % i == 0:\n"
          "            return False\n    return True\n\ndef factorial(n):\n")


@pytest.mark.parametrize("speculative, extra", [("ngram", {}), ("draft", dict(draft_model="some/build"))])
def test_h2o_with_speculation_is_refused_naming_both(speculative, extra):
    with pytest.raises(ConfigError, match=REFUSAL.format(speculative)):
        EngineConfig(kv_eviction="h2o", kv_budget_tokens=64, speculative=speculative, **extra)
    with pytest.raises(ConfigError, match=REFUSAL.format(speculative)):  # Triton's parameters
        EngineConfig.from_strings({"kv_eviction": "h2o", "kv_budget_fraction": "0.25", "speculative": speculative,
                                   **extra})
    EngineConfig(kv_eviction="snapkv", kv_budget_tokens=64, speculative=speculative, **extra)  # the fixes it names
    EngineConfig(kv_eviction="h2o", kv_budget_tokens=64, speculative="none")


def test_snapkv_greedy_text_is_the_same_with_and_without_speculation(smollm2_build):
    settings = dict(kv_eviction="snapkv", kv_budget_tokens=48, kv_observation_tokens=8, kv_cache_memory="64MiB",
                    speculative_cost_model=False)  # every draft the back-off allows, whatever the step costs
    params = SamplingParams(max_tokens=64, temperature=0)
    plain = LLM(smollm2_build, **settings).generate([PROMPT], params)[0].token_ids
    spec = LLM(smollm2_build, speculative="ngram", **settings)
    assert spec.generate([PROMPT], params)[0].token_ids == plain
    stats = spec.engine.speculation.stats()
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens  # some rejected
    full = LLM(smollm2_build, kv_cache_memory="64MiB").generate([PROMPT], params)[0].token_ids
    assert full != plain  # the budget binds: the prompt's KV was evicted
