"""The watchdog: reads every rank's heartbeats, process state and utilization; names a culprit.

Verdicts:
- `crashed`: a rank's process is gone after it reported a fatal error (`GroupFatal`: the
  exception's type and message), e.g. a Python exception in a step.
- `dead`: a rank's process is gone without a report: killed by a signal (named, e.g. SIGKILL)
  or a silent exit (its exit code).
- `stalled`: the group's progress stopped longer than `--watchdog-stall-timeout`. A rank that
  stopped beating (SIGSTOP, a hung interpreter) is the culprit; when every rank still beats but
  no phase moved while the group has work, the culprit is the idle rank that entered its phase
  first (its peers wait for it in a collective).
- `slow`: a rank's own step time (outside collectives) stays far above its peers' median for
  `--watchdog-slow-window-s`. Reported, not fenced.
- `corrupt`: the group's canary (`canary.py`) answered wrong twice in a row: a device computes
  wrong results. The group is fenced; which rank is not known (`rank` None).

Warm-up and first-step compilation do not count: the watchdog arms when the group is READY, and
a rank that is busy (using CPU or GPU) in a long phase is working, not stalled.
"""

from __future__ import annotations

import logging
import signal
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from safeserve.messages import EPLB_MOVE_PHASE

logger = logging.getLogger(__name__)

IDLE_UTILIZATION = 0.2  # below this a rank is not computing
SLOW_MIN_SECONDS = 0.05  # a step this short is never "slow"
# A group whose ranks move expert weights gets this many stall timeouts before "no progress"
# makes it stalled (a rank that stops beating is still stalled after one).
EPLB_MOVE_GRACE = 4


# Every verdict kind (the `verdict` label of `safeserve:watchdog_verdicts_total`).
VERDICT_KINDS = ("crashed", "dead", "stalled", "slow", "corrupt")
FENCING = ("crashed", "dead", "stalled", "corrupt")


@dataclass
class Verdict:
    kind: str  # one of VERDICT_KINDS
    group: int
    rank: int | None  # None: the group as a whole (corrupt)
    reason: str
    at: float = field(default_factory=time.time)
    exit_code: int | None = None  # crashed, dead: the process's exit code (< 0: the signal)
    signal: str | None = None  # dead: the signal that ended it, e.g. "SIGKILL"
    error: str | None = None  # crashed: the rank's own line (what failed: type: message)

    @property
    def fences(self) -> bool:
        return self.kind in FENCING


def signal_name(exit_code: int | None) -> str | None:
    """`SIGKILL` for an exit code of -9 (multiprocessing's way of saying "killed by 9")."""
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def death_verdict(
    group: int, rank: int, pid: int | None, exit_code: int | None, report: str | None
) -> Verdict:
    """`crashed` when the rank reported what failed before it went; `dead` otherwise."""
    if report is not None:
        how = f"exit code {exit_code}" if exit_code is not None else "exiting"
        reason = f"rank {rank} (pid {pid}) crashed: {report} ({how})"
        return Verdict("crashed", group, rank, reason, exit_code=exit_code, error=report)
    sig = signal_name(exit_code)
    if sig is not None:
        how = f"killed by {sig}"
    elif exit_code is not None:
        how = f"exited with code {exit_code} without reporting an error"
    else:
        how = "exit code not known yet"
    reason = f"rank {rank} (pid {pid}) is gone: {how}"
    return Verdict("dead", group, rank, reason, exit_code=exit_code, signal=sig)


class _Nvml:
    """GPU utilization through NVML, when there is one."""

    def __init__(self) -> None:
        self.ok = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self.pynvml = pynvml
            self.ok = True
        except Exception:
            self.ok = False

    def utilization(self, index: int) -> float | None:
        if not self.ok:
            return None
        try:
            handle = self.pynvml.nvmlDeviceGetHandleByIndex(index)
            return self.pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
        except Exception:
            return None


@dataclass
class _RankTrack:
    cpu_s: float | None = None
    wall: float = 0.0
    slow_since: float | None = None
    slow_reported: bool = False
    utilization: float = 0.0


