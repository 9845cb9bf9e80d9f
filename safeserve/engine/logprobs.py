"""Log-probabilities of the model's unmodified distribution: log_softmax of the raw float32
logits (no temperature, top-k or top-p), for sampled tokens and for prompt tokens.

Prompt log-probabilities need the logits of every prompt position of the requests that ask
(only theirs: the others' steps compute the logits of their sampling rows only, as before); a
long prompt's rows go through the LM head a slice at a time, so a prefill chunk of thousands of
tokens never holds [chunk, vocab] logits at once.

With `--enable-deterministic-inference` on CUDA each entry also carries a digest of its whole
logits row (`logits_digests`): a request's rows are then the same to the bit whatever shares its
steps, and the digest lets a client or the canary check that without the vocabulary-sized rows.
(On CPU the library GEMMs pick their kernel by the number of rows, so rows are equal to about
1e-5, not to the bit: no digest there.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from safeserve.engine.plan import SeqPlan
from safeserve.kernels.common import batch_invariant
from safeserve.messages import TokenLogprob

# Seeds the per-position multipliers of the logits digest (changing it changes every digest).
DIGEST_SEED = 0x5AFE5E
# Rows of prompt logits computed at once: [256, 152k] float32 is 150 MiB.
PROMPT_ROWS_PER_SLICE = 256


def token_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """Row i of `logits` [n, V]: `tokens[i]`'s log-probability and the `tops[i]` most likely
    tokens, most likely first. Three host copies for the whole batch."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    index = torch.tensor(tokens, dtype=torch.int64, device=lp.device)[:, None]
    chosen = lp.gather(1, index)[:, 0].tolist()
    k = min(max(tops), lp.shape[-1])
    top_v: list[list[float]] = [[] for _ in tokens]
    top_i: list[list[int]] = [[] for _ in tokens]
    if k > 0:
        values, ids = torch.topk(lp, k, dim=-1)
        top_v, top_i = values.tolist(), ids.tolist()
    digests: list[str | None] = (
        list(logits_digests(logits))
        if batch_invariant() and logits.is_cuda
        else [None] * len(tokens)
    )
    return [
        TokenLogprob(
            tok, c, list(zip(top_i[i][: tops[i]], top_v[i][: tops[i]], strict=True)), digests[i]
        )
        for i, (tok, c) in enumerate(zip(tokens, chosen, strict=True))
    ]


def logits_digests(logits: torch.Tensor) -> list[str]:
    """Per row of `logits` [n, V], 16 hex digits: the sum over positions j of the float32 bit
    pattern of logit j times a fixed odd 64-bit multiplier of j, modulo 2^64. Computed where
    the logits are (one reduction; no vocabulary-sized copy to the host); integer sums do not
    depend on their order, so the digest is the same on every device. Any one logit changed
    (by one ulp, or only its sign of zero) changes it; two changes cancel with probability
    about 2^-64."""
    bits = logits.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    sums = (bits * _multipliers(bits.shape[-1], bits.device)).sum(dim=-1)
    return [f"{v & 0xFFFFFFFFFFFFFFFF:016x}" for v in sums.tolist()]


@functools.cache
def _multipliers(vocab: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(DIGEST_SEED)
    odd = torch.randint(-(2**61), 2**61, (vocab,), generator=gen, dtype=torch.int64) * 2 + 1
    return odd.to(device)


def prompt_rows(seqs: list[SeqPlan]) -> list[tuple[int, int, int]]:
    """(sequence index, first row within the step's flat tokens, number of rows) of every
    sequence whose prompt log-probabilities this step computes."""
    out, offset = [], 0
    for i, s in enumerate(seqs):
        if s.prompt_lp_targets:
            out.append((i, offset + s.prompt_lp_first - s.start, len(s.prompt_lp_targets)))
        offset += len(s.token_ids)
    return out


def prompt_logprobs(
    seqs: list[SeqPlan],
    rows_of: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
) -> dict[int, list[TokenLogprob]]:
    """Sequence index -> its prompt rows' log-probabilities (of `SeqPlan.prompt_lp_targets`,
    with the `prompt_lp_top` most likely). `rows_of(index)` gives the logits of those flat rows
    of the step (the LM head on hidden rows, or rows of logits a decode graph computed)."""
    out: dict[int, list[TokenLogprob]] = {}
    for i, first, n in prompt_rows(seqs):
        s = seqs[i]
        targets = s.prompt_lp_targets or []
        entries: list[TokenLogprob] = []
        for a in range(0, n, PROMPT_ROWS_PER_SLICE):
            b = min(n, a + PROMPT_ROWS_PER_SLICE)
            index = torch.arange(first + a, first + b, dtype=torch.int64, device=device)
            entries.extend(
                token_logprobs(rows_of(index), targets[a:b], [s.prompt_lp_top] * (b - a))
            )
        out[i] = entries
    return out


def sampled_logprobs(
    logits: torch.Tensor, sampling: list[SeqPlan], tokens: list[int | str]
) -> list[TokenLogprob | None]:
    """One per sampling row: the sampled token's log-probability where the row asks (and did
    not fail), else None."""
    rows = [
        i
        for i, (s, t) in enumerate(zip(sampling, tokens, strict=True))
        if s.params is not None and s.params.logprobs is not None and isinstance(t, int)
    ]
    out: list[TokenLogprob | None] = [None] * len(sampling)
    if not rows:
        return out
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    got = token_logprobs(
        logits[index],
        [int(tokens[i]) for i in rows],
        [max(0, int(sampling[i].params.logprobs)) for i in rows],  # type: ignore[union-attr,arg-type]
    )
    for i, lp in zip(rows, got, strict=True):
        out[i] = lp
    return out
