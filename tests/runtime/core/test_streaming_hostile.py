"""Streaming eviction at extreme sink settings (runtime/core/streaming.py streaming_window; issue 31
§7): sinks that leave no room for a recent window are blamed on --kv-sink-tokens with a bound that
works. Before, the message told the user to lower --kv-recent-tokens to a negative number (sinks
10**6: "<= -999952") or to 0, which the next check refuses. bench/hostile_trial.py runs the whole
trial (extreme windows on real engines against a float64 reference)."""

from __future__ import annotations

import re

import pytest

from kvexport.errors import ConfigError
from kvexport.runtime.core.streaming import streaming_window

KW = dict(block_size=16, max_model_len=64, pool_tokens=10_000, max_num_batched_tokens=32)


@pytest.mark.parametrize("sinks", [48, 64, 10**6, 10**30])
def test_sinks_that_leave_no_window_name_the_sinks(sinks):
    with pytest.raises(ConfigError, match=r"--kv-sink-tokens .* leaves no room in max_model_len 64 for "
                                          r"--kv-recent-tokens 16 and the next block: lower --kv-sink-tokens to "
                                          r"<= 32$") as e:
        streaming_window(sink_tokens=sinks, recent_tokens=16, **KW)
    bound = int(re.search(r"<= (-?\d+)", str(e.value)).group(1))
    streaming_window(sink_tokens=bound, recent_tokens=16, **KW)  # the fix it names is accepted


def test_the_fix_named_always_works():
    """Every (sinks, recent) refused for the context names an option and a bound that is accepted."""
    for ctx in (32, 48, 64, 100):
        for sinks in (0, 1, 16, 17, 33, 48, 64, 200):
            for recent in (16, 17, 31, 32, 48, 64):
                kw = {**KW, "max_model_len": ctx}
                try:
                    streaming_window(sink_tokens=sinks, recent_tokens=recent, **kw)
                    continue
                except ConfigError as e:
                    msg = str(e)
                fixes = re.findall(r"(--kv-sink-tokens|--kv-recent-tokens) to (?:<= )?(-?\d+)", msg)
                assert fixes, msg
                fixed = {"sink_tokens": sinks, "recent_tokens": recent}
                for option, bound in fixes[:2]:  # the first fix named (one option, or both together)
                    fixed["sink_tokens" if option == "--kv-sink-tokens" else "recent_tokens"] = int(bound)
                    if " and --kv-recent-tokens to" not in msg:
                        break
                streaming_window(**fixed, **kw)


def test_a_context_of_under_two_blocks_says_to_turn_streaming_off():
    with pytest.raises(ConfigError, match=r"needs max_model_len >= two KV blocks \(32 tokens.*got 24: raise "
                                          r"--max-model-len or serve it with --kv-eviction none"):
        streaming_window(sink_tokens=0, recent_tokens=16, **{**KW, "max_model_len": 24})
