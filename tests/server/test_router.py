"""The router's placement: the READY group with the most headroom (free decode slots and KV
cache) gets a new request, a burst between stats reports still spreads, ties take turns,
no group that is not READY is ever picked; and a request still waiting moves once to a group
that just became READY, never duplicated or lost."""

from __future__ import annotations

import asyncio

import pytest

from safeserve.config import ServerArgs
from safeserve.messages import EngineStats, RequestOutput, SamplingParams
from safeserve.server.metrics import Metrics
from safeserve.server.router import GroupRouter, NoGroupReady, score
from safeserve.server.supervisor import Supervisor, SupervisorState

MAX_RUNNING = 4


class _Client:
    """A group incarnation as the frontend sees it: queues per engine request id, stats."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats = EngineStats()
        self.ready = True
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.node_lost = False

    def submit(self, rid: str, prompt: list[int], params: SamplingParams) -> asyncio.Queue:
        self.queues[rid] = q = asyncio.Queue()
        self.submitted.append(rid)
        return q

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self.queues.pop(rid, None)

    def release(self, rid: str) -> None:
        self.queues.pop(rid, None)

    def out(self, rid: str, ids: list[int], finish: str | None = None) -> None:
        """What the group's output reader does: deliver to the queue if it is still there."""
        q = self.queues.get(rid)
        if q is not None:
            q.put_nowait(RequestOutput(rid, ids, finish, 2, len(ids)))
            if finish is not None:
                self.queues.pop(rid, None)


def _sups(n: int, metrics: Metrics | None = None) -> list[Supervisor]:
    args = ServerArgs(num_groups=n, max_running_requests=MAX_RUNNING)
    sups = []
    for g in range(n):
        s = Supervisor(args, g, metrics or Metrics())
        s.state, s.client = SupervisorState.READY, _Client()  # type: ignore[assignment]
        sups.append(s)
    return sups


def _stats(running: int, waiting: int = 0, used: int = 0, total: int = 100) -> EngineStats:
    return EngineStats(
        num_running=running, num_waiting=waiting, kv_blocks_used=used, kv_blocks_total=total
    )


def test_score_is_the_scarcer_of_free_slots_and_kv_headroom() -> None:
    idle = score(0, EngineStats(), 0, MAX_RUNNING)  # before any report: all headroom
    assert (idle.slot_headroom, idle.kv_headroom, idle.headroom) == (1.0, 1.0, 1.0)
    half = score(0, _stats(2, used=20), 2, MAX_RUNNING)
    assert half.slot_headroom == 0.5 and half.kv_headroom == pytest.approx(0.8)
    assert half.headroom == 0.5
    # KV is the scarcer: 3 running hold 90 of 100 blocks
    full_kv = score(0, _stats(3, used=90), 3, MAX_RUNNING)
    assert full_kv.headroom == pytest.approx(0.1)
    # queued beyond the slots: negative, and worse the longer the queue
    queued = score(0, _stats(4, waiting=2, used=40), 6, MAX_RUNNING)
    assert queued.slot_headroom == -0.5 and queued.waiting == 2
    # waiting and unreported requests count at the running ones' mean blocks (10 each)
    assert queued.kv_headroom == pytest.approx(1 - (40 + 2 * 10) / 100)
    # the frontend's count covers what it sent since the last report
    burst = score(0, _stats(1, used=10), 3, MAX_RUNNING)
    assert burst.occupied == 3 and burst.waiting == 2 and burst.slot_headroom == 0.25


def test_more_free_slots_or_kv_headroom_wins_and_ties_take_turns() -> None:
    metrics = Metrics()
    s0, s1, s2 = _sups(3, metrics)
    router = GroupRouter([s0, s1, s2], metrics)
    # all idle (every request ends before the next): the groups take turns, lowest id first
    assert [router.pick().group for _ in range(4)] == [0, 1, 2, 0]
    s0.client.stats = _stats(3, used=30)  # type: ignore[union-attr]
    s1.client.stats = _stats(1, used=10)  # type: ignore[union-attr]
    s2.client.stats = _stats(2, used=20)  # type: ignore[union-attr]
    assert router.pick() is s1  # most free slots
    # same slots, less KV free: group 1's requests hold long contexts
    s1.client.stats = _stats(2, used=80)  # type: ignore[union-attr]
    assert router.pick() is s2
    # equal scores (groups 1 and 2; group 0 busier): they take turns, 2 picked last
    s1.client.stats = _stats(2, used=20)  # type: ignore[union-attr]
    assert [router.pick().group for _ in range(4)] == [1, 2, 1, 2]
    value = metrics.registry.get_sample_value
    assert value("safeserve:router_picks_total", {"group": "0", "reason": "new"}) == 2
    assert value("safeserve:router_picks_total", {"group": "1", "reason": "new"}) == 4
    assert value("safeserve:router_picks_total", {"group": "2", "reason": "new"}) == 4


