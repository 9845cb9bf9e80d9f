"""Two-batch overlap: where a step's tokens are split into two micro-batches.

With `--enable-two-batch-overlap` a forward step runs as two micro-batches, so that one's
attention and router compute while the other's MoE dispatch or combine is in flight. The leader
decides the split (`decide_split`, from `Engine.build_plan`) and every rank reads it from the
plan (`StepPlan.split`: per attention rank, the index among that rank's step tokens of the first
token of the second micro-batch). Pure functions of the step's query lengths (the tokens each
sequence computes this step), the same on every rank.

The rule, per attention rank:

- a pure decode batch (one token per sequence) splits at half its sequences, unless it holds
  fewer than `--tbo-min-decode-batch` of them (splitting a small decode batch costs more than it
  hides);
- any other batch splits at the sequence boundary with the most balanced token sums
  (`split_point`), unless the smaller side would hold less than
  `--tbo-token-distribution-threshold` of the tokens: then it is cut at half its tokens, and the
  one sequence that spans the cut runs in both micro-batches (`cut_pieces`): its second piece
  attends to its first as part of its prefix;
- a rank with no tokens has both micro-batches empty and does not keep the others from
  splitting; a rank with one token cannot split, and then no rank splits (every rank must run the
  same number of micro-batches, so that their collectives pair up).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class Piece:
    """A piece of sequence `seq` (its index in the rank's sequence list) in one micro-batch: its
    step tokens `offset` .. `offset + length - 1`."""

    seq: int
    offset: int
    length: int


def split_point(query_lens: list[int], threshold: float) -> int:
    """The prefill (or mixed) split of a rank's `query_lens`: the token index where the second
    micro-batch starts. The interior sequence boundary with the most balanced sides (ties: the
    smaller index), which cuts no sequence; if there is none, or its smaller side holds less than
    `threshold` of the tokens, half the tokens (`T // 2`), which may cut one sequence in two. For
    a total of at least 2 tokens both micro-batches hold tokens."""
    total = sum(query_lens)
    best: int | None = None
    for b in accumulate(query_lens):
        if 0 < b < total and (best is None or abs(2 * b - total) < abs(2 * best - total)):
            best = b
    if best is None or min(best, total - best) < threshold * total:
        return total // 2
    return best


def cuts_sequence(query_lens: list[int], at: int) -> bool:
    """Whether token index `at` falls strictly inside a sequence of `query_lens` (rather than at
    a boundary between two, or at either end)."""
    start = 0
    for n in query_lens:
        if start < at < start + n:
            return True
        start += n
    return False


def cut_pieces(query_lens: list[int], at: int) -> tuple[list[Piece], list[Piece]]:
    """The pieces of the first micro-batch (step tokens [0, at)) and of the second ([at, T)), in
    sequence order. A sequence that spans `at` is in both: its first piece is its tokens
    0 .. k-1, its second starts at offset k (and sees the first as its prefix). No piece is
    empty."""
    total = sum(query_lens)
    if not 0 <= at <= total:
        raise ValueError(f"split index {at} outside the step's {total} tokens")
    first: list[Piece] = []
    second: list[Piece] = []
    start = 0
    for i, n in enumerate(query_lens):
        head = min(max(at - start, 0), n)  # this sequence's tokens before `at`
        if head > 0:
            first.append(Piece(i, 0, head))
        if n - head > 0:
            second.append(Piece(i, head, n - head))
        start += n
    return first, second


def rank_split(query_lens: list[int], threshold: float, min_decode_batch: int) -> int | str:
    """One attention rank's split index, or why it cannot split (a `TBO_DECISIONS` reason)."""
    total = sum(query_lens)
    if total == 0:
        return 0  # both micro-batches empty here
    if total < 2:
        return "too_few_tokens"
    if all(n == 1 for n in query_lens):
        if len(query_lens) < min_decode_batch:
            return "decode_below_threshold"
        return len(query_lens) // 2
    return split_point(query_lens, threshold)


def decide_split(
    per_rank: list[list[int]], threshold: float, min_decode_batch: int
) -> tuple[list[int] | None, str]:
    """The step's split (`StepPlan.split`) and its decision (`messages.TBO_DECISIONS`), from
    each attention rank's query lengths (one list with tensor-parallel attention). Every rank
    splits, or none does: (None, the reason of the first rank in rank order that cannot). A step
    with no tokens on any rank runs whole ("too_few_tokens"). A split is "split_cut" where any
    rank's split cuts a sequence in two, else "split"."""
    splits: list[int] = []
    for lens in per_rank:
        at = rank_split(lens, threshold, min_decode_batch)
        if isinstance(at, str):
            return None, at
        splits.append(at)
    if not any(sum(lens) for lens in per_rank):
        return None, "too_few_tokens"
    cut = any(cuts_sequence(lens, at) for lens, at in zip(per_rank, splits, strict=True))
    return splits, "split_cut" if cut else "split"
