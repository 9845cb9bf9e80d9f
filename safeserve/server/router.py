"""The GroupRouter: which READY group serves a request, and the budget for retries.

New requests go to the least-loaded READY group. When a group fails, each of its requests
continues elsewhere as a continuation; those attempts draw on a retry budget (Envoy's rule: at
most 20 % of active requests retrying at once, minimum 3) so that a failure cannot turn into a
storm on the healthy groups. A request that finds the budget spent waits for a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Collection

from safeserve.server.supervisor import Supervisor

RETRY_BUDGET_SHARE = 0.2
RETRY_BUDGET_MIN = 3


class NoGroupReady(Exception):
    pass


class GroupRouter:
    def __init__(self, supervisors: list[Supervisor]) -> None:
        self.supervisors = supervisors
        self.active = 0  # requests the frontend holds
        self.retrying = 0
        self._changed = asyncio.Event()

    def notify(self) -> None:
        """A group changed state or a retry slot freed: wake the waiters."""
        self._changed.set()
        self._changed = asyncio.Event()

    def ready(self) -> list[Supervisor]:
        return [s for s in self.supervisors if s.ready]

    def pick(self, exclude: int | None = None, avoid: Collection[int] = ()) -> Supervisor:
        """The least-loaded READY group, other than `exclude` if there is one, never one in
        `avoid` (the groups holding a suspect, for a suspect's placement)."""
        allowed = [s for s in self.ready() if s.group not in avoid]
        ready = [s for s in allowed if s.group != exclude] or allowed
        if not ready:
            raise NoGroupReady
        return min(ready, key=lambda s: (s.load, s.group))

    async def wait_pick(
        self,
        timeout: float,
        exclude: int | None = None,
        avoid: Callable[[], Collection[int]] | None = None,
    ) -> Supervisor:
        """`pick`, waiting up to `timeout` for a group; `avoid()` is asked at every try."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                return self.pick(exclude, avoid() if avoid is not None else ())
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