def test_a_burst_between_stats_reports_spreads_over_the_groups() -> None:
    s0, s1 = _sups(2)
    router = GroupRouter([s0, s1])
    picks = []
    for i in range(8):  # no stats report comes during the burst
        sup = router.pick()
        sup.client.submit(f"r{i}", [1], SamplingParams())  # type: ignore[union-attr]
        picks.append(sup.group)
    assert picks == [0, 1] * 4


@pytest.mark.parametrize(
    "state",
    [
        SupervisorState.STARTING,
        SupervisorState.FAILED,
        SupervisorState.RESTARTING,
        SupervisorState.DRAINING,
        SupervisorState.DRAINED,
    ],
)
def test_a_group_that_is_not_ready_is_never_picked(state: SupervisorState) -> None:
    s0, s1 = _sups(2)
    s1.client.stats = _stats(4, waiting=10, used=99)  # type: ignore[union-attr]
    s0.state = state  # idle, but not serving
    router = GroupRouter([s0, s1])
    assert all(router.pick() is s1 for _ in range(3))
    s1.state = SupervisorState.FAILED
    with pytest.raises(NoGroupReady):
        router.pick()
    # READY but its incarnation is being fenced: not picked either
    s0.state = s1.state = SupervisorState.READY
    s0.client.ready = False  # type: ignore[union-attr]
    assert router.pick() is s1
    assert router.pick(exclude=1) is s1  # the only one left, even when excluded
    with pytest.raises(NoGroupReady):
        router.pick(avoid={1})


def _generator(sups: list[Supervisor], metrics: Metrics, **flags: int):  # type: ignore[no-untyped-def]
    from safeserve.model.tokenizer import load_tokenizer
    from safeserve.server.generate import Generator

    router = GroupRouter(sups, metrics)
    args = ServerArgs(num_groups=len(sups), max_running_requests=MAX_RUNNING, **flags)
    return Generator(args, load_tokenizer("tiny"), router, metrics, "tiny")


def test_requests_beyond_the_queue_cap_get_503_and_nothing_is_sent() -> None:
    """--max-queued-requests 3 over two READY groups of 4 slots: 8 requests take the slots, 3
    more wait, the next is refused (503, Retry-After, counted) without reaching a group; once a
    group reports a slot taken up by a waiting one, a new request is admitted again."""
    from safeserve.server.errors import APIError

    async def run() -> None:
        metrics = Metrics()
        s0, s1 = _sups(2, metrics)
        c0, c1 = s0.client, s1.client
        gen = _generator([s0, s1], metrics, max_queued_requests=3)
        gen.router.notify()
        params = SamplingParams(max_tokens=3, temperature=0.0)
        reqs = [gen.start(f"r{i}", [10 + i], params, []) for i in range(11)]
        c0.stats = _stats(MAX_RUNNING, waiting=len(c0.queues) - MAX_RUNNING)
        c1.stats = _stats(MAX_RUNNING, waiting=len(c1.queues) - MAX_RUNNING)
        sent = c0.submitted + c1.submitted
        with pytest.raises(APIError) as refused:
            gen.start("r11", [21], params, [])
        assert refused.value.status == 503 and refused.value.retry_after
        assert "--max-queued-requests 3" in refused.value.message
        assert c0.submitted + c1.submitted == sent and "r11" not in gen.active
        shed = metrics.registry.get_sample_value("safeserve:requests_shed_total")
        assert shed == 1
        # a running request ends on group 0 and a waiting one takes its slot: room again
        c0.out(reqs[0].rid, [1], "stop")
        c0.stats = _stats(MAX_RUNNING, waiting=len(c0.queues) - MAX_RUNNING)
        assert gen.start("r12", [22], params, []).supervisor in (s0, s1)
        for r in reqs:
            r.close()

    asyncio.run(run())