@dataclass
class Watchdog:
    stall_timeout: float
    slow_factor: float = 4.0
    slow_window_s: float = 3.0
    _tracks: dict[tuple[int, int], _RankTrack] = field(default_factory=dict)
    _nvml: _Nvml | None = None

    def track(self, group: int, rank: int) -> _RankTrack:
        return self._tracks.setdefault((group, rank), _RankTrack())

    def forget(self, group: int) -> None:
        for key in [k for k in self._tracks if k[0] == group]:
            del self._tracks[key]

    def utilization(self, group: int, rank: int, pid: int | None, device: str | None) -> float:
        """GPU utilization on CUDA ranks, else the process's share of one CPU core since the
        last call."""
        tr = self.track(group, rank)
        if device and device.startswith("cuda"):
            if self._nvml is None:
                self._nvml = _Nvml()
            index = int(device.split(":")[1]) if ":" in device else 0
            util = self._nvml.utilization(index)
            if util is not None:
                tr.utilization = util
                return util
        if pid is None:
            return 0.0
        try:
            t = psutil.Process(pid).cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return 0.0
        cpu, now = t.user + t.system, time.monotonic()
        if tr.cpu_s is not None and now > tr.wall:
            tr.utilization = min(1.0, max(0.0, (cpu - tr.cpu_s) / (now - tr.wall)))
        tr.cpu_s, tr.wall = cpu, now
        return tr.utilization

    def check(
        self,
        group: int,
        ranks: dict[int, Any],
        alive: dict[int, bool],
        has_work: bool,
        exitcodes: dict[int, int | None] | None = None,
        reports: dict[int, str] | None = None,
        gone_at: dict[int, float] | None = None,
    ) -> list[Verdict]:
        """`ranks`: rank -> status with pid, step, phase, phase_since, received_at and stats (its
        last heartbeat's RankStats).
        `exitcodes` (when known) and `reports` (rank -> the fatal error it reported, in the
        order they came) order the dead ranks, the culprit first: one killed by a signal, then
        one that exited silently, then those that reported, first report first (a rank whose
        collective failed because a peer went away reports after that peer); `gone_at` (rank ->
        when it was first seen gone) orders the ranks of one kind."""
        now = time.time()
        verdicts: list[Verdict] = []
        codes = exitcodes or {}
        said = reports or {}
        order = {r: i for i, r in enumerate(said)}
        dead = [r for r, st in ranks.items() if not alive.get(r, True) or _zombie(st.pid)]
        if dead:
            seen = gone_at or {}

            def culprit_first(r: int) -> tuple[int, float, int]:
                if signal_name(codes.get(r)) is not None:
                    return (0, seen.get(r, now), r)
                return (2, order[r], r) if r in said else (1, seen.get(r, now), r)

            dead.sort(key=culprit_first)
            return [death_verdict(group, r, ranks[r].pid, codes.get(r), said.get(r)) for r in dead]
        utils = {r: self.utilization(group, r, st.pid, st.stats.device) for r, st in ranks.items()}
        # A rank that stopped beating: stopped (SIGSTOP), hung, or starved.
        ages = {r: now - st.received_at for r, st in ranks.items()}
        worst = max(ages, key=lambda r: ages[r])
        if ages[worst] > self.stall_timeout:
            state = _process_state(ranks[worst].pid)
            return [
                Verdict(
                    "stalled",
                    group,
                    worst,
                    f"rank {worst} (pid {ranks[worst].pid}, process {state}) sent no heartbeat for "
                    f"{ages[worst]:.1f} s; last phase {ranks[worst].phase} of step {ranks[worst].step}",
                )
            ]
        # Everyone beats, but nothing moves although there is work, mid-step: someone is stuck
        # idle while a peer waits in a collective. (All ranks "idle" is a group waiting for
        # work, e.g. a starved leader: alive, not stuck in a collective; no verdict.)
        mid_step = any(st.phase not in ("idle", "starting") for st in ranks.values())
        if has_work and mid_step:
            last_move = max(st.phase_since for st in ranks.values())
            # ranks moving expert weights (EPLB) wait on each other for longer than a step does
            moving = any(st.phase == EPLB_MOVE_PHASE for st in ranks.values())
            limit = self.stall_timeout * (EPLB_MOVE_GRACE if moving else 1)
            if now - last_move > limit:
                idle = [r for r in ranks if utils[r] < IDLE_UTILIZATION]
                if idle:
                    culprit = min(idle, key=lambda r: (ranks[r].step, ranks[r].phase_since))
                    st = ranks[culprit]
                    return [
                        Verdict(
                            "stalled",
                            group,
                            culprit,
                            f"no progress for {now - last_move:.1f} s; rank {culprit} idle in phase "
                            f"{st.phase} of step {st.step} while its peers wait",
                        )
                    ]
        if has_work:
            verdicts.extend(self._slow(group, ranks))
        return verdicts

    def _slow(self, group: int, ranks: dict[int, Any]) -> list[Verdict]:
        if len(ranks) < 2:
            return []
        now = time.monotonic()
        own = {r: st.stats.own_step_s for r, st in ranks.items()}
        out = []
        for r, mine in own.items():
            peers = statistics.median(v for k, v in own.items() if k != r)
            tr = self.track(group, r)
            if mine > SLOW_MIN_SECONDS and mine > self.slow_factor * max(peers, 1e-3):
                if tr.slow_since is None:
                    tr.slow_since = now
                if not tr.slow_reported and now - tr.slow_since >= self.slow_window_s:
                    tr.slow_reported = True
                    out.append(
                        Verdict(
                            "slow",
                            group,
                            r,
                            f"rank {r} step time {mine * 1e3:.0f} ms outside collectives vs peers' "
                            f"median {peers * 1e3:.0f} ms for {now - tr.slow_since:.1f} s",
                        )
                    )
            else:
                tr.slow_since, tr.slow_reported = None, False
        return out


def _zombie(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def _process_state(pid: int | None) -> str:
    if pid is None:
        return "unknown"
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"
