from __future__ import annotations

from safeserve.model.tokenizer import ByteTokenizer
from safeserve.server.detokenizer import IncrementalDetokenizer


def _feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.add([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    return deltas


def test_partial_utf8_waits_for_its_last_byte() -> None:
    tok = ByteTokenizer()
    ids = list("aé🙂b".encode())
    detok = IncrementalDetokenizer(tok)
    deltas = _feed(detok, ids)
    assert "".join(deltas) == "aé🙂b"
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[ids.index(0xF0)] == ""  # first byte of the emoji alone releases nothing


def test_stop_string_cuts_and_is_never_partly_released() -> None:
    tok = ByteTokenizer()
    text = "hello STOP world"
    detok = IncrementalDetokenizer(tok, ["STOP", "zzz"])
    out = []
    for t in text.encode():
        out.append(detok.add([t], finished=False))
        if detok.stopped:
            break
    assert "".join(out) == "hello "
    assert detok.stopped
    assert detok.add([65], finished=False) == ""


def test_stop_string_spanning_tokens_and_finish_flushes_held_text() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, ["abc"])
    assert detok.add(list(b"xxab"), finished=False) == "xx"  # "ab" might start "abc"
    assert detok.add(list(b"d"), finished=True) == "abd"
    assert not detok.stopped
    detok2 = IncrementalDetokenizer(tok, ["abc"])
    detok2.add(list(b"xxab"), finished=False)
    assert detok2.add(list(b"c!"), finished=False) == ""
    assert detok2.stopped and detok2.text == "xx"


class _CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []

    def decode(self, ids: list[int]) -> str:
        self.lengths.append(len(ids))
        return super().decode(ids)


def test_each_step_decodes_a_short_window_not_the_whole_output() -> None:
    tok = _CountingTokenizer()
    text = ("naïve café 🙂 " * 200).strip()
    ids = list(text.encode())
    detok = IncrementalDetokenizer(tok, ["zz"])
    assert "".join(_feed(detok, ids)) == text
    # A 4-byte character needs 4 one-token steps before it decodes: windows stay that short.
    assert max(tok.lengths) <= 8, max(tok.lengths)