async def _collect(g) -> list[int]:  # type: ignore[no-untyped-def]
    ids: list[int] = []
    try:
        async for d in g.deltas():
            ids.extend(d.token_ids)
    finally:
        g.close()
    return ids


def test_waiting_requests_move_once_to_a_group_that_became_ready() -> None:
    async def run() -> None:
        metrics = Metrics()
        s0, s1 = _sups(2, metrics)
        c0, c1 = s0.client, s1.client
        s1.state = SupervisorState.RESTARTING
        gen = _generator([s0, s1], metrics)
        gen.router.notify()  # group 0 seen READY
        params = SamplingParams(max_tokens=3, temperature=0.0)
        reqs = [gen.start(f"r{i}", [10 + i], params, []) for i in range(7)]
        assert all(r.supervisor is s0 for r in reqs)
        tasks = [asyncio.create_task(_collect(r)) for r in reqs]
        await asyncio.sleep(0)
        c0.stats = _stats(MAX_RUNNING, waiting=2, used=8)  # r4, r5 queued; r6 unreported
        c0.out("r0", [1])  # r0 has a token: it stays whatever happens
        await asyncio.sleep(0.01)
        c0.out("r1", [1])  # r1's token is still in its queue, unread: it stays too
        s1.state = SupervisorState.READY
        gen.router.notify()  # group 1 is READY again
        # 7 occupied vs 0, 3 of them waiting: the newest 3 move (7-3=4 >= 3+1)
        moved = [r.rid for r in reqs if r.supervisor is s1]
        assert moved == ["r4", "r5", "r6"]
        assert c0.aborted == ["r6", "r5", "r4"] and c1.submitted == ["r6.m1", "r5.m1", "r4.m1"]
        assert set(c0.queues) == {"r0", "r1", "r2", "r3"}
        # the old group produced a token for r6 before it read the abort: nobody gets it
        c0.out("r6", [99])
        # a second READY event (group 0's next report: its 4 running) moves nothing
        c0.stats = _stats(MAX_RUNNING, used=8)
        s1.state = SupervisorState.STARTING
        gen.router.notify()
        s1.state = SupervisorState.READY
        gen.router.notify()
        assert c1.submitted == ["r6.m1", "r5.m1", "r4.m1"]
        for i in range(7):
            rid = f"r{i}.m1" if i >= 4 else f"r{i}"
            client = c1 if i >= 4 else c0
            client.out(rid, [1, 2] if i < 2 else [1, 2, 3], "length")
        done = await asyncio.gather(*tasks)
        assert done == [[1, 1, 2]] * 2 + [[1, 2, 3]] * 5  # every token once, none from r6's old run
        value = metrics.registry.get_sample_value
        assert value("safeserve:router_picks_total", {"group": "1", "reason": "moved"}) == 3
        assert value("safeserve:router_picks_total", {"group": "0", "reason": "new"}) == 7
        assert not gen.active and not c0.queues and not c1.queues

    asyncio.run(run())


def test_nothing_moves_when_the_source_has_no_waiting_request() -> None:
    async def run() -> None:
        metrics = Metrics()
        s0, s1 = _sups(2, metrics)
        s1.state = SupervisorState.FAILED
        gen = _generator([s0, s1], metrics)
        gen.router.notify()
        params = SamplingParams(max_tokens=2, temperature=0.0)
        reqs = [gen.start(f"r{i}", [10 + i], params, []) for i in range(3)]
        s0.client.stats = _stats(3, used=6)  # type: ignore[union-attr]  # all three running
        s1.state = SupervisorState.READY
        gen.router.notify()
        assert all(r.supervisor is s0 for r in reqs)
        assert gen.router.pick() is s1  # new work goes to the idle group
        for r in reqs:
            r.close()

    asyncio.run(run())


