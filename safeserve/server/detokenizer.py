"""Turns a request's tokens into text deltas, and ends it at a stop string.

Text is released only when it can no longer change: a trailing incomplete UTF-8 sequence (decoded
as U+FFFD) waits for its next token, and the last `len(longest stop) - 1` characters wait until
it is certain they do not begin a stop string. The concatenated deltas therefore always equal the
final text, streamed or not.
"""

from __future__ import annotations

from safeserve.model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # text so far, cut at a stop string once found
        self.sent = 0  # characters of `text` released
        self.stopped = False

    def add(self, new_ids: list[int], finished: bool) -> str:
        """Adds tokens; returns the newly releasable text. Sets `stopped` on a stop string."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_ids)
        text = self.tokenizer.decode(self.token_ids)
        if self.stop:
            # A stop string can only end in the new text: search from just before it.
            start = max(0, min(len(self.text), len(text)) - self.hold - 1)
            hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
            if hits:
                text = text[: min(hits)]
                self.stopped = True
                finished = True
        self.text = text
        if finished:
            end = len(text)
        else:
            end = len(text.rstrip("\ufffd")) - self.hold
        if end <= self.sent:
            return ""
        delta = text[self.sent : end]
        self.sent = end
        return delta
