"""Incremental detokenization with stop strings.

Emits only text that is final: never a partial UTF-8 character (decoders render an
incomplete byte sequence as U+FFFD, which is held back until the next token completes it),
and never the beginning of what may become a stop string (held back until it is clearly
not one). Stop strings may span tokens; the text up to the stop string is returned and
the stop string itself is not.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned
        self.stopped = False

    def _text(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Add one token; returns (new final text, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        self.ids.append(token_id)
        text = self._text()
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                end = min(hits)
                new = text[self.emitted:end]
                self.emitted = max(self.emitted, end)
                self.stopped = True
                return new, True
        end = len(text)
        while end > self.emitted and text[end - 1] == "\ufffd":
            end -= 1
        hold = 0
        for s in self.stop:  # longest suffix of text that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, end - self.emitted), 0, -1):
                if text[:end].endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end -= hold
        new = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return new, False

    def flush(self) -> str:
        """Text still held back, at the end of the request (a held-back partial stop
        string that never completed is real text)."""
        if self.stopped:
            return ""
        text = self._text().rstrip("\ufffd")
        new = text[self.emitted:]
        self.emitted = len(text)
        return new
