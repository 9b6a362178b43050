"""Importance eviction's refusals name the option at fault and a fix that is accepted (issue 48 §4;
runtime/core/importance.py importance_budget). Before, `--kv-observation-tokens 100000` or
`--kv-sink-tokens 100000` were blamed on the budget: "--kv-budget-tokens 64 is smaller than the sinks ...
+ --kv-recent-tokens 100000 + one block: give at least 100032" — a budget the next check refuses as
larger than the context, and an option (--kv-recent-tokens) the user never gave."""

from __future__ import annotations

import re

import pytest

from kvexport.errors import ConfigError
from kvexport.runtime.core.importance import importance_budget

KW = dict(policy="h2o", budget_tokens=64, budget_fraction=None, sink_tokens=4, recent_tokens=None,
          observation_tokens=32, block_size=16, max_model_len=512)
FIELD = {"--kv-sink-tokens": "sink_tokens", "--kv-recent-tokens": "recent_tokens",
         "--kv-observation-tokens": "observation_tokens", "--kv-budget-tokens": "budget_tokens"}


def named_fixes(msg: str) -> list[dict[str, int]]:
    """Each alternative fix the message names ("lower A to <= 1 and B to <= 2, or raise C to >= 3"), as settings."""
    alternatives = re.split(r", or (?=(?:lower|raise) --kv-)", msg.split(": ", 1)[1])
    fixes = [re.findall(r"(--kv-[a-z-]+) to ([<>]=) (\d+)", a) for a in alternatives]
    return [{FIELD[o]: int(v) for o, _, v in f} for f in fixes if f]


@pytest.mark.parametrize("bad, lead", [
    (dict(observation_tokens=100_000), "--kv-observation-tokens 100000 (the observation window, always kept) + "
                                       "one block to evict is more than the context (max_model_len 512)"),
    (dict(sink_tokens=100_000), "--kv-sink-tokens 100000 (100000 tokens in whole blocks of 16) + one block to "
                                "evict leaves no room in the context (max_model_len 512) for "
                                "--kv-observation-tokens 32"),
    (dict(recent_tokens=100_000), "--kv-recent-tokens 100000 (the recent window, always kept) + one block to evict is "
                                  "more than the context (max_model_len 512)"),
    (dict(observation_tokens=100_000, recent_tokens=64), "--kv-observation-tokens 100000 (the observation window"),
    (dict(observation_tokens=100_000, budget_tokens=None, budget_fraction=0.25), "--kv-observation-tokens 100000"),
    (dict(sink_tokens=100_000, budget_tokens=None, budget_fraction=0.25), "--kv-sink-tokens 100000"),
    (dict(budget_tokens=100_000), "--kv-budget-tokens 100000 is larger than the context (max_model_len 512)"),
    (dict(budget_tokens=8), "--kv-budget-tokens 8 is smaller than the sinks (16 tokens"),
    (dict(observation_tokens=48), "--kv-budget-tokens 64 is smaller than the sinks (16 tokens: --kv-sink-tokens 4 in "
                                  "whole blocks of 16) + --kv-observation-tokens 48 + one block to evict (80 tokens)"),
    (dict(recent_tokens=8), "--kv-recent-tokens 8 is smaller than --kv-observation-tokens 32"),
    (dict(sink_tokens=300, observation_tokens=300, budget_tokens=None, budget_fraction=0.5),
     "the sinks (304 tokens: --kv-sink-tokens 300 in whole blocks of 16) + --kv-observation-tokens 300 + one block "
     "to evict (620 tokens) are more than the context (max_model_len 512)"),
])
def test_each_refusal_names_the_option_given_and_its_fixes_are_accepted(bad, lead):
    with pytest.raises(ConfigError) as e:
        importance_budget(**(KW | bad))
    msg = str(e.value)
    assert msg.startswith(lead), msg
    fixes = named_fixes(msg)
    assert fixes, msg
    given = {FIELD[o] for o in FIELD if o in lead}
    assert given & set(fixes[0]), f"the first fix must change an option the message blames: {msg}"
    for fix in fixes:  # every fix named is accepted with the other settings as given
        importance_budget(**(KW | bad | fix))


def test_the_observation_window_is_bounded_by_the_budget_it_is_given_with():
    """100000 observation tokens with a 64-token budget: the bound fits the budget, not only the context."""
    with pytest.raises(ConfigError, match=r"within --kv-budget-tokens 64\): lower --kv-observation-tokens to <= 32$"):
        importance_budget(**(KW | dict(observation_tokens=100_000)))


def test_the_fix_named_always_works():
    """Every refused combination (several bad at once included) names fixes, each accepted."""
    for ctx, bs in ((64, 16), (512, 16), (40, 16), (256, 4)):
        for sinks in (0, 4, 17, 48, 10**5):
            for obs in (1, 8, 47, 100, 10**5):
                for recent in (None, 1, 32, 100, 10**5):
                    for budget in (None, 16, 64, 512, 10**5):
                        kw = KW | dict(budget_tokens=budget, budget_fraction=None if budget else 0.5, sink_tokens=sinks,
                                       recent_tokens=recent, observation_tokens=obs, block_size=bs, max_model_len=ctx)
                        try:
                            importance_budget(**kw)
                            continue
                        except ConfigError as e:
                            msg = str(e)
                        fixes = named_fixes(msg)
                        assert fixes, msg
                        for fix in fixes:
                            importance_budget(**(kw | fix))


def test_a_context_of_one_block_says_to_raise_it():
    with pytest.raises(ConfigError, match=r"raise --max-model-len above 16, or serve it with --kv-eviction none"):
        importance_budget(**(KW | dict(budget_tokens=None, budget_fraction=0.5, max_model_len=16)))
