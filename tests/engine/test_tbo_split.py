"""Two-batch overlap's split rule (engine/overlap.py): properties over generated batches and a
few hand-computed steps; then the leader's decision in `Engine.build_plan` and its count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from safeserve.config import ServerArgs
from safeserve.engine.cuda_graph import DecodeCudaGraphs, graph_buckets
from safeserve.engine.engine import Engine
from safeserve.engine.kv_cache import BlockAllocator
from safeserve.engine.overlap import (
    Piece,
    cut_pieces,
    cuts_sequence,
    decide_split,
    split_point,
)
from safeserve.engine.plan import Faults
from safeserve.engine.request import Request
from safeserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from safeserve.messages import TBO_DECISIONS, SamplingParams
from safeserve.parallel.layout import Layout

FAST = settings(max_examples=200, deadline=None)

query_lens = st.lists(st.integers(1, 64), min_size=1, max_size=24)
# a batch of at least two tokens (what split_point is asked about)
splittable = query_lens.filter(lambda q: sum(q) >= 2)
thresholds = st.floats(0.01, 0.5)
rank_lens = st.lists(st.integers(1, 16), max_size=12)  # a rank may hold nothing


def tokens_of(pieces: list[Piece], query_lens: list[int]) -> list[tuple[int, int]]:
    """(sequence, token index within its step tokens) of every token the pieces hold, in order."""
    assert all(p.length > 0 for p in pieces), "an empty piece"
    return [(p.seq, p.offset + j) for p in pieces for j in range(p.length)]


@FAST
@given(query_lens, st.data())
def test_the_halves_hold_every_token_once_in_order(lens: list[int], data: st.DataObject) -> None:
    at = data.draw(st.integers(0, sum(lens)))
    first, second = cut_pieces(lens, at)
    every = [(i, j) for i, n in enumerate(lens) for j in range(n)]
    assert tokens_of(first, lens) + tokens_of(second, lens) == every
    assert sum(p.length for p in first) == at
    # one sequence at most is in both halves: the one that spans `at`, its second piece going
    # on exactly where its first ended
    both = {p.seq for p in first} & {p.seq for p in second}
    assert len(both) == cuts_sequence(lens, at)
    for seq in both:
        head = next(p for p in first if p.seq == seq)
        tail = next(p for p in second if p.seq == seq)
        assert head.offset == 0 and tail.offset == head.length
        assert head.length + tail.length == lens[seq]
        assert head == first[-1] and tail == second[0]


@FAST
@given(splittable, thresholds)
def test_a_split_at_a_boundary_leaves_each_half_its_share(
    lens: list[int], threshold: float
) -> None:
    """Both halves hold tokens; a split that cuts no sequence leaves each at least `threshold` of
    them, unless it is the fallback at half the tokens that happens to fall on a boundary (an odd
    total: its smaller half is one token short of half)."""
    total = sum(lens)
    at = split_point(lens, threshold)
    assert 0 < at < total
    if cuts_sequence(lens, at):
        assert at == total // 2
        first, second = cut_pieces(lens, at)
        assert len({p.seq for p in first} & {p.seq for p in second}) == 1
    else:
        assert min(at, total - at) >= threshold * total or at == total // 2


@FAST
@given(splittable, thresholds)
def test_the_boundary_split_is_the_most_balanced_one(lens: list[int], threshold: float) -> None:
    total = sum(lens)
    at = split_point(lens, threshold)
    if at == total // 2:
        return  # the fallback (or the best boundary is the half itself)
    boundaries = [sum(lens[:i]) for i in range(1, len(lens))]
    assert at in boundaries
    assert all(abs(2 * at - total) <= abs(2 * b - total) for b in boundaries)
    assert all(b >= at for b in boundaries if abs(2 * b - total) == abs(2 * at - total))


@FAST
@given(st.integers(2, 512), st.integers(0, 256), thresholds)
def test_a_decode_batch_splits_at_half_its_sequences(n: int, min_decode: int, thr: float) -> None:
    split, decision = decide_split([[1] * n], thr, min_decode)
    if n < min_decode:
        assert (split, decision) == (None, "decode_below_threshold")
    else:
        assert (split, decision) == ([n // 2], "split")


@FAST
@given(st.lists(rank_lens, min_size=1, max_size=8), thresholds, st.integers(0, 8))
def test_every_rank_splits_or_none_does(
    per_rank: list[list[int]], threshold: float, min_decode: int
) -> None:
    split, decision = decide_split(per_rank, threshold, min_decode)
    assert decision in TBO_DECISIONS and decision != "cuda_graph"
    alone = [decide_split([lens], threshold, min_decode) for lens in per_rank]
    blocked = [d for lens, (s, d) in zip(per_rank, alone, strict=True) if s is None and lens]
    if blocked:
        assert split is None and decision == blocked[0]  # the first rank that cannot split
        return
    if not any(per_rank):
        assert (split, decision) == (None, "too_few_tokens")
        return
    # ranks with no tokens split at 0 and block nobody; the others split as they do alone
    assert split == [
        s[0] if s and lens else 0 for (s, _), lens in zip(alone, per_rank, strict=True)
    ]
    cut = any(cuts_sequence(lens, at) for lens, at in zip(per_rank, split, strict=True))
    assert decision == ("split_cut" if cut else "split")


def test_hand_computed_splits() -> None:
    thr = 0.48
    assert split_point([4, 4], thr) == 4 and not cuts_sequence([4, 4], 4)
    assert split_point([7, 1], thr) == 4 and cuts_sequence([7, 1], 4)  # 1 of 8 < 0.48
    assert cut_pieces([7, 1], 4) == ([Piece(0, 0, 4)], [Piece(0, 4, 3), Piece(1, 0, 1)])
    assert split_point([9], thr) == 4  # one sequence: no boundary, cut at half
    assert cut_pieces([9], 4) == ([Piece(0, 0, 4)], [Piece(0, 4, 5)])
    assert split_point([3, 4, 3], 0.3) == 3  # |6-10| == |14-10|: the smaller boundary
    assert split_point([6, 1, 3], 0.4) == 6  # 4 of 10 >= 0.4
    assert split_point([6, 1, 3], thr) == 5  # 4 of 10 < 0.48
    assert decide_split([[1] * 10], thr, 8) == ([5], "split")
    assert decide_split([[1] * 10], thr, 64) == (None, "decode_below_threshold")
    assert decide_split([[4, 4]], thr, 64) == ([4], "split")
    assert decide_split([[7, 1]], thr, 64) == ([4], "split_cut")
    assert decide_split([[1, 1, 5]], thr, 64) == ([3], "split_cut")  # mixed: not a decode batch
    assert decide_split([[1]], thr, 0) == (None, "too_few_tokens")
    # attention data-parallel: an empty rank does not block, a one-token rank does
    assert decide_split([[4, 4], [], [9]], thr, 64) == ([4, 0, 4], "split_cut")
    assert decide_split([[4, 4], [1], [1] * 3], thr, 64) == (None, "too_few_tokens")
    assert decide_split([[1] * 3, [1]], thr, 64) == (None, "decode_below_threshold")
    assert decide_split([[], []], thr, 64) == (None, "too_few_tokens")


# -- the leader's decision (Engine.build_plan) --------------------------------------------------


def _leader(
    tp: int, dp_attention: bool = False, graphs: DecodeCudaGraphs | None = None, **flags: object
) -> Engine:
    """An Engine that can build plans and report stats: a real scheduler, a group of `tp` ranks
    as its leader's runner describes it (layout and decode graphs only; no model, no group)."""
    engine = object.__new__(Engine)  # build_plan and stats need nothing else
    engine.args = ServerArgs(  # type: ignore[arg-type]
        tp_size=tp,
        ep_size=tp,
        moe_a2a_backend="alltoall",
        enable_dp_attention=dp_attention,
        **flags,
    )
    engine.runner = SimpleNamespace(layout=Layout(0, tp, tp, dp_attention), cuda_graphs=graphs)  # type: ignore[assignment]
    dp = tp if dp_attention else 1
    engine.scheduler = Scheduler([BlockAllocator(64, 4) for _ in range(dp)], 64, 256, 256)
    engine.step_id, engine.faults, engine.eplb, engine.tbo_steps = 0, Faults(), None, {}
    return engine


