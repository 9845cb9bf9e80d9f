"""Turns a request's tokens into text deltas, and ends it at a stop string.

Text is released only when it can no longer change: a trailing incomplete UTF-8 sequence (decoded
as U+FFFD) waits for its next token, and the last `len(longest stop) - 1` characters wait until
it is certain they do not begin a stop string. The concatenated deltas therefore always equal the
final text, streamed or not.

Each step decodes only a short window (the tokens of the previous step and the new ones; the
text of the former is the prefix to strip), not the whole output: a step costs O(new tokens),
not O(output). The window keeps word-boundary spaces that some tokenizers drop when decoding
from the middle of a sequence.
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
        self.decoded = ""  # the text of token_ids[:read]
        self.prefix = 0  # token_ids[prefix:read] decode to the last part of `decoded`
        self.read = 0

    def _decode_window(self, finished: bool) -> None:
        ids = self.token_ids
        prefix_text = self.tokenizer.decode(ids[self.prefix : self.read])
        window = self.tokenizer.decode(ids[self.prefix :])
        if window.endswith("\ufffd") and not finished:
            return  # an incomplete character: wait for its next token
        if window.startswith(prefix_text):
            self.decoded += window[len(prefix_text) :]
        else:  # the tokenizer rewrote the prefix (rare): decode everything once
            self.decoded = self.tokenizer.decode(ids)
        self.prefix, self.read = self.read, len(ids)

    def add(self, new_ids: list[int], finished: bool) -> str:
        """Adds tokens; returns the newly releasable text. Sets `stopped` on a stop string."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_ids)
        before = len(self.decoded)
        self._decode_window(finished)
        text = self.decoded
        if self.stop:
            # A stop string can only end in the new text: search from just before it.
            start = max(0, min(len(self.text), before) - self.hold - 1)
            hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
            if hits:
                text = text[: min(hits)]
                self.stopped = True
                finished = True
        self.text = text
        end = len(text) if finished else len(text) - self.hold
        if end <= self.sent:
            return ""
        delta = text[self.sent : end]
        self.sent = end
        return delta
