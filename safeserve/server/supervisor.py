"""One supervisor per EP group: spawns it, watches it, drains it, restarts it.

States: `STARTING -> READY -> DRAINING -> DRAINED`, and `READY|DRAINING -> FAILED -> RESTARTING ->
STARTING`. Each start is a fresh incarnation (`GroupClient`: new processes, new sockets), so
nothing queued for a dead incarnation reaches the next one. A failed group that restarts by
itself is RESTARTING from its failure on, the backoff wait included. A group that fails
`--crash-loop-failures` times within `--crash-loop-window-s` stays FAILED (`crash_loop`) until an
operator restarts it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Callable

from safeserve.config import ServerArgs
from safeserve.guards.watchdog import Verdict
from safeserve.server.group_client import GroupClient, GroupState
from safeserve.server.metrics import Metrics
from safeserve.server.nodes import NodeHub

logger = logging.getLogger(__name__)

HISTORY = 50  # state changes and watchdog verdicts kept per group, across incarnations


def restart_delay(backoff_s: float, failures_in_window: int) -> float:
    """The wait before a restart: `--restart-backoff-s`, doubled for each earlier failure in the
    crash-loop window; a failure that does not count toward the window (a lost node agent)
    waits the base backoff."""
    return backoff_s * 2 ** max(failures_in_window - 1, 0)


class SupervisorState(enum.Enum):
    STARTING = "STARTING"
    READY = "READY"
    DRAINING = "DRAINING"
    DRAINED = "DRAINED"
    FAILED = "FAILED"
    RESTARTING = "RESTARTING"
    STOPPED = "STOPPED"


class Supervisor:
    def __init__(
        self,
        args: ServerArgs,
        group: int,
        metrics: Metrics,
        on_change: Callable[[], None] | None = None,
        hub: NodeHub | None = None,
    ) -> None:
        self.args = args
        self.hub = hub  # --placement remote: the node agents
        self.group = group
        self.metrics = metrics
        self.on_change = on_change or (lambda: None)
        self.state = SupervisorState.STARTING
        self.client: GroupClient | None = None
        self.failures: list[float] = []  # times of failures (crash-loop window)
        self.failures_total = 0
        self.restarts_total = 0
        self.crash_loop = False
        self.last_reason: str | None = None
        self.ever_ready = False
        self._tasks: set[asyncio.Task] = set()
        self._restart_after_drain = False
        self._stopping = False
        self._backoff: asyncio.Task | None = None  # the restart a failure scheduled
        self._restarting = False  # a restart is past its backoff, stopping the old incarnation
        # (wall time, state) of every change, and the verdicts of earlier incarnations: what an
        # operator (and a chaos run) reads to time detection and recovery.
        self.events: deque[tuple[float, str]] = deque([(time.time(), self.state.value)], HISTORY)
        self.past_verdicts: deque[Verdict] = deque(maxlen=HISTORY)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._set(SupervisorState.STARTING)
        client = GroupClient(
            self.args, self.group, self.metrics, on_failed=self._on_failed, hub=self.hub
        )
        self.client = client
        client.start()
        self._spawn(self._await_ready(client))

    async def _await_ready(self, client: GroupClient) -> None:
        try:
            await client.wait_ready(self.args.startup_timeout_s)
        except TimeoutError:
            client._fail(f"not ready after {self.args.startup_timeout_s:.0f} s")
            return
        if (
            client is self.client
            and client.state is GroupState.READY
            and self.state is SupervisorState.STARTING
        ):
            self.ever_ready = True
            self._set(SupervisorState.READY)

    async def stop(self) -> None:
        self._stopping = True
        for t in list(self._tasks):
            t.cancel()
        if self.client is not None:
            await self.client.stop()
        self._set(SupervisorState.STOPPED)

    # -- operator actions -----------------------------------------------------------------------
    def refusal(self, action: str) -> str | None:
        """Why `action` (drain, undrain, restart) cannot be done now; None if it can."""
        st = self.state
        if action == "drain" and st is not SupervisorState.READY:
            return f"group {self.group} is {st.value}, not READY"
        if action == "undrain" and st not in (SupervisorState.DRAINING, SupervisorState.DRAINED):
            return f"group {self.group} is {st.value}, not DRAINING or DRAINED"
        if (
            action == "restart"
            and not self.in_backoff
            and st
            not in (
                SupervisorState.FAILED,
                SupervisorState.READY,
                SupervisorState.DRAINING,
                SupervisorState.DRAINED,
            )
        ):
            return f"group {self.group} is {st.value}; cannot restart now"
        return None

    def drain(self) -> None:
        """No new requests; in-flight ones finish; then DRAINED."""
        if (why := self.refusal("drain")) is not None:
            raise ValueError(why)
        self._set(SupervisorState.DRAINING)
        self._spawn(self._drain_watch())

    def undrain(self) -> None:
        if (why := self.refusal("undrain")) is not None:
            raise ValueError(why)
        self._restart_after_drain = False
        self._set(SupervisorState.READY)

    def restart(self) -> None:
        """Drain, then restart (a FAILED group, crash-looped or not, restarts at once). On
        return the state is where the restart stands: DRAINING, or RESTARTING."""
        if (why := self.refusal("restart")) is not None:
            raise ValueError(why)
        if self.state is SupervisorState.FAILED or self.in_backoff:
            self.crash_loop = False
            self.failures.clear()
            if self._backoff is not None:  # the operator's restart replaces the scheduled one
                self._backoff.cancel()
            self._restart_now()
            return
        if self.state is SupervisorState.READY:
            self._restart_after_drain = True
            self.drain()
            return
        if self.state in (SupervisorState.DRAINING, SupervisorState.DRAINED):
            self._restart_after_drain = True
            if self.state is SupervisorState.DRAINED:
                self._restart_now()

    def _restart_now(self) -> None:
        self._set(SupervisorState.RESTARTING)  # now, not when the task first runs
        self._spawn(self._restart(delay=0.0))

    async def _drain_watch(self) -> None:
        while self.state is SupervisorState.DRAINING:
            client = self.client
            if client is None or not client.queues:
                self._set(SupervisorState.DRAINED)
                logger.info("group %d drained", self.group)
                if self._restart_after_drain:
                    await self._restart(delay=0.0)
                return
            await asyncio.sleep(0.1)

    # -- failures -------------------------------------------------------------------------------
    def _on_failed(self, reason: str) -> None:
        if self._stopping:
            return
        now = time.monotonic()
        self.failures_total += 1
        self.metrics.group_failures.labels(str(self.group)).inc()
        self.failures = [t for t in self.failures if now - t < self.args.crash_loop_window_s]
        # A node agent lost (killed, frozen, cut off) is the host's failure, not the group's:
        # it does not count toward a crash loop (the group restarts once devices are back).
        if self.client is None or not self.client.node_lost:
            self.failures.append(now)
        self.last_reason = reason
        self._set(SupervisorState.FAILED)
        if len(self.failures) >= self.args.crash_loop_failures:
            self.crash_loop = True
            logger.error(
                "group %d failed %d times within %.0f s: crash loop, it stays FAILED (restart it "
                "through the admin API once fixed): %s",
                self.group,
                len(self.failures),
                self.args.crash_loop_window_s,
                reason,
            )
            return
        delay = restart_delay(self.args.restart_backoff_s, len(self.failures))
        logger.warning("group %d failed (%s); restarting in %.1f s", self.group, reason, delay)
        # A group that restarts by itself is RESTARTING from now on, its backoff included: only
        # a crash-looped group stays FAILED (the FAILED event above is what detection reads).
        self._set(SupervisorState.RESTARTING)
        self._backoff = self._spawn(self._restart(delay))

    @property
    def in_backoff(self) -> bool:
        """RESTARTING, still waiting out the backoff of its last failure."""
        return self._backoff is not None and not self._backoff.done() and not self._restarting

    async def _restart(self, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        self._restarting = True
        self._set(SupervisorState.RESTARTING)
        old = self.client
        if old is not None:
            await old.stop()  # every process of the old incarnation gone, its sockets closed
            self.past_verdicts.extend(old.verdicts)
        self._restart_after_drain = False
        self.restarts_total += 1
        self.metrics.group_restarts.labels(str(self.group)).inc()
        logger.info("group %d restarting (restart %d)", self.group, self.restarts_total)
        self._restarting = False
        self.start()

    # -- helpers --------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state is SupervisorState.READY and self.client is not None and self.client.ready

    @property
    def load(self) -> int:
        return len(self.client.queues) if self.client is not None else 0

    def _set(self, state: SupervisorState) -> None:
        if state is not self.state:
            logger.info("group %d: %s -> %s", self.group, self.state.value, state.value)
            self.events.append((time.time(), state.value))
        self.state = state
        for s in SupervisorState:
            self.metrics.group_state.labels(str(self.group), s.value).set(1 if s is state else 0)
        self.on_change()

    def _spawn(self, coro) -> asyncio.Task:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def verdicts(self) -> list[Verdict]:
        """Watchdog verdicts of every incarnation, oldest first."""
        current = self.client.verdicts if self.client is not None else []
        return [*self.past_verdicts, *current][-HISTORY:]

    def describe(self) -> dict:
        return {
            "state": self.state.value,
            "failures": self.failures_total,
            "restarts": self.restarts_total,
            "crash_loop": self.crash_loop,
            "last_failure": self.last_reason,
        }
