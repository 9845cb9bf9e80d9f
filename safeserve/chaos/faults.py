"""Injecting a scenario's faults, and checking that each one really took effect.

Signals go to a rank's process (its pid from `/admin/groups`, so the runner must share the
server's host); engine faults go through `POST /admin/faults`; group actions through
`POST /admin/groups/{id}/{action}`. A fault that was sent but had no effect (a pid already gone,
a process not stopped, a 404 from a server without `--enable-fault-injection`) is reported as
not verified: a chaos run that injected nothing proves nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

import httpx
import psutil

from safeserve.chaos.scenario import ENGINE_ACTIONS, GROUP_ACTIONS, REQUEST_ACTIONS, Fault

SIGNALS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP, "sigcont": signal.SIGCONT}
RUNNING = (psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING, psutil.STATUS_DISK_SLEEP)
VERIFY_S = 1.0  # how long a signal may take to show (a killed process becomes a zombie at once)
# What a request-borne fault must be answered with to have done what it should: the raising one
# fails alone; the deadly one is quarantined, and so is every identical request after it.
REQUEST_EXPECTED = {"raise": (500, "internal_error"), "exit": (422, "request_quarantined")}
REQUEST_PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
REQUEST_TIMEOUT_S = 180.0  # a deadly request waits for a group holding no other suspect


@dataclass
class FaultRecord:
    fault: Fault
    at: float  # seconds since the load started
    wall: float  # time.time() when it was sent (verdicts carry wall times)
    pid: int | None = None
    verified: bool = False
    detail: str = ""


def _status(pid: int) -> str | None:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None


async def _wait_status(pid: int, want: tuple[str | None, ...]) -> str | None:
    deadline = time.monotonic() + VERIFY_S
    st = _status(pid)
    while st not in want and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        st = _status(pid)
    return st


class Injector:
    def __init__(
        self,
        admin_url: str,
        admin_key: str | None = None,
        url: str | None = None,
        api_key: str | None = None,
        model: str = "tiny",
    ) -> None:
        self.admin_url = admin_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.url = (url or "").rstrip("/")  # the API, for request-borne faults
        self.api_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.stopped: set[int] = set()  # pids this run stopped (continued at the end)

    async def _pid(self, client: httpx.AsyncClient, group: int, rank: int) -> int | None:
        r = await client.get(self.admin_url + "/admin/groups", headers=self.headers)
        r.raise_for_status()
        for g in r.json()["groups"]:
            if g["id"] == group:
                for rk in g["ranks"]:
                    if rk["rank"] == rank:
                        return rk["pid"]
        return None

    async def inject(self, fault: Fault, at: float) -> FaultRecord:
        async with httpx.AsyncClient(timeout=10.0) as client:
            if fault.action in REQUEST_ACTIONS:
                return await self._request(client, fault, at)
            if fault.action in SIGNALS:
                return await self._signal(client, fault, at)
            if fault.action in ENGINE_ACTIONS:
                body: dict = {"kind": fault.action, "group": fault.group}
                if fault.action == "route_skew":
                    body = {"kind": "route_skew", "expert": fault.expert}
                elif fault.action == "slow_rank":
                    body.update(rank=fault.rank, delay_s=fault.delay_s)
                elif fault.action == "corrupt":
                    body.update(rank=fault.rank)
                rec = FaultRecord(fault, at, time.time())
                r = await client.post(
                    self.admin_url + "/admin/faults", json=body, headers=self.headers
                )
            else:
                assert fault.action in GROUP_ACTIONS
                rec = FaultRecord(fault, at, time.time())
                r = await client.post(
                    f"{self.admin_url}/admin/groups/{fault.group}/{fault.action}",
                    headers=self.headers,
                )
            rec.verified = r.status_code == 200
            rec.detail = f"HTTP {r.status_code}" + ("" if rec.verified else f": {r.text[:200]}")
            return rec

    async def _signal(self, client: httpx.AsyncClient, fault: Fault, at: float) -> FaultRecord:
        assert fault.rank is not None
        pid = await self._pid(client, fault.group, fault.rank)
        rec = FaultRecord(fault, at, time.time(), pid)
        if pid is None:
            rec.detail = f"group {fault.group} has no rank {fault.rank} with a process now"
            return rec
        before = _status(pid)
        if before is None or before == psutil.STATUS_ZOMBIE:
            rec.detail = f"pid {pid} was already gone"
            return rec
        rec.wall = time.time()
        try:
            os.kill(pid, SIGNALS[fault.action])
        except ProcessLookupError:
            rec.detail = f"pid {pid} was already gone"
            return rec
        except PermissionError:
            rec.detail = f"not allowed to signal pid {pid} (run as the server's user, on its host)"
            return rec
        if fault.action == "sigkill":
            st = await _wait_status(pid, (None, psutil.STATUS_ZOMBIE))
            rec.verified = st in (None, psutil.STATUS_ZOMBIE)
        elif fault.action == "sigstop":
            st = await _wait_status(pid, (psutil.STATUS_STOPPED,))
            rec.verified = st == psutil.STATUS_STOPPED
            self.stopped.add(pid)
        else:
            st = await _wait_status(pid, RUNNING)
            rec.verified = st in RUNNING
            self.stopped.discard(pid)
        rec.detail = f"pid {pid}: {before} -> {st or 'gone'}"
        return rec

    async def _request(self, client: httpx.AsyncClient, fault: Fault, at: float) -> FaultRecord:
        """Sends the completion that carries the fault (then `repeat` identical ones) and checks
        each answer is the one the fault must get."""
        kind = REQUEST_ACTIONS[fault.action]
        body = {"model": self.model, "prompt": REQUEST_PROMPT, "max_tokens": 4}
        body |= {"temperature": 0, "safeserve_fault": kind}
        want = REQUEST_EXPECTED[kind]
        rec = FaultRecord(fault, at, time.time())
        got: list[tuple[int, str | None]] = []
        for _ in range(1 + fault.repeat):
            r = await client.post(
                self.url + "/v1/completions",
                json=body,
                headers=self.api_headers,
                timeout=REQUEST_TIMEOUT_S,
            )
            code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
            got.append((r.status_code, code))
        rec.verified = bool(got) and all(g == want for g in got)
        first = f"HTTP {got[0][0]} {got[0][1] or ''}".rstrip()
        rest = sum(1 for g in got[1:] if g == want)
        rec.detail = first + (
            f"; {rest} of {fault.repeat} identical refused" if fault.repeat else ""
        )
        return rec

    def release(self) -> None:
        """Continues every process this run stopped that is still there (the server's own fence
        usually killed them already)."""
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stopped.clear()
