from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from safeserve.guards.watchdog import Watchdog
from safeserve.messages import RankStats


@dataclass
class _St:
    pid: int | None = field(default_factory=os.getpid)
    step: int = 10
    phase: str = "experts"
    phase_since: float = field(default_factory=time.time)
    received_at: float = field(default_factory=time.time)
    stats: RankStats = field(default_factory=RankStats)


def test_dead_process_is_named() -> None:
    wd = Watchdog(stall_timeout=5)
    v = wd.check(0, {0: _St(), 1: _St()}, {0: True, 1: False}, has_work=True)
    assert [(x.kind, x.rank) for x in v] == [("dead", 1)]


def test_silent_rank_is_stalled_culprit() -> None:
    wd = Watchdog(stall_timeout=2)
    ranks = {0: _St(), 1: _St(received_at=time.time() - 3), 2: _St(received_at=time.time() - 1)}
    v = wd.check(0, ranks, {0: True, 1: True, 2: True}, has_work=False)
    assert [(x.kind, x.rank) for x in v] == [("stalled", 1)]


def test_no_progress_with_work_names_the_idle_laggard() -> None:
    wd = Watchdog(stall_timeout=2)
    old = time.time() - 5
    ranks = {
        0: _St(phase="dispatch", phase_since=old + 1),
        1: _St(step=9, phase="attention", phase_since=old),
    }
    wd.check(0, ranks, {0: True, 1: True}, has_work=True)  # first call samples CPU time
    time.sleep(0.05)
    v = wd.check(0, ranks, {0: True, 1: True}, has_work=True)
    assert [(x.kind, x.rank) for x in v] == [("stalled", 1)]
    # Without work the same picture is an idle group, not a stall.
    assert Watchdog(stall_timeout=2).check(0, ranks, {0: True, 1: True}, has_work=False) == []


def test_slow_needs_a_sustained_window_and_fences_nothing() -> None:
    wd = Watchdog(stall_timeout=10, slow_factor=4, slow_window_s=0.2)
    ranks = {
        0: _St(stats=RankStats(own_step_s=0.01)),
        1: _St(stats=RankStats(own_step_s=0.6)),
        2: _St(stats=RankStats(own_step_s=0.012)),
    }
    assert wd.check(0, ranks, {0: True, 1: True, 2: True}, has_work=True) == []
    time.sleep(0.25)
    for r in ranks.values():
        r.received_at = r.phase_since = time.time()
    v = wd.check(0, ranks, {0: True, 1: True, 2: True}, has_work=True)
    assert [(x.kind, x.rank, x.fences) for x in v] == [("slow", 1, False)]
    assert wd.check(0, ranks, {0: True, 1: True, 2: True}, has_work=True) == []  # reported once


def test_all_idle_with_queued_work_is_not_a_stall() -> None:
    """A leader that has not picked work up yet (e.g. starved of CPU) is alive, not stuck."""
    wd = Watchdog(stall_timeout=1)
    old = time.time() - 5
    ranks = {0: _St(phase="idle", phase_since=old), 1: _St(phase="idle", phase_since=old)}
    wd.check(0, ranks, {0: True, 1: True}, has_work=True)
    time.sleep(0.05)
    assert wd.check(0, ranks, {0: True, 1: True}, has_work=True) == []


def test_a_rank_that_reported_its_error_crashed_a_silent_or_killed_one_is_dead() -> None:
    """The verdict names the cause: `crashed` with the rank's own error line when it reported
    one before exiting; `dead` with the signal's name or the exit code otherwise."""
    wd = Watchdog(stall_timeout=5)
    ranks, alive = {0: _St(), 1: _St()}, {0: True, 1: False}
    report = {1: "step failed: RuntimeError: boom"}
    (v,) = wd.check(0, ranks, alive, True, {0: None, 1: 1}, report)
    assert (v.kind, v.rank, v.fences, v.exit_code) == ("crashed", 1, True, 1)
    assert v.error == "step failed: RuntimeError: boom" and "RuntimeError: boom" in v.reason
    (v,) = wd.check(0, ranks, alive, True, {0: None, 1: -9})
    assert (v.kind, v.signal, v.exit_code) == ("dead", "SIGKILL", -9) and "SIGKILL" in v.reason
    (v,) = wd.check(0, ranks, alive, True, {0: None, 1: 1})
    assert (v.kind, v.signal) == ("dead", None) and "exited with code 1" in v.reason


