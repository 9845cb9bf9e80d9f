"""The query of death: a request that crashes whichever group runs it costs at most two groups,
is quarantined, and identical requests are refused at admission; every other request finishes.

The policy object alone, the frontend's generation logic against fake groups, and real servers
(two groups of two ranks): a SIGKILLed group's requests become suspects that finish elsewhere,
and a request-borne hard exit (`safeserve_fault: "exit"`) that is quarantined after two groups.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving import Server, metric, oncall, sse_chunk, start_server, stop_server, two_groups

from safeserve.config import ServerArgs
from safeserve.guards.quarantine import QueryOfDeath, fingerprint
from safeserve.messages import EngineStats, RequestOutput, SamplingParams
from safeserve.server.errors import APIError
from safeserve.server.group_client import GroupUnavailable

ROOT = Path(__file__).resolve().parents[2]


# -- the policy ---------------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_suspect_then_quarantine_then_refused_until_it_expires() -> None:
    clock = _Clock()
    q = QueryOfDeath(60.0, clock=clock)
    assert q.group_failed("a", "fpA", 0) is None  # first failure: a suspect
    assert q.group_failed("b", "fpB", 0) is None
    assert q.suspect_groups() == set()  # both wait for a group
    q.place("a", 1)
    assert q.suspect_groups() == {1}
    assert q.refusal("fpA") is None  # a suspect is not refused
    got = q.group_failed("a", "fpA", 1)  # in flight on the second group that failed
    assert got is not None and got.groups == (0, 1) and got.rid == "a"
    assert "a" not in q.suspects and q.suspect_groups() == set()
    assert q.refusal("fpA") is got and got.refused == 1
    assert q.remaining_s(got) == 60.0
    assert q.clear("b") and not q.clear("b") and not q.clear("a")  # b completed: cleared once
    view = q.view()
    assert view["suspects"] == [] and [x["fingerprint"] for x in view["quarantined"]] == ["fpA"]
    clock.t += 60.0
    assert q.refusal("fpA") is None and q.held() == []  # expired
    assert [x["fingerprint"] for x in q.view()["recent"]] == ["fpA"]  # kept for the operator


def test_a_suspect_past_its_probation_frees_its_group_and_is_not_quarantined() -> None:
    q = QueryOfDeath(60.0, clock=_Clock())
    q.group_failed("a", "fpA", 0)
    q.place("a", 1)
    assert q.suspect_groups() == {1}  # on probation: group 1 takes no other suspect
    assert q.first_token("a") and not q.first_token("a")  # its first token there, once
    assert not q.first_token("nobody")
    assert q.suspect_groups() == set() and "a" in q.suspects  # a suspect still, group free
    # group 1 fails after a's first token there: a is a suspect of that failure, not quarantined
    assert q.group_failed("a", "fpA", 1) is None
    assert q.suspects["a"].failed_group == 1 and q.suspects["a"].group is None
    q.place("a", 0)
    got = q.group_failed("a", "fpA", 0)  # on probation on group 0 when it failed: quarantined
    assert got is not None and got.groups == (1, 0)


def test_quarantine_table_is_bounded_and_lifted() -> None:
    q = QueryOfDeath(600.0, max_fingerprints=3, clock=_Clock())

    def twice(i: int) -> None:  # a suspect, then on probation on group 1 when it fails
        q.group_failed(f"r{i}", f"fp{i}", 0)
        q.place(f"r{i}", 1)
        q.group_failed(f"r{i}", f"fp{i}", 1)

    for i in range(5):
        twice(i)
    assert [x.fingerprint for x in q.held()] == ["fp2", "fp3", "fp4"]  # oldest evicted
    assert q.refusal("fp2") is not None  # a refusal keeps it: now the newest
    twice(9)
    assert [x.fingerprint for x in q.held()] == ["fp4", "fp2", "fp9"]
    assert [x.fingerprint for x in q.lift("fp4", dry_run=True)] == ["fp4"]
    assert len(q.held()) == 3  # a dry run lifts nothing
    assert [x.fingerprint for x in q.lift("fp4")] == ["fp4"] and q.lift("fp4") == []
    assert len(q.lift()) == 2 and q.held() == []


def test_fingerprint_covers_the_prompt_and_every_sampling_parameter() -> None:
    base = fingerprint([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0))
    assert base == fingerprint([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0))
    assert base != fingerprint([1, 2, 4], SamplingParams(max_tokens=8, temperature=0.0))
    assert base != fingerprint([1, 2, 3], SamplingParams(max_tokens=9, temperature=0.0))
    faulty = SamplingParams(max_tokens=8, temperature=0.0, fault="exit")
    assert base != fingerprint([1, 2, 3], faulty)


# -- the frontend's logic, against fake groups --------------------------------------------------
class _Client:
    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.submitted: list[tuple[str, list[int]]] = []
        self.stats = EngineStats()
        self.node_lost = False  # failed because a node agent running its ranks was lost
        self.refusing = False  # its leader takes nothing (it died; the watchdog has not seen it)

    def submit(self, rid: str, prompt: list[int], params: SamplingParams) -> asyncio.Queue:
        if self.refusing:
            raise GroupUnavailable("the leader could not take the request: Resource unavailable")
        self.queues[rid] = q = asyncio.Queue()
        self.submitted.append((rid, list(prompt)))
        return q

    def abort(self, rid: str) -> None:
        self.queues.pop(rid, None)

    release = abort

    def out(self, rid: str, ids: list[int], finish: str | None = None, **kw: object) -> None:
        self.queues[rid].put_nowait(RequestOutput(rid, ids, finish, **kw))  # type: ignore[arg-type]


class _Group:
    def __init__(self, group: int) -> None:
        self.group, self.up, self.client = group, True, _Client()
        self.args = ServerArgs(num_groups=2)

    @property
    def ready(self) -> bool:
        return self.up

    @property
    def load(self) -> int:
        return len(self.client.queues)

    def fail(self, router, node_lost: bool = False) -> None:  # type: ignore[no-untyped-def]
        self.up = False
        self.client.node_lost = node_lost
        for rid, q in self.client.queues.items():
            q.put_nowait(RequestOutput(rid, [], "group_failed"))
        self.client = _Client()  # the next incarnation
        router.notify()


def _generator(quarantine_s: float = 600.0, wait_s: float = 5.0):  # type: ignore[no-untyped-def]
    from safeserve.model.tokenizer import load_tokenizer
    from safeserve.server.generate import Generator
    from safeserve.server.metrics import Metrics
    from safeserve.server.router import GroupRouter

    groups = [_Group(0), _Group(1)]
    router = GroupRouter(groups)  # type: ignore[arg-type]
    args = ServerArgs(num_groups=2, quarantine_s=quarantine_s, migration_wait_s=wait_s)
    return Generator(args, load_tokenizer("tiny"), router, Metrics(), "tiny"), groups


async def _drain(g) -> tuple[list[int], APIError | None]:  # type: ignore[no-untyped-def]
    ids: list[int] = []
    try:
        async for d in g.deltas():
            ids.extend(d.token_ids)
    except APIError as e:
        return ids, e
    finally:
        g.close()
    return ids, None


def _sample(gen, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    return gen.metrics.registry.get_sample_value("safeserve:" + name, labels or None) or 0.0


async def _until(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


_PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


async def _in_flight_on_group_0(gen, g0, g1, firsts: dict[str, int]) -> list:  # type: ignore[no-untyped-def]
    """Requests `firsts` (id -> its first token) started on group 0 (group 1 down meanwhile),
    each with its first token out, group 1 up again; their drain tasks, in order."""
    g1.up = False
    reqs = [gen.start(rid, [10 + 10 * i, 11 + 10 * i], _PARAMS, []) for i, rid in enumerate(firsts)]
    assert all(r.supervisor is g0 for r in reqs)
    g1.up = True
    tasks = [asyncio.create_task(_drain(r)) for r in reqs]
    for rid, first in firsts.items():
        g0.client.out(rid, [first])
    await asyncio.sleep(0.05)
    return tasks


def test_a_lost_node_makes_no_suspects_and_its_requests_move_on_together() -> None:
    async def run() -> None:
        gen, (g0, g1) = _generator()
        ta, tb = await _in_flight_on_group_0(gen, g0, g1, {"a": 5, "b": 6})
        g0.fail(gen.router, node_lost=True)  # its node agent was lost: the host, not a request
        # both continue on group 1 at once (a suspect would wait for a group free of others)
        await _until(lambda: len(g1.client.queues) == 2)
        assert _sample(gen, "requests_suspect") == 0
        assert gen.qod.suspects == {}
        for rid, first in (("a", 5), ("b", 6)):
            assert [p for r, p in g1.client.submitted if r == rid][-1][-1] == first
            g1.client.out(rid, [7, 8, 9], "length")
        assert await ta == ([5, 7, 8, 9], None) and await tb == ([6, 7, 8, 9], None)
        assert _sample(gen, "request_migrations_total") == 2
        assert _sample(gen, "requests_suspect_cleared_total") == 0

    asyncio.run(run())


def test_a_suspect_whose_next_group_loses_its_node_stays_a_suspect_not_quarantined() -> None:
    async def run() -> None:
        gen, (g0, g1) = _generator()
        (ta,) = await _in_flight_on_group_0(gen, g0, g1, {"a": 5})
        g0.fail(gen.router)  # a crash: a is a suspect, continued on group 1
        await _until(lambda: len(g1.client.queues) == 1)
        assert gen.qod.suspects["a"].group == 1
        g0.up = True
        g1.fail(gen.router, node_lost=True)  # then group 1's node is lost: not a's doing
        await _until(lambda: len(g0.client.queues) == 1)
        assert gen.qod.suspects["a"].group == 0 and gen.qod.held() == []
        g0.client.out("a", [7, 8, 9], "length")
        assert await ta == ([5, 7, 8, 9], None)
        assert _sample(gen, "requests_quarantined_total") == 0
        assert _sample(gen, "requests_suspect_cleared_total") == 1

    asyncio.run(run())


def test_one_suspect_per_group_quarantine_on_the_second_failure_and_refusal() -> None:
    async def run() -> None:
        gen, (g0, g1) = _generator()
        params = _PARAMS
        ta, tb = await _in_flight_on_group_0(gen, g0, g1, {"a": 5, "b": 6})
        g0.fail(gen.router)  # both in flight: both suspects; one goes to group 1, one waits
        await _until(lambda: len(gen.qod.suspects) == 2 and gen.qod.suspect_groups() == {1})
        await asyncio.sleep(0.1)
        assert len(g1.client.queues) == 1  # the other waits: group 1 holds a suspect
        assert _sample(gen, "requests_suspect") == 2
        g0.up = True  # group 0 restarted: it holds none
        gen.router.notify()
        await _until(lambda: gen.qod.suspect_groups() == {0, 1})
        on1 = next(iter(g1.client.queues))
        on0 = next(iter(g0.client.queues))
        assert [p for r, p in g1.client.submitted if r == on1][-1][-1] in (5, 6)  # continuation
        g1.fail(gen.router)  # the suspect on group 1 crashed a second group: quarantined
        g0.client.out(on0, [7, 8, 9], "length")
        (ids_a, err_a), (ids_b, err_b) = await asyncio.gather(ta, tb)
        res = {"a": (ids_a, err_a), "b": (ids_b, err_b)}
        ids, err = res[on1]
        assert err is not None and (err.status, err.code) == (422, "request_quarantined")
        assert "group 0 and then on group 1" in err.message
        assert res[on0][1] is None and res[on0][0][-3:] == [7, 8, 9]
        assert _sample(gen, "requests_quarantined_total") == 1
        assert _sample(gen, "requests_suspect_cleared_total") == 1
        assert _sample(gen, "requests_suspect") == 0
        assert _sample(gen, "quarantine_fingerprints") == 1
        g1.up = True
        same = {"a": ([10, 11], params), "b": ([20, 21], params)}[on1]
        with pytest.raises(APIError) as refused:
            gen.start("again", *same, [])
        e = refused.value
        assert (e.status, e.code) == (422, "request_quarantined") and e.retry_after >= 599
        assert _sample(gen, "quarantine_refusals_total") == 1
        assert gen.start("other", [30], params, []) is not None  # anything else is admitted

    asyncio.run(run())


def test_an_engine_error_ends_that_request_only_and_is_not_retried() -> None:
    async def run() -> None:
        gen, groups = _generator()
        g = gen.start("e", [1, 2], SamplingParams(max_tokens=4), [])
        sup = g.supervisor
        task = asyncio.create_task(_drain(g))
        sup.client.out("e", [3])
        sup.client.out("e", [], "error", error="ValueError: bad prompt")
        ids, err = await task
        assert ids == [3] and err is not None
        assert (err.status, err.code) == (500, "internal_error")
        assert err.message == "internal error in this request: ValueError: bad prompt"
        assert sum(len(x.client.submitted) for x in groups) == 1  # never resubmitted
        g2 = gen.start("f", [1, 2], SamplingParams(max_tokens=4), [])
        t2 = asyncio.create_task(_drain(g2))
        g2.supervisor.client.out("f", [], "error")
        _, err = await t2
        assert err is not None and "gave no reason" in err.message

    asyncio.run(run())


def test_a_suspect_waits_at_most_migration_wait_s_then_503() -> None:
    async def run() -> None:
        gen, (g0, g1) = _generator(wait_s=0.3)
        g = gen.start("w", [1], SamplingParams(max_tokens=4), [])
        g1.up = False
        task = asyncio.create_task(_drain(g))
        g.supervisor.fail(gen.router)
        _, err = await task
        assert err is not None and err.status == 503 and "free of other suspects" in err.message
        assert gen.qod.suspects == {}  # ended cleanly: cleared

    asyncio.run(run())


def test_with_quarantine_off_requests_migrate_as_before() -> None:
    async def run() -> None:
        gen, (g0, g1) = _generator(quarantine_s=0)
        g = gen.start("m", [1], SamplingParams(max_tokens=4), [])
        task = asyncio.create_task(_drain(g))
        for _ in range(2):  # fails twice, continues twice (3 attempts)
            sup = g.supervisor
            await _until(lambda sup=sup: "m" in sup.client.queues)
            sup.client.out("m", [4])
            await asyncio.sleep(0.02)
            sup.fail(gen.router)
            sup.up = True
            await _until(lambda sup=sup: g.supervisor is not sup)
        await _until(lambda: "m" in g.supervisor.client.queues)
        g.supervisor.client.out("m", [5, 6], "length")
        ids, err = await task
        assert err is None and ids == [4, 4, 5, 6] and not gen.qod.suspects

    asyncio.run(run())


# -- real servers -------------------------------------------------------------------------------
def _groups(s: Server) -> dict[int, dict]:
    return {g["id"]: g for g in httpx.get(s.admin_url + "/admin/groups").json()["groups"]}


def _wait_ready(s: Server, groups=(0, 1), timeout: float = 90.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not all(_groups(s)[g]["state"] == "READY" for g in groups):
        assert time.monotonic() < deadline, _groups(s)
        time.sleep(0.2)


def _body(i: int, tokens: int, stream: bool, **extra: object) -> dict:
    prompt = [40 + (13 * i + j) % 150 for j in range(12)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0}
    return body | {"ignore_eos": True, "return_token_ids": True, "stream": stream, **extra}


async def _stream(c: httpx.AsyncClient, url: str, body: dict, out: dict) -> None:
    out.update(ids=[], errors=[], chunks=0)
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        out["status"], out["group"] = r.status_code, r.headers.get("x-safeserve-group")
        async for line in r.aiter_lines():
            chunk = sse_chunk(line, out["errors"])
            if chunk is None:
                continue
            out["ids"].extend(chunk["choices"][0].get("token_ids") or [])
            out["chunks"] += 1


class _Watch(threading.Thread):
    """Polls /health and /admin/groups until stopped: the worst moments it saw."""

    def __init__(self, s: Server) -> None:
        super().__init__(daemon=True)
        self.s, self.stop, self.bad, self.max_on_probation = s, threading.Event(), [], 0

    def run(self) -> None:
        while not self.stop.is_set():
            health = httpx.get(self.s.url + "/health", timeout=5).status_code
            groups = _groups(self.s).values()
            # READY, or on its way back (FAILED waiting for its restart, not a crash loop)
            if health != 200 or all(g["crash_loop"] for g in groups):
                self.bad.append((health, [(g["state"], g["crash_loop"]) for g in groups]))
            on_probation = (sum(x["probation"] for x in g["suspects"]) for g in groups)
            self.max_on_probation = max([self.max_on_probation, *on_probation])
            time.sleep(0.1)


@pytest.fixture(scope="module")
def slow_restart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two groups; a failed group waits 30 s before it restarts (an operator restarts it); a
    migrating request waits at most 3 s for a group."""
    log = tmp_path_factory.mktemp("qod") / "server.log"
    args = ["--max-model-len", "512", "--restart-backoff-s", "30", "--migration-wait-s", "3"]
    s = start_server(two_groups(*args), log)
    yield s
    stop_server(s.proc)


