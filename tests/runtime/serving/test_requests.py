"""runtime/serving/requests.py: prompts -> checked token ids, the context check, request fields ->
SamplingParams; and the `LLM` front end raising its RequestError (a tiny build)."""

import numpy as np
import pytest

from kvexport import io
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.serving.requests import RequestError, RequestParser, chat_messages, check_token_ids

VOCAB = 50


class Tok:
    """A tokenizer stand-in: one token per character; a chat template that tags roles."""

    chat_template = "{{ messages }}"

    def __init__(self, offset: int = 0):
        self.offset = offset  # added to every id (to push ids outside the vocabulary)

    def __call__(self, text):
        return {"input_ids": [ord(c) % 40 + self.offset for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise ValueError("unsupported role")
        ids = [1]
        for m in messages:
            ids += [2 if m["role"] == "user" else 3] + self(m["content"])["input_ids"]
        return {"input_ids": ids + [4]}  # a BatchEncoding-like mapping, as newer transformers return


def parser(tok=Tok(), max_model_len=10) -> RequestParser:
    return RequestParser(tok, VOCAB, max_model_len)


# ---- token ids ----------------------------------------------------------------------------
def test_check_token_ids_refuses_what_would_wrap_or_overflow():
    assert check_token_ids([0, 49, np.int32(7)], VOCAB) == [0, 49, 7]
    assert type(check_token_ids([np.int64(3)], VOCAB)[0]) is int
    for ids, msg in [([-1], "token id -1 is outside"), ([50], r"token id 50 is outside .*\[0, 50\)"),
                     ([True], "must be integers"), ([1.0], "must be integers"), (["3"], "must be integers")]:
        with pytest.raises(RequestError, match=msg) as e:
            check_token_ids(ids, VOCAB, "input_ids")
        assert e.value.param == "input_ids"


def test_prompt_text_ids_and_arrays():
    p = parser()
    assert p.prompt("ab") == [ord("a") % 40, ord("b") % 40]
    assert p.prompt([3, 4]) == [3, 4] and p.prompt(np.array([3, 4], np.int32)) == [3, 4]
    assert p.prompt([]) == []  # emptiness is check_length's business (LLM leaves it to the engine)
    with pytest.raises(RequestError, match="token id 65 is outside") as e:
        parser(Tok(offset=48)).prompt("a")  # a tokenizer producing ids the model does not have
    assert e.value.param == "prompt"
    with pytest.raises(RequestError, match="no tokenizer") as e:
        parser(None).prompt("hi", "text_input")
    assert e.value.param == "text_input"
    with pytest.raises(RequestError, match="must be a string or a list of token ids"):
        p.prompt({"a": 1})
    with pytest.raises(RequestError, match="token id -3 is outside"):
        p.prompt([1, -3])


def test_chat_messages_and_template():
    p = parser(max_model_len=100)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                               {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None}]
    assert chat_messages(msgs) == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"},
                                   {"role": "assistant", "content": ""}]
    assert p.chat(msgs) == [1, 3, ord("s") % 40, 2, ord("a") % 40, ord("b") % 40, 3, 4]
    for messages, param, msg in [
            ([], "messages", "non-empty list"),
            ("hi", "messages", "non-empty list"),
            ([{"content": "x"}], "messages[0]", "role"),
            ([{"role": "user", "content": 5}], "messages[0].content", "string or a list of text parts"),
            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
             "messages[0].content[0]", "text only"),
            ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text", "string"),
            ([{"role": "wizard", "content": "x"}], "messages", "chat template refused")]:
        with pytest.raises(RequestError, match=msg) as e:
            p.chat(messages)
        assert e.value.param == param, (messages, e.value.param)
    with pytest.raises(RequestError, match="no chat template") as e:
        parser(None).chat([{"role": "user", "content": "x"}])
    assert e.value.param == "messages"


def test_check_length_keeps_room_for_one_output_token():
    p = parser(max_model_len=10)
    assert p.check_length(9) == 1
    with pytest.raises(RequestError, match="context holds 10") as e:
        p.check_length(10)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(RequestError, match="empty"):
        p.check_length(0, "input_ids")


# ---- sampling -------------------------------------------------------------------------------
def test_sampling_params_max_tokens():
    p = parser(max_model_len=10)
    assert p.sampling_params({}, 4).max_tokens == 6  # all the room left
    assert p.sampling_params({}, 4, default_max_tokens=3).max_tokens == 3
    assert p.sampling_params({"max_tokens": 100}, 4).max_tokens == 6  # capped, not refused
    with pytest.raises(RequestError, match=r"max_tokens must be in \[1, 10\]"):
        p.sampling_params({"max_tokens": 11}, 4, strict_max_tokens=True)
    assert p.sampling_params({"max_tokens": 10}, 4, strict_max_tokens=True).max_tokens == 6
    for bad in (0, -1, True, 2.0):
        with pytest.raises(RequestError, match="max_completion_tokens must be") as e:
            p.sampling_params({"max_tokens": bad}, 4, names={"max_tokens": "max_completion_tokens"})
        assert e.value.param == "max_completion_tokens"
    with pytest.raises(RequestError, match="context holds"):
        p.sampling_params({}, 10)


def test_sampling_params_fields_and_errors_name_the_field():
    p = parser(max_model_len=100)
    sp = p.sampling_params({"temperature": 0.5, "top_k": 3, "stop": "END", "stop_token_ids": [7], "n": 2, "seed": 1,
                            "ignore_eos": True, "logprobs": 2, "top_p": None}, 5)
    assert (sp.temperature, sp.top_k, sp.stop, sp.stop_token_ids, sp.n, sp.seed, sp.ignore_eos, sp.logprobs,
            sp.top_p) == (0.5, 3, ("END",), (7,), 2, 1, True, 2, 1.0)
    assert p.sampling_params({"stop": ["a", "b"]}, 5).stop == ("a", "b")
    for values, param in [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"n": 0}, "n"),
                          ({"logprobs": 21}, "top_logprobs"), ({"stop": [""]}, "stop"), ({"stop": [1]}, "stop"),
                          ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [50]}, "stop_token_ids"),
                          ({"seed": -2}, "seed"), ({"presence_penalty": 3.0}, "presence_penalty")]:
        with pytest.raises(RequestError) as e:
            p.sampling_params(values, 5, names={"logprobs": "top_logprobs"})
        assert e.value.param == param, (values, str(e.value))
        assert param in str(e.value) or param == "top_logprobs"


# ---- the LLM front end raises RequestError ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny(hf_folder, tmp_path_factory):
    out, _ = build(str(hf_folder("llama")), tmp_path_factory.mktemp("rq") / "tiny",
                   BuildOptions(block_size=4, max_seq_len=64, validate=False, attention=io.Attention.ONNX))
    return out


def test_llm_raises_request_errors_and_queues_nothing(tiny):
    from kvexport import LLM, SamplingParams

    llm = LLM(tiny, kv_cache_memory="1MiB")
    assert llm.engine.vocab_size == 128
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for prompts, msg in [([[5, 6], [1, -1]], "token id -1 is outside"), ([[5, 128]], "token id 128 is outside"),
                         (["hello"], "no tokenizer"), ([[{"role": "user", "content": "hi"}]], "no chat template")]:
        with pytest.raises(RequestError, match=msg):
            llm.generate(prompts, params)
        assert not llm.engine.has_unfinished()
    with pytest.raises(RequestError, match="outside"):
        next(llm.stream([3, 200], params))
    (ok,) = llm.generate([[5, 6, 7]], params)
    assert ok.finish_reason == "length" and len(ok.token_ids) == 2
