"""Logits digests (--enable-deterministic-inference on CUDA): a hash of each position's whole
float32 logits row that changes with any one logit, computed only in batch-invariant mode on
CUDA, and written into both OpenAI logprobs shapes. (That the digests of a request equal alone
and batched on a GPU: kernels/det_requests_check.py through a real server.)"""

from __future__ import annotations

import pytest
import torch
from seeds import seeded

from safeserve.engine.logprobs import logits_digests, token_logprobs
from safeserve.kernels import common
from safeserve.messages import TokenLogprob
from safeserve.model.tokenizer import load_tokenizer
from safeserve.server.logprobs import (
    DIGEST,
    DIGESTS,
    CompletionLogprobs,
    chat_logprobs,
    merge_completion_logprobs,
)


def test_a_digest_changes_with_any_one_logit_by_one_ulp() -> None:
    rows = torch.randn(3, 1000, generator=seeded(0))
    rows[2] = rows[0]
    d = logits_digests(rows)
    assert len(d) == 3 and all(len(x) == 16 and int(x, 16) >= 0 for x in d)
    assert d[0] == d[2] and d[0] != d[1]
    moved = rows.clone()
    moved[0, 777] = torch.nextafter(moved[0, 777], torch.tensor(float("inf")))
    assert logits_digests(moved)[0] != d[0]
    # bf16 logits are hashed as their float32 values
    assert logits_digests(rows.bfloat16())[0] == logits_digests(rows.bfloat16().float())[0]


def test_digests_only_in_batch_invariant_mode_on_cuda() -> None:
    logits = torch.randn(2, 50, generator=seeded(1))
    assert [lp.digest for lp in token_logprobs(logits, [3, 4], [1, 1])] == [None, None]
    common.set_batch_invariant(True)
    try:
        # CPU GEMMs are not batch-invariant to the bit: no digest that would promise it
        assert [lp.digest for lp in token_logprobs(logits, [3, 4], [1, 1])] == [None, None]
        if torch.cuda.is_available():
            got = token_logprobs(logits.cuda(), [3, 4], [1, 1])
            assert [lp.digest for lp in got] == logits_digests(logits)
    finally:
        common.set_batch_invariant(False)


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return load_tokenizer("tiny")


def test_completion_and_chat_logprobs_carry_the_digests(tok) -> None:  # type: ignore[no-untyped-def]
    lps = [TokenLogprob(65, -0.5, [(65, -0.5)], "00000000000000aa"), None]
    lps[1] = TokenLogprob(66, -1.0, [(66, -1.0)], "00000000000000bb")
    first = CompletionLogprobs(tok, 1).entries([70, 65], [None, lps[0]])  # echo: prompt first
    assert first[DIGESTS] == [None, "00000000000000aa"]
    second = CompletionLogprobs(tok, 1).entries([66], [lps[1]])
    plain = CompletionLogprobs(tok, 1).entries([67], [TokenLogprob(67, -2.0, [(67, -2.0)])])
    assert DIGESTS not in plain  # no digests: the standard shape, nothing added
    merged = merge_completion_logprobs([first, second, plain])
    assert merged[DIGESTS] == [None, "00000000000000aa", "00000000000000bb", None]
    assert len(merged["tokens"]) == len(merged[DIGESTS]) == 4
    assert DIGESTS not in merge_completion_logprobs([plain])
    chat = chat_logprobs(tok, 1, [65, 66], [lps[0], lps[1]])["content"]
    assert [c[DIGEST] for c in chat] == ["00000000000000aa", "00000000000000bb"]
    assert DIGEST not in chat_logprobs(tok, 1, [67], [TokenLogprob(67, -2.0)])["content"][0]


def test_a_digest_sees_the_sign_of_zero_and_does_not_depend_on_the_row_layout() -> None:
    rows = torch.zeros(2, 300)
    rows[1, 5] = -0.0
    a, b = logits_digests(rows)
    assert a != b  # bit-exact: -0.0 is another logit than 0.0
    wide = torch.randn(4, 600, generator=seeded(2))
    # a strided view hashes as its values: the same as a contiguous copy
    assert logits_digests(wide[:, ::2]) == logits_digests(wide[:, ::2].contiguous())