def test_waiting_streams_move_to_an_undrained_group_over_http(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A real server, two one-rank groups, one decode slot each: with group 0 drained, six
    streams go to group 1 (one runs, five wait); undraining group 0 moves waiting ones to it.
    Each answer names the group that served it, every output equals the one it gets alone, and
    the moves are counted. A waiting stream whose client leaves is dropped (499)."""
    import time

    import httpx
    from serving import admin_groups, metric, sse_chunk

    s = server_factory(
        ["--num-groups", "2", "--max-model-len", "1024", "--max-running-requests", "1"]
    )
    prompts = [[20 + 7 * i + j for j in range(8)] for i in range(6)]

    def body(p: list[int], stream: bool) -> dict:
        return {
            "model": "tiny",
            "prompt": p,
            "max_tokens": 48,  # the running stream outlasts the other five's arrival
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }

    ref = []
    for p in prompts:
        r = httpx.post(s.url + "/v1/completions", json=body(p, False), timeout=120)
        assert r.status_code == 200 and r.headers["x-safeserve-group"] in ("0", "1")
        ref.append(r.json()["choices"][0]["token_ids"])
    assert httpx.post(s.admin_url + "/admin/groups/0/drain").status_code == 200
    deadline = time.monotonic() + 30
    while httpx.get(s.admin_url + "/admin/groups").json()["groups"][0]["state"] != "DRAINED":
        assert time.monotonic() < deadline
        time.sleep(0.1)

    async def one(c: httpx.AsyncClient, p: list[int]) -> tuple[str, list[int], list]:
        ids: list[int] = []
        errors: list = []
        async with c.stream("POST", s.url + "/v1/completions", json=body(p, True)) as r:
            assert r.status_code == 200
            group = r.headers["x-safeserve-group"]
            async for line in r.aiter_lines():
                chunk = sse_chunk(line, errors)
                if chunk is not None:
                    ids.extend(chunk["choices"][0].get("token_ids") or [])
        return group, ids, errors

    async def run() -> list[tuple[str, list[int], list]]:
        async with httpx.AsyncClient(timeout=120) as c:
            tasks = [asyncio.create_task(one(c, p)) for p in prompts]
            deadline = time.monotonic() + 30
            while True:  # all six held by group 1 (in flight at the frontend)
                g1 = (await c.get(s.admin_url + "/admin/groups")).json()["groups"][1]
                if g1["in_flight"] == len(prompts):
                    break
                assert time.monotonic() < deadline, g1  # e.g. one finished before all came
                await asyncio.sleep(0.02)
            r = await c.post(s.admin_url + "/admin/groups/0/undrain")
            assert r.status_code == 200 and r.json()["state"] == "READY"
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert [ids for _, ids, _ in results] == ref  # nothing lost, nothing repeated
    assert all(not errors for _, _, errors in results)
    groups = [g for g, _, _ in results]
    moved = metric(s, 'safeserve:router_picks_total{group="0",reason="moved"}')
    assert 1 <= moved <= 5 and groups.count("0") == moved  # only moved streams name group 0
    assert metric(s, 'safeserve:router_picks_total{group="1",reason="new"}') >= len(prompts)
    assert metric(s, "safeserve:requests_lost_total") == 0
    # A stream whose client goes away while it waits (no token, so no headers yet) is dropped
    # from its group and answered 499; the running ones are not touched.
    # long enough to hold both slots well past the waiting request's 1 s read timeout (a rank
    # of the tiny model makes a few hundred tokens a second here)
    long = body(prompts[0], True) | {"max_tokens": 1000}
    closed = 'safeserve:requests_total{endpoint="/v1/completions",status="499"}'
    before = metric(s, closed)
    with httpx.Client(timeout=120) as c:
        with (
            c.stream("POST", s.url + "/v1/completions", json=long) as a,
            c.stream("POST", s.url + "/v1/completions", json=long) as b,
        ):
            assert {a.headers["x-safeserve-group"], b.headers["x-safeserve-group"]} == {"0", "1"}
            with pytest.raises(httpx.ReadTimeout):
                c.post(s.url + "/v1/completions", json=long, timeout=httpx.Timeout(120, read=1.0))
            deadline = time.monotonic() + 10
            while sum(g["in_flight"] for g in admin_groups(s)) != 2:
                assert time.monotonic() < deadline, admin_groups(s)
                time.sleep(0.05)
            assert metric(s, closed) == before + 1
    deadline = time.monotonic() + 10
    while sum(g["in_flight"] for g in admin_groups(s)) != 0:
        assert time.monotonic() < deadline, admin_groups(s)
        time.sleep(0.05)
