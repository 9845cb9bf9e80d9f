from __future__ import annotations

from safeserve.engine.kv_cache import BlockAllocator
from safeserve.engine.request import Request, RequestStatus
from safeserve.engine.scheduler import Scheduler
from safeserve.messages import SamplingParams


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=8))


def _advance(sched: Scheduler) -> list[tuple[str, int]]:
    plan = sched.schedule()
    for s in plan.scheduled:
        if s.samples:
            s.req.token_ids.append(0)
        s.req.num_computed += s.num_tokens
    return [(s.req.rid, s.num_tokens) for s in plan.scheduled]


def test_chunked_prefill_grants_under_budget_fcfs() -> None:
    sched = Scheduler(
        [BlockAllocator(100, 4)],
        max_running_requests=8,
        max_num_batched_tokens=10,
        chunked_prefill_size=6,
    )
    for rid, n in (("a", 13), ("b", 3), ("c", 5)):
        sched.add(_req(rid, n))
    assert _advance(sched) == [("a", 6), ("b", 3), ("c", 1)]
    assert _advance(sched) == [("a", 6), ("b", 1), ("c", 3)]  # b decodes; c's chunk fits the rest
    assert _advance(sched) == [("a", 1), ("b", 1), ("c", 1)]


def test_max_running_requests_caps_admission() -> None:
    sched = Scheduler(
        [BlockAllocator(100, 4)],
        max_running_requests=2,
        max_num_batched_tokens=64,
        chunked_prefill_size=64,
    )
    for rid in "abc":
        sched.add(_req(rid, 4))
    assert [r for r, _ in _advance(sched)] == ["a", "b"]
    assert [r.rid for r in sched.waiting] == ["c"]


def test_preemption_frees_latest_and_requeues_it_first() -> None:
    alloc = BlockAllocator(4, 4)  # 16 token slots in all
    sched = Scheduler(
        [alloc], max_running_requests=8, max_num_batched_tokens=64, chunked_prefill_size=64
    )
    a, b = _req("a", 8), _req("b", 8)
    sched.add(a)
    sched.add(b)
    _advance(sched)  # a and b: 8 prompt tokens in 2 blocks each -> cache full, 1 token sampled each
    assert alloc.num_free == 0
    plan = sched.schedule()  # a's 9th token needs a third block: b gives way
    assert [r.rid for r in plan.preempted] == ["b"]
    assert [s.req.rid for s in plan.scheduled] == ["a"]
    assert b.status is RequestStatus.WAITING and b.num_computed == 0 and b.block_ids == []
    assert sched.waiting[0] is b
    assert len(b.token_ids) == 9  # its generated token is kept and recomputed later


def test_finish_and_abort_return_blocks() -> None:
    alloc = BlockAllocator(10, 4)
    sched = Scheduler(
        [alloc], max_running_requests=8, max_num_batched_tokens=64, chunked_prefill_size=64
    )
    sched.add(_req("a", 9))
    sched.add(_req("b", 2))
    _advance(sched)
    assert alloc.num_used == 4
    sched.abort("a")
    sched.finish(sched.requests["b"], "stop")
    assert alloc.num_used == 0 and not sched.has_work()
