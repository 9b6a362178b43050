"""The output processor with the real SmolLM2 tokenizer: every step returns new
RequestOutput objects (one held by a caller never changes), stop strings found in the text
are reported for the scheduler to finish, held-back text is released when a request
finishes for another reason, and errors carry their message."""


import pytest

from kvexport.runtime.execution.output_processor import OutputProcessor
from kvexport.runtime.sampling_params import SamplingParams
from kvexport.runtime.core.outputs import EngineCoreOutput


@pytest.fixture(scope="module")
def tok():
    from kvexport.exporter import source

    return source.load_tokenizer(source.resolve("smollm2-135m"))  # the GGUF's tokenizer (cached: gguf_cache.py)


def _feed(proc, rid, ids, last_reason=None):
    outs, stopped = [], []
    for k, t in enumerate(ids):
        reason = last_reason if k == len(ids) - 1 else None
        o, s = proc.process([EngineCoreOutput(rid, (t,), reason)])
        outs += o
        stopped += s
    return outs, stopped


def test_new_objects_every_step(tok):
    proc = OutputProcessor(tok)
    first = proc.add_request("a", [1, 2], SamplingParams())
    ids = tok("Hello there, world", add_special_tokens=False)["input_ids"]
    outs, stopped = _feed(proc, "a", ids, last_reason="length")
    assert first.token_ids == [] and first.text == "" and not first.finished
    assert [o.new_token_ids for o in outs] == [[t] for t in ids]
    assert [len(o.token_ids) for o in outs] == list(range(1, len(ids) + 1))
    assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].text == "Hello there, world"
    assert "".join(o.new_text for o in outs) == outs[-1].text and not stopped
    assert len({id(o) for o in outs}) == len(outs)


def test_stop_string_is_reported_and_cut(tok):
    proc = OutputProcessor(tok)
    proc.add_request("a", [1], SamplingParams(stop=("END OF",)))
    ids = tok("It is done. END OF STORY", add_special_tokens=False)["input_ids"]
    outs, stopped = _feed(proc, "a", ids)
    assert stopped == ["a"] and outs[-1].finish_reason == "stop" and outs[-1].text == "It is done. "
    assert sum(o.finished for o in outs) == 1  # tokens after the stop change nothing


def test_held_back_text_is_released_at_eos(tok):
    """A prefix of a stop string is held back while it may complete; when the request
    stops on EOS (the scheduler's stop) that text is final and is emitted."""
    proc = OutputProcessor(tok)
    proc.add_request("a", [1], SamplingParams(stop=("END OF STORY",)))
    ids = tok("We say END OF", add_special_tokens=False)["input_ids"]
    outs, _ = _feed(proc, "a", ids + [tok.eos_token_id], last_reason="stop")
    assert outs[-1].text == "We say END OF" and outs[-1].finish_reason == "stop"


def test_error_and_abort_outputs():
    proc = OutputProcessor(None)
    proc.add_request("a", [1], SamplingParams())
    (o,), _ = proc.process([EngineCoreOutput("a", (), "error", "the backend failed on this request: x")])
    assert o.finished and o.finish_reason == "error" and "backend failed" in o.error
    assert proc.finish("a", "abort") is None  # already finished: nothing changes
    proc.add_request("b", [1], SamplingParams())
    assert proc.finish("b", "abort").finish_reason == "abort"
    assert proc.pop("b").finished and "b" not in proc
