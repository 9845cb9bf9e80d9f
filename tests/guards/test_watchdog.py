from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from safeserve.guards.watchdog import Watchdog


@dataclass
class _St:
    pid: int | None = field(default_factory=os.getpid)
    step: int = 10
    phase: str = "experts"
    phase_since: float = field(default_factory=time.time)
    received_at: float = field(default_factory=time.time)
    stats: dict = field(default_factory=dict)


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
        0: _St(stats={"own_step_s": 0.01}),
        1: _St(stats={"own_step_s": 0.6}),
        2: _St(stats={"own_step_s": 0.012}),
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
