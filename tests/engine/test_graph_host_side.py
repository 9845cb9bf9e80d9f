"""The host side of CUDA-graph steps (engine/cuda_graph.py, engine/piecewise_graph.py), on CPU.

A replay does device work only: the dispatcher's host bookkeeping (admission rounds, cut
dispatches, the busiest rank's share, expert loads for balancedness) is taped at capture and run
after each replay, and must leave every statistic as running the step eagerly would. And every
step size maps to the smallest bucket that holds it."""

from __future__ import annotations

import pytest
import torch
from seeds import seeded

from safeserve.engine.cuda_graph import (
    begin_bucket_step,
    graph_buckets,
    host_tape,
    smallest_bucket,
)
from safeserve.engine.piecewise_graph import piecewise_buckets
from safeserve.guards.admission import DispatchBuffers
from safeserve.moe.dispatch import AllGatherDispatcher, CombineInput, DispatchOutput, StepTokens
from safeserve.moe.eplb.balancedness import layer_balancedness
from safeserve.moe.placement import ExpertPlacement
from safeserve.moe.topk import TopKOutput
from safeserve.parallel.comm import Comm, Layout

HIDDEN, TOKENS, TOP_K, EXPERTS, EP = 8, 5, 2, 8, 2


def _dispatcher(budget: int) -> AllGatherDispatcher:
    # One process: the group's collectives are the identity, the expert split is EP 2's rank 0.
    d = AllGatherDispatcher(ExpertPlacement(EXPERTS, EP, 0), Comm(Layout(), torch.device("cpu")))
    d.buffers = DispatchBuffers.allocate(
        budget, HIDDEN, 4, TOP_K, torch.float32, torch.device("cpu")
    )
    return d


def _experts(d: DispatchOutput) -> CombineInput:
    return CombineInput(d.hidden_states * 2.0)


