"""SamplingParams (runtime/sampling_params.py) checks its types when made, naming the field:
a bool or float `logprobs`, a string `temperature`, an int `stop_token_ids` and the like are
refused with SamplingError, never a bare TypeError later in the engine; `stop="text"` is one
stop string, as vLLM takes it, not its characters."""

import math

import numpy as np
import pytest

from kvexport.runtime.sampling_params import SamplingError, SamplingParams


def test_a_stop_string_is_one_stop_string():
    assert SamplingParams(stop="text").stop == ("text",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=np.array([3, 4])).stop_token_ids == (3, 4)
    p = SamplingParams(temperature=1, top_p=np.float32(0.5), max_tokens=np.int64(4))
    assert (p.temperature, p.top_p, p.max_tokens) == (1.0, 0.5, 4) and type(p.max_tokens) is int


@pytest.mark.parametrize("kw, words", [
    (dict(logprobs=True), "logprobs must be an integer in [0, 20], got True"),
    (dict(logprobs=1.5), "logprobs must be an integer in [0, 20], got 1.5"),
    (dict(prompt_logprobs=False), "prompt_logprobs must be an integer"),
    (dict(temperature="0.5"), "temperature must be a number, got str '0.5'"),
    (dict(top_p=None), "top_p must be a number, got NoneType"),
    (dict(repetition_penalty=True), "repetition_penalty must be a number, got bool"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids, got int 5 (one id: [5])"),
    (dict(stop_token_ids="12"), "stop_token_ids must be a list of token ids, got str"),
    (dict(stop_token_ids=[1, True]), "stop_token_ids must hold token ids (integers >= 0), got True"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must hold token ids (integers >= 0), got -1"),
    (dict(max_tokens=2.0), "max_tokens must be an integer, got float 2.0"),
    (dict(min_tokens="1"), "min_tokens must be an integer, got str"),
    (dict(top_k=None), "top_k must be an integer, got NoneType"),
    (dict(n="2"), "n must be an integer, got str"),
    (dict(ignore_eos="no"), "ignore_eos must be true or false, got str"),
    (dict(seed=True), "seed must be a non-negative integer, got True"),
    (dict(stop=5), "stop must be a string or a list of strings, got int 5"),
    (dict(stop=[""]), "stop strings must be non-empty strings"),
    (dict(temperature=math.nan), "temperature must be in [0, 100], got nan"),
])
def test_wrong_types_name_the_field(kw, words):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**kw)
    assert words in str(e.value)
