"""The watchdog: reads every rank's heartbeats, process state and utilization; names a culprit.

Verdicts:
- `dead`: a rank's process is gone (or a zombie).
- `stalled`: the group's progress stopped longer than `--watchdog-stall-timeout`. A rank that
  stopped beating (SIGSTOP, a hung interpreter) is the culprit; when every rank still beats but
  no phase moved while the group has work, the culprit is the idle rank that entered its phase
  first (its peers wait for it in a collective).
- `slow`: a rank's own step time (outside collectives) stays far above its peers' median for
  `--watchdog-slow-window-s`. Reported, not fenced.

Warm-up and first-step compilation do not count: the watchdog arms when the group is READY, and
a rank that is busy (using CPU or GPU) in a long phase is working, not stalled.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

logger = logging.getLogger(__name__)

IDLE_UTILIZATION = 0.2  # below this a rank is not computing
SLOW_MIN_SECONDS = 0.05  # a step this short is never "slow"


@dataclass
class Verdict:
    kind: str  # "dead" | "stalled" | "slow"
    group: int
    rank: int
    reason: str
    at: float = field(default_factory=time.time)

    @property
    def fences(self) -> bool:
        return self.kind in ("dead", "stalled")


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
    ) -> list[Verdict]:
        """`ranks`: rank -> status with pid, step, phase, phase_since, received_at, stats.
        `exitcodes` (when known) orders dead ranks: one killed by a signal died first; its peers
        usually exit after it, when their collective with it fails."""
        now = time.time()
        verdicts: list[Verdict] = []
        codes = exitcodes or {}
        dead = [r for r, st in ranks.items() if not alive.get(r, True) or _zombie(st.pid)]
        if dead:
            dead.sort(key=lambda r: ((codes.get(r) or 0) >= 0, r))
            return [
                Verdict(
                    "dead",
                    group,
                    r,
                    f"rank {r} (pid {ranks[r].pid}) is gone (exit code {codes.get(r)})",
                )
                for r in dead
            ]
        utils = {
            r: self.utilization(group, r, st.pid, st.stats.get("device")) for r, st in ranks.items()
        }
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
            if now - last_move > self.stall_timeout:
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
        own = {r: float(st.stats.get("own_step_s", 0.0)) for r, st in ranks.items()}
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