def _step(*ranks: list[int]) -> SchedulerOutput:
    """A scheduled step: per attention rank, its sequences' query lengths (1: a decode of a
    request with a 5-token context, else a prefill chunk from position 0)."""
    scheduled = []
    for r, lens in enumerate(ranks):
        for i, n in enumerate(lens):
            prompt = list(range(5 if n == 1 else n))
            req = Request(f"r{r}.{i}", prompt, SamplingParams(max_tokens=4), dp_rank=r)
            if n == 1:  # one token generated, its K/V next
                req.token_ids.append(7)
                req.num_computed = len(prompt)
            req.block_ids = [0, 1, 2, 3]
            scheduled.append(ScheduledRequest(req, n))
    return SchedulerOutput(scheduled)


def _graphs(max_bs: int) -> DecodeCudaGraphs:
    """Decode graphs of buckets up to `max_bs` (the bucket choice needs no device buffers)."""
    graphs = object.__new__(DecodeCudaGraphs)
    graphs.buckets, graphs.max_bs = graph_buckets(max_bs), max_bs
    graphs.block_size, graphs.width = 4, 8
    return graphs


def test_the_leader_splits_steps_and_counts_each_decision() -> None:
    engine = _leader(2, enable_two_batch_overlap=True, tbo_min_decode_batch=4)
    plans = [engine.build_plan(s) for s in (_step([7, 1]), _step([1] * 3), _step([1] * 4))]
    assert [p.split for p in plans] == [[4], None, [2]]
    assert engine.stats().tbo_steps == {"split_cut": 1, "decode_below_threshold": 1, "split": 1}
    engine.build_plan(_step([4, 4]))
    assert engine.stats().tbo_steps["split"] == 2


