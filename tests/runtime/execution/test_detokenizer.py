"""Incremental detokenization with the real SmolLM2 tokenizer: the streamed pieces add
up to the full decode, never contain a broken UTF-8 character, and stop strings that
span tokens cut the text exactly before the stop string."""


import pytest

from kvexport.runtime.execution.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    from kvexport.exporter import source

    return source.load_tokenizer(source.resolve("smollm2-135m"))  # the GGUF's tokenizer (cached: gguf_cache.py)


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


class _Counting:
    """The real tokenizer, counting how many token ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def test_work_per_token_is_constant_and_text_matches_the_full_decode(tok):
    """O(n) per request: 600 tokens of mixed text decode about a handful of ids per token
    (the whole-sequence decode would be ~180,000 ids); the pieces still add up exactly."""
    text = ("Der Käse — naïve 日本語 🚀 and plain English words, numbers 12345, code `x = y[3]`. " * 20)
    ids = tok(text, add_special_tokens=False)["input_ids"][:600]
    counting = _Counting(tok)
    d = IncrementalDetokenizer(counting)
    pieces = [d.add(t)[0] for t in ids] + [d.flush()]
    # (the cut may end inside a character: a trailing partial character is never emitted)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    assert counting.decoded < 8 * len(ids), counting.decoded


class _PiecesTokenizer:
    """A stand-in tokenizer whose tokens are given byte strings, to end a request exactly
    on an incomplete UTF-8 character; the real tokenizer above covers the rest."""

    PIECES = {1: b"ok ", 2: b"STOP\xe6", 3: b"\x97\xa5", 4: "é".encode()}

    def decode(self, ids, **kw):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def test_stop_string_completed_only_at_flush_is_still_cut():
    """The last token brings a stop string and half a character: the text before the
    stop string is held back with the character, and flush still cuts at the stop string."""
    d = IncrementalDetokenizer(_PiecesTokenizer(), ("STOP",))
    pieces = [d.add(1)[0], d.add(2)[0], d.flush()]
    assert "".join(pieces) == "ok " and d.stopped
    d = IncrementalDetokenizer(_PiecesTokenizer(), ("STOP",))  # completed by the next token: found at once
    assert d.add(1) == ("ok ", False) and d.add(2) == ("", False) and d.add(3) == ("", True)
    d = IncrementalDetokenizer(_PiecesTokenizer(), ("STOP",))
    assert "".join([d.add(1)[0], d.add(4)[0], d.flush()]) == "ok é"