def test_sigkilled_group_its_requests_become_suspects_finish_elsewhere_and_clear(
    slow_restart: Server,
) -> None:
    """Six long streams; group 0 is killed and stays down, so its suspects all go to group 1.
    Each waits there only for the previous one's first token (its probation), not for its
    whole generation: serialized, their generations would outlast the 3 s migration wait."""
    s = slow_restart
    n, tokens = 6, 160
    ref = [
        httpx.post(s.url + "/v1/completions", json=_body(i, tokens, False), timeout=120).json()[
            "choices"
        ][0]["token_ids"]
        for i in range(n)
    ]
    victim = _groups(s)[0]["ranks"][1]["pid"]
    watch = _Watch(s)
    watch.start()

    async def run() -> list[dict]:
        outs: list[dict] = [{} for _ in range(n)]
        async with httpx.AsyncClient(timeout=300) as c:
            tasks = [
                asyncio.create_task(_stream(c, s.url, _body(i, tokens, True), outs[i]))
                for i in range(n)
            ]
            while sum(o.get("chunks", 0) for o in outs) < 3 * n:
                await asyncio.sleep(0.01)
            os.kill(victim, signal.SIGKILL)
            await asyncio.gather(*tasks)
        return outs

    outs = asyncio.run(run())
    watch.stop.set()
    watch.join()
    assert [o["ids"] for o in outs] == ref and not any(o["errors"] for o in outs)
    assert {o["group"] for o in outs} == {"0", "1"}
    moved = metric(s, "safeserve:request_migrations_total")
    assert moved >= 1
    assert metric(s, "safeserve:requests_suspect_cleared_total") == moved
    assert metric(s, "safeserve:requests_suspect") == 0
    assert metric(s, "safeserve:requests_quarantined_total") == 0
    assert metric(s, "safeserve:requests_lost_total") == 0
    assert watch.max_on_probation <= 1 and not watch.bad  # one on probation per group at most
    q = httpx.get(s.admin_url + "/admin/quarantine").json()
    assert q["suspects"] == [] and q["quarantined"] == []
    g0 = _groups(s)[0]
    # backoff of 30 s: waiting for its restart, which it does by itself (not FAILED for good)
    assert g0["state"] == "RESTARTING" and not g0["crash_loop"]
    assert [st for _, st in [(e["at"], e["state"]) for e in g0["events"]]][-2:] == [
        "FAILED",
        "RESTARTING",
    ]
    v = g0["verdicts"][-1]
    assert (v["kind"], v["rank"], v["signal"], v["exit_code"]) == ("dead", 1, "SIGKILL", -9)
    assert "killed by SIGKILL" in oncall(s, "describe", "group", "0").stdout

    # The operator restarts it: the answer says where it stands now, not "FAILED".
    r = oncall(s, "restart", "group", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("group 0 restart: under way (now RESTARTING, 0 in flight;")
    assert "safeserve oncall describe group 0" in r.stdout and "READY" in r.stdout
    _wait_ready(s)
    assert _groups(s)[0]["restarts"] == 1


def test_suspects_move_one_per_group_per_first_token_not_per_generation() -> None:
    """Two suspects and one READY group: the second is placed once the first's first token
    came from there, while the first still generates; both end complete."""

    async def run() -> None:
        gen, (g0, g1) = _generator()
        params = SamplingParams(max_tokens=6, temperature=0.0)
        g1.up = False
        reqs = [gen.start(rid, [10 + i, 11 + i], params, []) for i, rid in enumerate("ab")]
        g1.up = True
        tasks = [asyncio.create_task(_drain(r)) for r in reqs]
        for rid, first in (("a", 5), ("b", 6)):
            g0.client.out(rid, [first])
        await asyncio.sleep(0.05)
        g0.fail(gen.router)  # group 0 stays down: group 1 is the only place
        await _until(lambda: len(g1.client.queues) == 1)
        (first_rid,) = g1.client.queues
        other = "b" if first_rid == "a" else "a"
        await asyncio.sleep(0.1)
        assert len(g1.client.queues) == 1  # the other waits while the first is on probation
        g1.client.out(first_rid, [7])  # its first token on group 1: the probation ends
        await _until(lambda: len(g1.client.queues) == 2)
        assert gen.qod.suspect_groups() == {1} and gen.qod.suspects[other].probation
        g1.client.out(other, [7, 8, 9, 10, 11], "length")
        g1.client.out(first_rid, [8, 9, 10, 11], "length")
        (ids_a, err_a), (ids_b, err_b) = await asyncio.gather(*tasks)
        assert (err_a, err_b) == (None, None)
        assert ids_a == [5, 7, 8, 9, 10, 11] and ids_b == [6, 7, 8, 9, 10, 11]
        assert _sample(gen, "requests_suspect_cleared_total") == 2
        assert _sample(gen, "requests_quarantined_total") == 0

    asyncio.run(run())


def test_a_failure_quarantines_the_suspect_on_probation_only() -> None:
    """Group 1 fails holding a suspect past its probation and one still on it: the latter is
    quarantined, the former continues (a suspect of this failure) and completes."""

    async def run() -> None:
        gen, (g0, g1) = _generator()
        ta, tb = await _in_flight_on_group_0(gen, g0, g1, {"a": 5, "b": 6})
        g0.fail(gen.router)
        await _until(lambda: len(g1.client.queues) == 1)
        (past,) = g1.client.queues
        g1.client.out(past, [7])  # past its probation on group 1
        await _until(lambda: len(g1.client.queues) == 2)
        (probation,) = set(g1.client.queues) - {past}
        g0.up = True
        g1.fail(gen.router)  # before the second one's first token there
        await _until(lambda: len(g0.client.queues) == 1)
        assert set(g0.client.queues) == {past}
        assert gen.qod.suspects[past].failed_group == 1
        g0.client.out(past, [8, 9], "length")
        res = dict(zip(("a", "b"), await asyncio.gather(ta, tb), strict=True))
        assert res[past][1] is None and res[past][0][1:] == [7, 8, 9]
        err = res[probation][1]
        assert err is not None and (err.status, err.code) == (422, "request_quarantined")
        assert _sample(gen, "requests_quarantined_total") == 1

    asyncio.run(run())


def _refused(gen, group: int) -> float:  # type: ignore[no-untyped-def]
    return _sample(gen, "group_sends_refused_total", group=str(group))


def test_a_new_request_a_ready_groups_leader_refuses_goes_to_another_group() -> None:
    """Group 0 still looks READY but its leader takes nothing (it died a moment ago): a new
    request goes to group 1, never a 503 while group 1 can take it; with no other group it is
    refused (NoGroupReady: 503 at the edge). Each refusal is counted for its group."""
    from safeserve.server.router import NoGroupReady

    async def run() -> None:
        gen, (g0, g1) = _generator()
        g0.client.refusing = True
        placed = [gen.start(f"r{i}", [10 + i, 11], _PARAMS, []) for i in range(4)]
        assert all(p.supervisor is g1 for p in placed)
        assert set(g1.client.queues) == {"r0", "r1", "r2", "r3"} and g0.client.queues == {}
        assert _refused(gen, 0) >= 1 and _refused(gen, 1) == 0
        for p in placed:
            g1.client.out(p.rid, [1, 2, 3, 4], "length")
            assert await _drain(p) == ([1, 2, 3, 4], None)
        g1.up = False
        before = _refused(gen, 0)
        with pytest.raises(NoGroupReady):
            gen.start("alone", [9], _PARAMS, [])
        assert _refused(gen, 0) == before + 1 and "alone" not in gen.active

    asyncio.run(run())


def test_a_suspect_refused_by_its_next_groups_leader_waits_for_that_groups_next_incarnation() -> (
    None
):
    """A request in flight on group 0 when it fails is a suspect for group 1, whose leader
    refuses it (group 1 is about to fail too): it is passed over for that incarnation, not
    given up (a 503 mid-stream), and goes to group 1's next incarnation once it is READY; every
    token arrives once."""

    async def run() -> None:
        gen, (g0, g1) = _generator(wait_s=5.0)
        (task,) = await _in_flight_on_group_0(gen, g0, g1, {"a": 5})
        g1.client.refusing = True
        g0.fail(gen.router)
        await _until(lambda: _refused(gen, 1) == 1)
        await asyncio.sleep(0.1)
        assert not task.done() and _refused(gen, 1) == 1  # passed over, not retried in a loop
        g1.client = _Client()  # group 1 restarted: a new incarnation whose leader takes it
        gen.router.notify()
        await _until(lambda: "a" in g1.client.queues)
        assert g1.client.submitted == [("a", [10, 11, 5])]  # the prompt and its one token
        g1.client.out("a", [6, 7, 8], "length")
        assert await task == ([5, 6, 7, 8], None)
        assert _sample(gen, "request_migrations_total") == 1
        assert _sample(gen, "requests_failed_after_retries_total") == 0

    asyncio.run(run())