def test_a_decode_graph_step_runs_whole() -> None:
    engine = _leader(2, graphs=_graphs(8), enable_two_batch_overlap=True, tbo_min_decode_batch=4)
    assert engine.build_plan(_step([1] * 4)).split is None  # a bucket holds it
    assert engine.build_plan(_step([1] * 9)).split == [4]  # past the largest bucket
    assert engine.build_plan(_step([1, 1, 2])).split == [2]  # not a decode step
    assert engine.stats().tbo_steps == {"cuda_graph": 1, "split": 2}
    # attention data-parallel: the bucket comes from every rank's sequences, as the runner's
    engine = _leader(2, True, _graphs(8), enable_two_batch_overlap=True, tbo_min_decode_batch=2)
    assert engine.build_plan(_step([1] * 4, [])).split is None
    assert engine.build_plan(_step([1] * 4, [5])).split == [2, 2]  # rank 1 prefills: no graph
    assert engine.build_plan(_step([1] * 4, [1])).split is None  # a graph, not too_few_tokens
    assert engine.build_plan(_step([1] * 9, [1])).split is None
    assert engine.stats().tbo_steps == {"cuda_graph": 2, "split_cut": 1, "too_few_tokens": 1}


def test_no_split_and_nothing_counted_with_tbo_off_or_one_rank() -> None:
    for engine in (_leader(2), _leader(1, enable_two_batch_overlap=True)):
        assert engine.build_plan(_step([7, 1])).split is None
        assert engine.build_plan(_step([1] * 100)).split is None
        assert engine.stats().tbo_steps == {}


def test_warm_up_steps_are_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up warm-up's steps decide too, but `tbo_steps_total` counts served steps."""
    import safeserve.engine.engine as engine_module

    engine = _leader(2, enable_two_batch_overlap=True, tbo_min_decode_batch=4)
    engine.runner.begin_serving = lambda: None  # type: ignore[attr-defined]
    engine.broadcast_idle = lambda: None  # type: ignore[method-assign]
    monkeypatch.setattr(engine_module, "warm_up", lambda e: e.build_plan(_step([7, 1])))
    engine.warm_up()
    assert engine.stats().tbo_steps == {}
    engine.build_plan(_step([1] * 4))
    assert engine.stats().tbo_steps == {"split": 1}