def test_the_culprit_comes_first_among_dead_ranks() -> None:
    """Killed by a signal, then a silent exit, then the first to report: a peer whose
    collective broke because the culprit went reports after it."""
    wd = Watchdog(stall_timeout=5)
    ranks, gone = {0: _St(), 1: _St(), 2: _St()}, {0: False, 1: False, 2: False}
    peer = "step failed: RuntimeError: Connection closed by peer"
    v = wd.check(0, ranks, gone, True, {0: 1, 1: 1, 2: -9}, {0: peer, 1: "step failed: E: x"})
    assert [(x.kind, x.rank) for x in v] == [("dead", 2), ("crashed", 0), ("crashed", 1)]
    v = wd.check(0, ranks, gone, True, {0: 1, 1: 1, 2: 1}, {1: "step failed: E: x", 0: peer})
    assert [(x.kind, x.rank) for x in v] == [("dead", 2), ("crashed", 1), ("crashed", 0)]
    two = {0: _St(), 1: _St()}
    v = wd.check(0, two, {0: False, 1: False}, True, {0: 1, 1: 1}, {0: peer})
    assert [(x.kind, x.rank) for x in v][0] == ("dead", 1)  # the silent exit, not the reporter
    # Two silent exits (a report not read yet): the one seen gone first.
    t = time.time()
    v = wd.check(0, two, {0: False, 1: False}, True, {0: 1, 1: 1}, {}, {0: t, 1: t - 0.4})
    assert [x.rank for x in v] == [1, 0]


# -- the verdict a group's frontend gives for real processes that die ---------------------------
def _report_and_exit(addr: str, rank: int, delay: float, error: str) -> None:
    """What a rank does on a fatal error (rank_worker._fatal): report it, then exit 1. Here
    the report is flushed before the exit (`ctx.term()` waits for it): os._exit ends ZeroMQ's
    I/O thread, and a small message's send tracker is done at once, before it left."""
    import pickle

    import zmq

    from safeserve.messages import GroupFatal

    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(addr)
    time.sleep(0.3 + delay)  # a rank's socket is connected long before it fails
    out.send(pickle.dumps(GroupFatal(0, rank, f"step failed: RuntimeError: {error}")))
    out.close(linger=2000)
    ctx.term()
    os._exit(1)


def _sleep_then_exit(delay: float, code: int) -> None:
    time.sleep(delay)
    os._exit(code)


def _verdict_of(culprit: str, peer_delay: float):  # type: ignore[no-untyped-def]
    """Rank 1 `raise`s (reports, exits 1), is `kill`ed (SIGKILL) or exits `silent`ly (code 1);
    rank 0 is a peer that reports a broken collective `peer_delay` later. Returns what the
    GroupClient recorded: its verdicts and the reason it failed."""
    import asyncio
    import multiprocessing as mp
    import signal

    from safeserve.config import ServerArgs
    from safeserve.server.group_client import GroupClient, GroupState

    async def run():  # type: ignore[no-untyped-def]
        client = GroupClient(ServerArgs(tp_size=2, watchdog_stall_timeout=30), group=0)
        ctx = mp.get_context("spawn")
        addr = client.addrs.outputs
        target, args = {
            "raise": (_report_and_exit, (addr, 1, 0.0, "boom in a step")),
            "kill": (_sleep_then_exit, (60.0, 0)),
            "silent": (_sleep_then_exit, (1.0, 1)),
        }[culprit]
        rank1 = ctx.Process(target=target, args=args, daemon=True)
        rank1.start()
        if culprit == "kill":
            await asyncio.sleep(0.5)
            os.kill(rank1.pid, signal.SIGKILL)
        closed = "Connection closed by peer"
        rank0 = ctx.Process(
            target=_report_and_exit, args=(addr, 0, peer_delay, closed), daemon=True
        )
        rank0.start()
        client.processes = [rank0, rank1]
        for r, p in enumerate(client.processes):
            client.ranks[r].pid = p.pid
        client.state = GroupState.READY
        client._tasks = [
            asyncio.create_task(client._read_outputs()),
            asyncio.create_task(client._watch()),
        ]
        deadline = time.monotonic() + 30
        while client.state is not GroupState.FAILED:
            assert time.monotonic() < deadline, "the group never failed"
            await asyncio.sleep(0.05)
        await client.stop()
        return client.verdicts, client.fatal

    return asyncio.run(run())


def test_a_group_whose_rank_raised_shows_crashed_with_its_error() -> None:
    (v,), fatal = _verdict_of("raise", peer_delay=1.5)
    assert (v.kind, v.rank, v.exit_code) == ("crashed", 1, 1)
    assert v.error == "step failed: RuntimeError: boom in a step"
    assert fatal.startswith("watchdog: crashed: rank 1") and "RuntimeError: boom" in fatal


def test_a_killed_rank_shows_dead_with_the_signal_not_the_peer_that_reported() -> None:
    (v,), _ = _verdict_of("kill", peer_delay=0.05)
    assert (v.kind, v.rank, v.signal, v.exit_code) == ("dead", 1, "SIGKILL", -9)
    assert "killed by SIGKILL" in v.reason


def test_a_silent_exit_shows_dead_with_its_exit_code() -> None:
    """The request-borne `exit` fault's picture: one rank os._exit(1)s without a word; its peer
    reports the broken collective right after. The silent one is named."""
    (v,), _ = _verdict_of("silent", peer_delay=1.5)
    assert (v.kind, v.rank, v.exit_code, v.signal) == ("dead", 1, 1, None)
    assert "exited with code 1 without reporting an error" in v.reason
