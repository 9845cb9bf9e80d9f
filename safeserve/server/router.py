"""The GroupRouter: which READY group serves a request, and the budget for retries.

**Placement.** A request goes to the READY group with the most headroom (`score`, below): free
decode slots and free KV cache, from the group's latest `EngineStats` and the frontend's own
count of the requests it sent there, so that a burst between two stats reports still spreads.
Every pick is counted in `safeserve:router_picks_total{group, reason}`: `new` (a request's first
group), `moved` (a request still waiting, moved to a group that just became READY, see
`Generator.rebalance`) and `migrated` (a continuation after its group failed).

**Score** of a READY group, with `max_running` = `--max-running-requests`:

- `occupied` = max(requests the frontend has in flight on it, `num_running + num_waiting`): the
  frontend's count sees what it sent since the last report, the engine's what it still holds;
- `slot_headroom` = (`max_running` - `occupied`) / `max_running`: 1 when idle, 0 when every
  decode slot is taken, negative while requests queue beyond them;
- `kv_headroom` = 1 - (`kv_blocks_used` + `pending` x `kv_blocks_used` / `num_running`) /
  `kv_blocks_total`, where `pending` = `occupied` - `num_running` (queued or not yet reported)
  is counted at the running requests' mean blocks; 1 before the group's first report;
- `headroom` = min(`slot_headroom`, `kv_headroom`): the scarcer of the two.

The pick is the largest (`headroom`, `slot_headroom`, -in flight): ties go to the group with
more free slots, then fewer requests in flight, then the one picked least recently (then the
lowest id), so equally idle groups take turns: at a low request rate, where every request ends
before the next comes, each still gets its share. STARTING, FAILED,
RESTARTING, DRAINING and DRAINED groups (and a READY group whose incarnation is being fenced)
are never picked.

**Retries.** When a group fails, each of its requests continues elsewhere as a continuation;
those attempts draw on a retry budget (Envoy's rule: at most 20 % of active requests retrying at
once, minimum 3) so that a failure cannot turn into a storm on the healthy groups. A request
that finds the budget spent waits for a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass

from safeserve.messages import EngineStats
from safeserve.server.metrics import Metrics
from safeserve.server.supervisor import Supervisor

RETRY_BUDGET_SHARE = 0.2
RETRY_BUDGET_MIN = 3


class NoGroupReady(Exception):
    pass


@dataclass(frozen=True)
class GroupScore:
    """How much room a READY group has for one more request (module docstring: Score)."""

    group: int
    in_flight: int  # requests the frontend sent there and has not seen end
    occupied: int  # decode slots taken or asked for
    waiting: int  # of those, not running at the group's last report (queued or unreported)
    queued: int  # of those, sure to wait: queued at the last report, or beyond the slots
    slot_headroom: float
    kv_headroom: float

    @property
    def headroom(self) -> float:
        return min(self.slot_headroom, self.kv_headroom)

    def key(self) -> tuple[float, float, int]:
        """Larger is better (equal keys: the router takes turns)."""
        return (self.headroom, self.slot_headroom, -self.in_flight)


def score(group: int, stats: EngineStats, in_flight: int, max_running: int) -> GroupScore:
    """The score of a group from its latest stats and the frontend's in-flight count."""
    max_running = max(1, max_running)
    occupied = max(in_flight, stats.num_running + stats.num_waiting)
    pending = max(0, occupied - stats.num_running)
    kv = 1.0
    if stats.kv_blocks_total > 0:
        per_request = stats.kv_blocks_used / stats.num_running if stats.num_running else 0.0
        kv = 1.0 - (stats.kv_blocks_used + pending * per_request) / stats.kv_blocks_total
    return GroupScore(
        group=group,
        in_flight=in_flight,
        occupied=occupied,
        waiting=pending,
        queued=max(stats.num_waiting, occupied - max_running, 0),
        slot_headroom=(max_running - occupied) / max_running,
        kv_headroom=kv,
    )


class GroupRouter:
    def __init__(self, supervisors: list[Supervisor], metrics: Metrics | None = None) -> None:
        self.supervisors = supervisors
        self.metrics = metrics
        self.active = 0  # requests the frontend holds
        self.retrying = 0
        self._changed = asyncio.Event()
        self._ready_seen: set[int] = set()
        self._picks = 0  # picks so far; a group's last pick's number (ties take turns)
        self._last_pick: dict[int, int] = {}
        # Called with a group that just became READY (the generator moves waiting requests).
        self.on_ready: list[Callable[[Supervisor], None]] = []

    def notify(self) -> None:
        """A group changed state or a retry slot freed: wake the waiters; tell `on_ready` of
        each group that became READY since the last call."""
        self._changed.set()
        self._changed = asyncio.Event()
        ready = self.ready()
        new = [s for s in ready if s.group not in self._ready_seen]
        self._ready_seen = {s.group for s in ready}
        for sup in new:
            for callback in self.on_ready:
                callback(sup)

    def ready(self) -> list[Supervisor]:
        return [s for s in self.supervisors if s.ready]

    def score(self, sup: Supervisor) -> GroupScore:
        client = sup.client
        if client is None:
            return score(sup.group, EngineStats(), 0, sup.args.max_running_requests)
        return score(sup.group, client.stats, len(client.queues), sup.args.max_running_requests)

    def pick(
        self, exclude: int | None = None, avoid: Collection[int] = (), reason: str = "new"
    ) -> Supervisor:
        """The READY group with the best score, other than `exclude` if there is one, never
        one in `avoid` (the groups holding a suspect, for a suspect's placement); counted under
        `reason`."""
        allowed = [s for s in self.ready() if s.group not in avoid]
        ready = [s for s in allowed if s.group != exclude] or allowed
        if not ready:
            raise NoGroupReady
        best = max(
            ready,
            key=lambda s: (*self.score(s).key(), -self._last_pick.get(s.group, 0), -s.group),
        )
        self._picks += 1
        self._last_pick[best.group] = self._picks
        self.count(best, reason)
        return best

    def count(self, sup: Supervisor, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.router_picks.labels(str(sup.group), reason).inc()

    async def wait_pick(
        self,
        timeout: float,
        exclude: int | None = None,
        avoid: Callable[[], Collection[int]] | None = None,
        reason: str = "new",
    ) -> Supervisor:
        """`pick`, waiting up to `timeout` for a group; `avoid()` is asked at every try."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                return self.pick(exclude, avoid() if avoid is not None else (), reason)
            except NoGroupReady:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, 0.5))

    @property
    def retry_budget(self) -> int:
        return max(RETRY_BUDGET_MIN, int(RETRY_BUDGET_SHARE * self.active))

    @contextlib.asynccontextmanager
    async def retry_slot(self, timeout: float) -> AsyncIterator[None]:
        """Holds one of the budget's slots while a retry is being placed."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.retrying >= self.retry_budget:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise TimeoutError("retry budget exhausted")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
        self.retrying += 1
        try:
            yield
        finally:
            self.retrying -= 1
            self.notify()
