"""runtime/serving/openai_protocol.py: the request models refuse wrong types at any depth, their
validation errors become OpenAI 400 bodies naming the field, requests become token ids and
SamplingParams, and the response/chunk builders give OpenAI's shapes."""

import json

import pytest
from pydantic import ValidationError

from kvexport.runtime.serving import openai_protocol as proto
from kvexport.runtime.serving.openai_protocol import ApiError, ChatCompletionRequest, CompletionRequest
from kvexport.runtime.serving.requests import RequestError, RequestParser


class Tok:
    chat_template = "x"

    def __call__(self, text):
        return {"input_ids": [ord(c) % 40 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [1] + [t for m in messages for t in self(m["content"])["input_ids"]] + [2]


PARSER = RequestParser(Tok(), 50, 16)
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("model, body", [
    (CompletionRequest, {}),  # no prompt
    (CompletionRequest, {"prompt": 5}),
    (CompletionRequest, {"prompt": [1, "a"]}),
    (CompletionRequest, {"prompt": [[1], ["a"]]}),
    (CompletionRequest, {"prompt": "x", "max_tokens": "5"}),
    (CompletionRequest, {"prompt": "x", "max_tokens": 5.0}),
    (CompletionRequest, {"prompt": "x", "n": True}),
    (CompletionRequest, {"prompt": "x", "temperature": "0.5"}),
    (CompletionRequest, {"prompt": "x", "stop": [1]}),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": ["a"]}),
    (CompletionRequest, {"prompt": "x", "logprobs": True}),
    (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": "yes"}}),
    (CompletionRequest, {"prompt": "x", "stream": 1}),
    (ChatCompletionRequest, {}),
    (ChatCompletionRequest, {"messages": "hi"}),
    (ChatCompletionRequest, {"messages": [{"content": "hi"}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": ["hi"]}]}),
    (ChatCompletionRequest, {"messages": MSG, "logprobs": 1}),
    (ChatCompletionRequest, {"messages": MSG, "top_logprobs": 1.5}),
])
def test_wrong_types_are_refused_at_any_depth(model, body):
    with pytest.raises(ValidationError):
        model.model_validate(body)


def test_valid_bodies():
    c = CompletionRequest.model_validate({"prompt": ["a", "b"], "temperature": 1, "stop": "x", "user": "u",
                                          "stream_options": {"include_usage": True}})
    assert c.prompt == ["a", "b"] and c.temperature == 1.0 and c.stream_options.include_usage
    # unknown fields are refused, not ignored (a field this server does not implement would change the answer)
    assert errors_of(CompletionRequest, {"prompt": "a", "unknown": {"a": 1}}).param == "unknown"
    assert CompletionRequest.model_validate({"prompt": [[1, 2], [3]]}).prompt == [[1, 2], [3]]
    m = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]},
                                                           {"role": "assistant", "content": None}]})
    assert m.messages[0].content[0].text == "a" and m.messages[1].content is None


def errors_of(model, body) -> ApiError:
    """The 400 the server sends for this body (FastAPI puts 'body' first in each loc)."""
    try:
        model.model_validate(body)
    except ValidationError as e:
        return proto.validation_error([dict(err, loc=("body", *err["loc"])) for err in e.errors()])
    raise AssertionError("valid")


@pytest.mark.parametrize("model, body, param, message", [
    (CompletionRequest, {}, "prompt", "prompt: Field required"),
    (CompletionRequest, {"prompt": [1, "a"]}, "prompt[1]", "prompt[1]: Input should be a valid integer"),
    (CompletionRequest, {"prompt": 5}, "prompt", "prompt: expected str or list[int] or list[str] or list[list[int]]"),
    (CompletionRequest, {"prompt": "x", "stop": [1]}, "stop[0]", "stop[0]: Input should be a valid string"),
    (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": 2}}, "stream_options.include_usage",
     "stream_options.include_usage: Input should be a valid boolean"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text", "messages[0].content[0].text: Input should be a valid string"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type", "messages[0].content[0].type: Input should be 'text'"),
])
def test_validation_errors_name_the_field(model, body, param, message):
    e = errors_of(model, body)
    assert e.status == 400 and e.param == param and e.message.split("; ")[0] == message
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_validation_errors_of_the_body_itself():
    bad_json = proto.validation_error([{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error",
                                        "ctx": {"error": "Expecting value"}}])
    assert bad_json.param is None and bad_json.message == "the request body is not valid JSON: Expecting value"
    missing = proto.validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    assert missing.message == "the request body is required"
    not_json = proto.validation_error([{"type": "model_attributes_type", "loc": ("body",), "msg": "x",
                                        "input": b"a=1"}])
    assert "Content-Type: application/json" in not_json.message
    many = errors_of(CompletionRequest, {"prompt": "x", "n": "1", "seed": "1", "top_k": "1", "min_tokens": "1"})
    assert many.message.endswith("(and 1 more)") and many.param == "n"


def test_request_errors_map_to_400():
    e = ApiError.from_request_error(RequestError("too long", "prompt", code="context_length_exceeded"))
    assert e.body() == {"error": {"message": "too long", "type": "invalid_request_error", "param": "prompt",
                                  "code": "context_length_exceeded"}} and e.status == 400


# ---- request -> token ids, SamplingParams ---------------------------------------------------
def test_prompts():
    c = lambda **kw: CompletionRequest.model_validate(kw)  # noqa: E731
    assert proto.prompts(c(prompt="ab"), PARSER) == [[17, 18]]
    assert proto.prompts(c(prompt=[3, 4]), PARSER) == [[3, 4]]
    assert proto.prompts(c(prompt=["a", "b"]), PARSER) == [[17], [18]]
    assert proto.prompts(c(prompt=[[3], [4, 5]]), PARSER) == [[3], [4, 5]]
    assert proto.prompts(ChatCompletionRequest.model_validate({"messages": MSG}), PARSER) == [[1, 24, 25, 2]]
    for body, param, msg in [(c(prompt=[]), "prompt", "empty"), (c(prompt=[3, -1]), "prompt", "outside"),
                             (c(prompt=[[3], [60]]), "prompt[1]", "token id 60"),
                             (c(prompt=[[3], [1] * 16]), "prompt[1]", "context holds 16")]:
        with pytest.raises(RequestError, match=msg) as e:
            proto.prompts(body, PARSER)
        assert e.value.param == param


def test_sampling_params_from_bodies():
    c = lambda **kw: CompletionRequest.model_validate({"prompt": "x", **kw})  # noqa: E731
    sp = proto.sampling_params(c(logprobs=2, stop="END"), PARSER, 4)
    assert sp.max_tokens == 12 and sp.logprobs == 2 and sp.stop == ("END",)  # 16 by default, capped at the room
    sp = proto.sampling_params(c(max_tokens=3, seed=5), PARSER, 4)
    assert sp.max_tokens == 3 and sp.seed == 5 and sp.logprobs is None
    chat = lambda **kw: ChatCompletionRequest.model_validate({"messages": MSG, **kw})  # noqa: E731
    assert proto.sampling_params(chat(), PARSER, 4).max_tokens == 12  # chat: all the room
    sp = proto.sampling_params(chat(logprobs=True, top_logprobs=3, max_completion_tokens=2, max_tokens=9), PARSER, 4)
    assert sp.logprobs == 3 and sp.max_tokens == 2
    with pytest.raises(ApiError, match="set logprobs to true"):  # as OpenAI: top_logprobs needs logprobs
        proto.sampling_params(chat(logprobs=False, top_logprobs=3), PARSER, 4)
    assert proto.sampling_params(chat(logprobs=True), PARSER, 4).logprobs == 0
    for body, param in [(chat(logprobs=True, top_logprobs=21), "top_logprobs"),
                        (chat(max_completion_tokens=0), "max_completion_tokens"),
                        (chat(temperature=-1.0), "temperature"),
                        (chat(stop_token_ids=[99]), "stop_token_ids")]:
        with pytest.raises(RequestError) as e:
            proto.sampling_params(body, PARSER, 4)
        assert e.value.param == param


# ---- responses ------------------------------------------------------------------------------
def decode(t: int) -> str:
    return "xy"[t % 2] * (t % 3 + 1)


def test_logprobs_blocks():
    assert proto.logprobs_block(False, [1], None, None, 0, decode) is None
    a = proto.logprobs_block(False, [1, 2], [-0.1, -0.2], [[(1, -0.1)], [(2, -0.2), (4, -0.3)]], 5, decode)
    assert a == {"tokens": ["yy", "xxx"], "token_logprobs": [-0.1, -0.2], "text_offset": [5, 7],
                 "top_logprobs": [{"yy": -0.1}, {"xxx": -0.2, "xy"[0] * 2: -0.3}]}
    b = proto.logprobs_block(False, [3], [-0.5], None, 10, decode)
    assert b["top_logprobs"] is None
    merged = proto.merge_logprobs(a, b, False)
    assert merged["tokens"] == ["yy", "xxx", "y"] and merged["text_offset"] == [5, 7, 10]
    assert merged["top_logprobs"] == [{"yy": -0.1}, {"xxx": -0.2, "xx": -0.3}]
    c = proto.logprobs_block(True, [1], [-0.1], [[(1, -0.1)]], 0, decode)
    assert c == {"content": [{"token": "yy", "logprob": -0.1, "bytes": [121, 121],
                              "top_logprobs": [{"token": "yy", "logprob": -0.1, "bytes": [121, 121]}]}]}
    one = list(c["content"])
    assert proto.merge_logprobs(c, dict(c), True)["content"] == one * 2
    assert proto.merge_logprobs(None, b, False) is b and proto.merge_logprobs(b, None, False) is b


def test_response_and_chunk_shapes():
    u = proto.usage(3, 4)
    assert u == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                 "prompt_tokens_details": {"cached_tokens": 0}}
    assert proto.usage(3, 4, 2)["prompt_tokens_details"] == {"cached_tokens": 2}
    assert proto.cached_tokens([16, 16, 0, 8], num_prompts=2, n=2) == 24  # once per prompt, as prompt_tokens
    r = proto.response(True, "id", 1, "m", [proto.choice(True, 0, "hi", None, "stop")], u)
    assert r["object"] == "chat.completion" and r["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    r = proto.response(False, "id", 1, "m", [proto.choice(False, 0, "hi", None, "length")], u)
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == "hi"
    line = proto.chunk(True, "id", 1, "m", [proto.chunk_choice(True, 0, "", None, "stop")], include_usage=True)
    assert line.startswith("data: ") and line.endswith("\n\n")
    d = json.loads(line[6:])
    assert d["object"] == "chat.completion.chunk" and d["choices"][0]["delta"] == {} and d["usage"] is None
    d = json.loads(proto.chunk(False, "id", 1, "m", [proto.chunk_choice(False, 1, "a", None, None)], False)[6:])
    assert d["choices"] == [{"index": 1, "text": "a", "logprobs": None, "finish_reason": None}] and "usage" not in d
    assert proto.role_chunk_choices(2)[1]["delta"] == {"role": "assistant", "content": ""}
    assert proto.engine_failure("the prompt is empty").status == 400
    assert proto.engine_failure("engine error: boom").status == 500