def _step(d: AllGatherDispatcher, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
    begin_bucket_step(d, TOKENS, 1)  # as both graph kinds begin a captured step
    return d.run(x, topk, _experts)


def _stats(d: AllGatherDispatcher) -> tuple:
    s = d.buffers.stats
    return (
        s.rounds_total,
        s.recv_peak,
        s.dispatches_cut,
        s.buffer_peak_bytes,
        d.step_peak_share,
        d.last_count_matrix.tolist(),
        d.balance.passes,
        d.balance.window_means(),
    )


def test_replayed_tape_records_what_an_eager_step_records() -> None:
    gen = seeded(3)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    topk = TopKOutput(ids, torch.rand(TOKENS, TOP_K, generator=gen), None)
    budget = 2  # 5 tokens: 3 rounds, so the dispatch is cut

    eager = _dispatcher(budget)
    for _ in range(3):
        out = _step(eager, x, topk)
        eager.end_step()
    torch.testing.assert_close(out, x * 2.0)

    taped = _dispatcher(budget)
    with host_tape(taped) as tape:
        _step(taped, x, topk)  # its effects run once now (the capture's own step) ...
    taped.discard_step()
    taped.end_step()
    assert tape, "nothing was taped"
    for _ in range(2):  # ... and again after each replay
        taped.begin_step(StepTokens([TOKENS], replicated=True))
        for effect in tape:
            effect()
        taped.end_step()
    assert _stats(taped)[:6] == _stats(eager)[:6]
    assert taped.buffers.stats.rounds_total == 9 and taped.buffers.stats.dispatches_cut == 3
    # Each recorded pass: this step's per-EP-rank loads, counted on the device (no bincount);
    # the capture's own run recorded none (discarded: a capture computes nothing).
    loads = torch.bincount((ids // (EXPERTS // EP)).reshape(-1), minlength=EP).tolist()
    expected = layer_balancedness(loads)
    assert eager.balance.passes == 3 and eager.balance.window_means()[10] == pytest.approx(expected)
    assert taped.balance.passes == 2 and taped.balance.window_means()[10] == pytest.approx(expected)


def test_graph_buckets_cover_every_size_once() -> None:
    """Every step size up to the largest bucket replays the smallest bucket that holds it."""
    assert piecewise_buckets(2048)[:7] == [16, 32, 64, 128, 256, 384, 512]
    assert piecewise_buckets(2048)[-5:] == [1024, 1280, 1536, 1792, 2048]
    assert piecewise_buckets(100) == [16, 32, 64, 100] and piecewise_buckets(1) == [1]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    for buckets in (piecewise_buckets(1000), graph_buckets(100)):
        assert buckets == sorted(set(buckets))
        for n in range(1, buckets[-1] + 1):
            b = smallest_bucket(buckets, n)
            assert b is not None and b >= n and all(x < n for x in buckets if x < b)
        assert smallest_bucket(buckets, buckets[-1] + 1) is None


def test_every_rank_picks_the_same_decode_bucket_from_the_plan() -> None:
    """With attention data-parallel the MoE's all-gathers inside a decode graph have the
    bucket's size, so every rank must replay the same bucket, including ranks with no
    sequence, or none (a rank replaying while a peer runs eagerly would pair different
    collectives and hang). The bucket comes from the whole plan, which every rank holds."""
    from safeserve.engine.cuda_graph import DecodeCudaGraphs
    from safeserve.engine.plan import SeqPlan

    graphs = object.__new__(DecodeCudaGraphs)  # the choice needs no device buffers
    graphs.buckets, graphs.max_bs, graphs.block_size, graphs.width = graph_buckets(16), 16, 4, 8

    def seqs(n: int, tokens: int = 1, end: int = 10) -> list[SeqPlan]:
        return [SeqPlan([7] * tokens, end - tokens, list(range(8))) for _ in range(n)]

    assert graphs.group_bucket([seqs(3), seqs(0)]) == 4  # the largest rank's count
    assert graphs.group_bucket([seqs(0), seqs(9)]) == 16
    assert graphs.group_bucket([seqs(1)]) == 1  # tensor-parallel attention: one list
    assert graphs.group_bucket([seqs(0), seqs(0)]) is None  # nothing to run
    assert graphs.group_bucket([seqs(2), seqs(17)]) is None  # past the largest bucket
    assert graphs.group_bucket([seqs(2), seqs(1, tokens=3)]) is None  # a prefill chunk
    assert graphs.group_bucket([seqs(1, end=33), seqs(1)]) is None  # past the table width
    assert graphs.group_bucket([seqs(1, end=32), seqs(1)]) == 1
    assert graphs.can_run(seqs(2)) and not graphs.can_run([])


def _upload_step(upload, seqs: list) -> int:
    """One step through `TableUpload.load` (on CPU tensors); checks the rows it hands out and
    returns the entries it copied."""
    fill, copied = upload.mirror.fill, []

    def counted(*args):  # type: ignore[no-untyped-def]
        ranges = fill(*args)
        copied.extend(ranges)
        return ranges

    upload.mirror.fill = counted
    try:
        rows = upload.load(
            [s.end for s in seqs], [s.block_table for s in seqs], [s.table_id for s in seqs]
        )
    finally:
        del upload.mirror.fill
    bounds = [x for r in copied for x in r]
    assert bounds == sorted(bounds) and all(lo < hi for lo, hi in copied), copied  # disjoint
    for i, s in enumerate(seqs):
        w = -(-s.end // upload.mirror.block_size)
        assert rows[i, :w].tolist() == s.block_table[:w], f"row {i}"
    return sum(hi - lo for lo, hi in copied)


def test_decode_tables_upload_what_the_device_lacks_and_nothing_more() -> None:
    """Decode rows' block tables (TableUpload): after every step the device copy holds
    each row's table up to its context, while sequences grow, finish, get preempted (their
    table restarts under a new id, with other blocks) and change rows; a steady step sends
    only new entries, whatever the table width."""
    import random

    from safeserve.engine.kv_cache import new_table_id
    from safeserve.engine.plan import SeqPlan
    from safeserve.layers.block_tables import TableUpload

    bsz, max_bs, width = 4, 8, 64
    device = torch.full((max_bs, width), -7, dtype=torch.int32)  # what a step does not copy
    upload = TableUpload(device, torch.zeros(max_bs * width, dtype=torch.int32), bsz)
    rng = random.Random(5)
    free = list(range(10_000))
    rng.shuffle(free)

    class Seq:
        def __init__(self, ctx: int = 0) -> None:
            self.tid, self.blocks, self.ctx = new_table_id(), [], ctx or rng.randint(1, 40)
            self.grow()

        def grow(self) -> None:
            while len(self.blocks) * bsz < self.ctx:
                self.blocks.append(free.pop())

        def plan(self) -> SeqPlan:
            return SeqPlan([1], self.ctx - 1, self.blocks, None, 0, self.tid)

    running = [Seq() for _ in range(5)]
    for _ in range(400):
        event = rng.random()
        if event < 0.05 and running:  # finishes
            running.pop(rng.randrange(len(running)))
        elif event < 0.08 and running:  # preempted and back: same request, new table and id
            s = running[rng.randrange(len(running))]
            s.tid, s.blocks = new_table_id(), []
            s.grow()
        elif event < 0.12:
            rng.shuffle(running)
        if len(running) < max_bs and rng.random() < 0.1:
            running.append(Seq())
        for s in running:
            if s.ctx < width * bsz:
                s.ctx += 1
                s.grow()
        _upload_step(upload, [s.plan() for s in running])

    # Steady: the same 8 rows, contexts growing by one token a step. A step sends exactly the
    # entries that appeared (none until a table crosses a block), not rows of the table width.
    running = [Seq(9 + 2 * i) for i in range(max_bs)]
    _upload_step(upload, [s.plan() for s in running])
    sends = []
    for _ in range(12):
        before = [len(s.blocks) for s in running]
        for s in running:
            s.ctx += 1
            s.grow()
        sent = _upload_step(upload, [s.plan() for s in running])
        grew = [i for i, s in enumerate(running) if len(s.blocks) > before[i]]
        # one entry per table that grew, plus the entries between them (merged into one copy)
        span = (
            grew[-1] * width + len(running[grew[-1]].blocks) - (grew[0] * width + before[grew[0]])
            if grew
            else 0
        )
        assert (len(grew) <= sent <= span) if grew else sent == 0, (grew, sent, span)
        sends.append(sent)
    assert 0 in sends and max(sends) < max_bs * width
    one = Seq(8)  # alone in row 0: a new block is one entry sent
    assert _upload_step(upload, [one.plan()]) == 2
    for ctx in range(9, 17):
        one.ctx = ctx
        one.grow()
        assert _upload_step(upload, [one.plan()]) == (1 if ctx in (9, 13) else 0)
    # A table without an id (-1) is always written whole.
    plain = SeqPlan([1], 20, list(range(100, 106)), None, 0)
    _upload_step(upload, [plain])
    assert _upload_step(upload, [plain]) == 6


def test_eager_decode_tables_are_as_wide_as_the_longest_context() -> None:
    """Eager decode rows get a view of the upload's rows only as wide as the longest context
    (the decode grid's splits follow the width), not --max-model-len's full width; the rows keep
    their stride and hold each table up to its context."""
    from safeserve.engine.kv_cache import new_table_id
    from safeserve.layers.block_tables import TableUpload
    from safeserve.layers.paged_attention import AttentionMetadata

    bsz = 16
    upload = TableUpload.allocate(
        rows=8, max_model_len=40_960, block_size=bsz, device=torch.device("cpu")
    )
    ctxs = [17, 300, 5]
    tables = [list(range(100 * i, 100 * i + -(-c // bsz))) for i, c in enumerate(ctxs)]
    ids = [new_table_id() for _ in ctxs]
    for step in range(2):  # the second step finds the entries already there
        meta = AttentionMetadata.build_decode(ctxs, tables, bsz, "cpu", ids, upload)
        bt = meta.block_tables
        assert bt.shape == (3, -(-300 // bsz)), (step, bt.shape)
        assert bt.stride(0) == 40_960 // bsz  # a view of the upload's rows, not a copy
        for row, table, c in zip(bt.tolist(), tables, ctxs, strict=True):
            assert row[: -(-c // bsz)] == table
    # rows that do not fit the upload are built whole, as wide as the longest context
    many = [7] * 9
    meta = AttentionMetadata.build_decode(
        many, [[i] for i in range(9)], bsz, "cpu", [new_table_id() for _ in many], upload
    )
    assert meta.block_tables.shape == (9, 1) and meta.block_tables.is_contiguous()
