"""Block tables to the other ranks of a group by difference (engine/plan.py, TableSender and
TableReceiver): every rank rebuilds the leader's tables exactly through growth, preemption
(a new table id), finished requests (retired ids) and attention data-parallel plans, a steady
step sends next to nothing, and a lost plan is an error, never a wrong table."""

from __future__ import annotations

import pickle
import random

import pytest

from safeserve.engine.kv_cache import BlockAllocator
from safeserve.engine.plan import (
    SeqPlan,
    StepPlan,
    TableOutOfStep,
    TableReceiver,
    TableSender,
)
from safeserve.engine.request import Request
from safeserve.messages import SamplingParams

BSZ = 4


def _plan(step: int, per_rank: list[list[Request]]) -> StepPlan:
    # as Engine.build_plan: the request's own block list, not a copy
    return StepPlan(
        step,
        [[SeqPlan([1], r.num_computed, r.block_ids, None, 0, r.table_id) for r in reqs]
         for reqs in per_rank],
    )  # fmt: skip


def _send(sender: TableSender, receiver: TableReceiver, plan: StepPlan, retired) -> int:
    """Leader to a follower through pickle; checks the follower's tables; entries sent."""
    wire = sender.wire(plan, retired)
    got = receiver.expand(pickle.loads(pickle.dumps(wire)))
    for mine, theirs in zip(plan.per_rank, got.per_rank, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert b.block_table == a.block_table and b.table_start == 0
    return sum(len(s.block_table) for seqs in wire.per_rank for s in seqs)


def test_followers_rebuild_the_leaders_tables_through_preemption_and_finishing() -> None:
    rng = random.Random(11)
    allocs = [BlockAllocator(4000, BSZ), BlockAllocator(4000, BSZ)]  # two attention ranks
    sender, receiver = TableSender(), TableReceiver()
    running: list[Request] = []
    n = 0
    for step in range(300):
        if len(running) < 12 and rng.random() < 0.3:  # admitted
            req = Request(str(n), [1] * rng.randint(1, 30), SamplingParams())
            req.dp_rank, n = n % 2, n + 1
            allocs[req.dp_rank].allocate(req, req.num_tokens)
            req.num_computed = req.num_tokens
            running.append(req)
        event = rng.random()
        if event < 0.05 and running:  # finished: its blocks and table id go back
            req = running.pop(rng.randrange(len(running)))
            allocs[req.dp_rank].free(req)
        elif event < 0.1 and running:  # preempted, then recomputed: same request, new table
            req = running[rng.randrange(len(running))]
            old = req.table_id
            allocs[req.dp_rank].free(req)
            allocs[req.dp_rank].allocate(req, req.num_tokens)
            assert req.table_id not in (old, -1)
        for req in running:  # one decode token each
            req.token_ids.append(2)
            allocs[req.dp_rank].allocate(req, req.num_tokens)
            req.num_computed = req.num_tokens
        # not every running request is scheduled every step (budgets)
        scheduled = [r for r in running if rng.random() < 0.8]
        plan = _plan(step, [[r for r in scheduled if r.dp_rank == k] for k in (0, 1)])
        retired = [t for a in allocs for t in a.drain_retired()]
        _send(sender, receiver, plan, retired)
        # the follower forgets finished and preempted tables: it holds at most the live ones
        assert receiver.num_tables <= len(running)


def test_a_steady_step_sends_only_new_entries() -> None:
    alloc = BlockAllocator(100_000, BSZ)
    sender, receiver = TableSender(), TableReceiver()
    reqs = []
    for i in range(8):
        req = Request(str(i), [1] * (2000 + i), SamplingParams())  # 500+ blocks each
        alloc.allocate(req, req.num_tokens)
        req.num_computed = req.num_tokens
        reqs.append(req)
    first = _send(sender, receiver, _plan(0, [reqs]), [])
    assert first == sum(len(r.block_ids) for r in reqs)
    sent = []
    for step in range(1, 9):
        for req in reqs:
            req.token_ids.append(2)
            alloc.allocate(req, req.num_tokens)
            req.num_computed += 1
        sent.append(_send(sender, receiver, _plan(step, [reqs]), []))
    # 8 steps of 8 sequences: each crosses one 4-token block boundary exactly twice
    assert sum(sent) == 16 and max(sent) <= 8
    # a table without an id goes whole, every time
    plain = SeqPlan([1], 9, [5, 6, 7], None, 0)
    for step in (10, 11):
        assert _send(sender, receiver, StepPlan(step, [[plain]]), []) == 3


def test_a_lost_plan_is_an_error_not_a_wrong_table() -> None:
    alloc = BlockAllocator(1000, BSZ)
    sender, receiver = TableSender(), TableReceiver()
    req = Request("a", [1] * 7, SamplingParams())
    alloc.allocate(req, 7)
    _send(sender, receiver, _plan(0, [[req]]), [])
    alloc.allocate(req, 12)  # a third block, in a plan the follower never gets
    sender.wire(_plan(1, [[req]]), [])
    alloc.allocate(req, 13)
    with pytest.raises(TableOutOfStep, match="holds 2 entries here"):
        receiver.expand(pickle.loads(pickle.dumps(sender.wire(_plan(2, [[req]]), []))))
