"""Incremental detokenization with stop strings, O(n) per request.

Each new token decodes only a short window: the tokens from `prefix_offset` (a few tokens
of context, so a tokenizer that renders a token differently at the start of a text — a
leading space, a byte-fallback sequence — renders it the same as in the whole text) to
the end, minus the window's already-read part `[prefix_offset, read_offset)`. So a step
costs O(window), not a decode of the whole output (vLLM / TGI's prefix/read offsets).

Emits only text that is final: never a partial UTF-8 character (decoders render an
incomplete byte sequence as U+FFFD; the offsets do not advance until the next token
completes it), and never the beginning of what may become a stop string (held back until
it is clearly not one). Stop strings may span tokens; the text up to the stop string is
returned and the stop string itself is not.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.prefix_offset = 0  # first token of the decode window (context only)
        self.read_offset = 0  # tokens up to here are in `text`
        self.text = ""  # decoded text of ids[:read_offset]
        self.emitted = 0  # characters of `text` already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _read(self) -> None:
        """Decode the tokens after read_offset into `text`, unless they end mid-character."""
        window = self.ids[self.prefix_offset:]
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset]) if self.read_offset > self.prefix_offset else ""
        full = self._decode(window)
        if full.endswith(_REPLACEMENT):
            return  # an incomplete UTF-8 sequence: wait for the tokens that complete it
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Add one token; returns (new final text, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        if self.tokenizer is None:
            return "", False
        self.ids.append(token_id)
        self._read()
        text = self.text
        if self.stop:
            start = max(0, self.emitted - self._longest_stop)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                end = min(hits)
                new = text[self.emitted:end]
                self.emitted = max(self.emitted, end)
                self.stopped = True
                return new, True
        end = len(text)
        hold = 0
        for s in self.stop:  # longest suffix of text that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, end - self.emitted), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end -= hold
        new = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return new, False

    def flush(self) -> str:
        """Text still held back, at the end of the request (a held-back partial stop
        string that never completed is real text; a trailing incomplete character is dropped;
        text completed only now is still cut at a stop string)."""
        if self.stopped or self.tokenizer is None:
            return ""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:]).rstrip(_REPLACEMENT)
            self.text += full[len(prefix):]
            self.read_offset = len(self.ids)
        end = len(self.text)
        if self.stop:
            start = max(0, self.emitted - self._longest_stop)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                end, self.stopped = max(self.emitted, min(hits)), True
        new = self.text[self.emitted:end]
        self.emitted = end
        return new
