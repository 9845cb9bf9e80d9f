"""Injecting a scenario's faults, and checking that each one really took effect.

Signals go to a rank's process (its pid from `/admin/groups`, so the runner must share the
server's host); engine faults go through `POST /admin/faults`; group actions through
`POST /admin/groups/{id}/{action}`. A fault that was sent but had no effect (a pid already gone,
a process not stopped, a 404 from a server without `--enable-fault-injection`) is reported as
not verified: a chaos run that injected nothing proves nothing.

Node faults act on the agents the runner started (`nodes.py`): `node_kill` took effect when
every process of the agent's tree is gone, `node_stop` when every one is stopped, `partition`
when the node's proxy dropped bytes the agent sent (it beats every 0.25 s), `heal` when
`/admin/nodes` shows the node READY again (a restarted agent: READY with its new pid).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import psutil

from safeserve.chaos.scenario import (
    ENGINE_ACTIONS,
    GROUP_ACTIONS,
    NODE_ACTIONS,
    REQUEST_ACTIONS,
    Fault,
)

if TYPE_CHECKING:
    from safeserve.chaos.nodes import LocalNodes

SIGNALS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP, "sigcont": signal.SIGCONT}
RUNNING = (psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING, psutil.STATUS_DISK_SLEEP)
VERIFY_S = 1.0  # how long a signal may take to show (a killed process becomes a zombie at once)
# What a request-borne fault must be answered with to have done what it should: the raising one
# fails alone; the deadly one is quarantined, and so is every identical request after it.
REQUEST_EXPECTED = {"raise": (500, "internal_error"), "exit": (422, "request_quarantined")}
REQUEST_PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
REQUEST_TIMEOUT_S = 180.0  # a deadly request waits for a group holding no suspect on probation
HEAL_VERIFY_S = 60.0  # a healed node READY again in /admin/nodes (a new agent starts Python)


@dataclass
class FaultRecord:
    fault: Fault
    at: float  # seconds since the load started
    wall: float  # time.time() when it was sent (verdicts carry wall times)
    pid: int | None = None
    verified: bool = False
    detail: str = ""
    groups: list[int] | None = None  # node faults: the groups with ranks on the node then
    effect_s: float | None = None  # heal: sent -> the node READY again


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
        nodes: LocalNodes | None = None,
    ) -> None:
        self.admin_url = admin_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.url = (url or "").rstrip("/")  # the API, for request-borne faults
        self.api_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.stopped: set[int] = set()  # pids this run stopped (continued at the end)
        self.nodes = nodes  # the agents of a [nodes] run
        self.node_trees: dict[str, list[int]] = {}  # a stopped node's processes, for its heal

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
            if fault.action in NODE_ACTIONS:
                return await self._node(client, fault, at)
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

    async def node_view(self, client: httpx.AsyncClient, node: str) -> dict | None:
        r = await client.get(self.admin_url + "/admin/nodes", headers=self.headers)
        r.raise_for_status()
        return next((n for n in r.json()["nodes"] if n["id"] == node), None)

    async def _node(self, client: httpx.AsyncClient, fault: Fault, at: float) -> FaultRecord:
        """A node fault on an agent this run started, and its check."""
        assert fault.node is not None
        nodes = self.nodes
        rec = FaultRecord(fault, at, time.time())
        if nodes is None:
            rec.detail = "no node agents started by this run (a [nodes] table)"
            return rec
        node = fault.node
        view = await self.node_view(client, node)
        rec.groups = sorted({r["group"] for r in view["ranks"]}) if view else []
        agent = nodes.agents[node]
        rec.pid = agent.pid
        if fault.action == "heal":
            return await self._heal(client, rec, node)
        pids = nodes.tree(node)
        if not pids or agent.poll() is not None:
            rec.detail = f"the agent of node {node} (pid {agent.pid}) was already gone"
            return rec
        rec.wall = time.time()
        if fault.action == "partition":
            proxy = nodes.proxies[node]
            before = proxy.dropped["client"]
            proxy.partition()
            deadline = time.monotonic() + VERIFY_S
            while proxy.dropped["client"] == before and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            dropped = proxy.dropped["client"] - before
            rec.verified = dropped > 0
            rec.detail = f"link cut; {dropped} bytes from the agent dropped in the first check"
        else:
            sig = signal.SIGKILL if fault.action == "node_kill" else signal.SIGSTOP
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            want = (
                (None, psutil.STATUS_ZOMBIE)
                if fault.action == "node_kill"
                else (psutil.STATUS_STOPPED,)
            )
            states = [await _wait_status(pid, want) for pid in pids]
            rec.verified = all(st in want for st in states)
            kind = "gone" if fault.action == "node_kill" else "stopped"
            done = sum(st in want for st in states)
            rec.detail = f"{done} of {len(pids)} processes of the agent's tree {kind}"
            if fault.action == "node_stop":
                self.node_trees[node] = pids
                self.stopped.update(pids)
        nodes.down[node] = fault.action
        return rec

    async def _heal(self, client: httpx.AsyncClient, rec: FaultRecord, node: str) -> FaultRecord:
        """Undoes the node's fault, then waits for the frontend to show it READY."""
        nodes = self.nodes
        assert nodes is not None
        what = nodes.down.pop(node, None)
        rec.wall = time.time()
        new_pid = None
        if what == "node_stop":
            pids = self.node_trees.pop(node, [])
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                self.stopped.discard(pid)
            how = f"continued {len(pids)} processes"
        elif what == "partition":
            nodes.proxies[node].heal()
            how = "link healed"
        elif what == "node_kill":
            new_pid = nodes.start(node).pid
            rec.pid = new_pid
            how = f"a new agent, pid {new_pid}"
        else:
            rec.detail = f"node {node} is under no fault of this run"
            return rec
        deadline = time.monotonic() + HEAL_VERIFY_S
        view = None
        while time.monotonic() < deadline:
            view = await self.node_view(client, node)
            if (
                view is not None
                and view["state"] == "READY"
                and (new_pid is None or view["agent_pid"] == new_pid)
            ):
                rec.verified = True
                rec.effect_s = time.time() - rec.wall
                break
            await asyncio.sleep(0.1)
        state = "no such node" if view is None else view["state"]
        rec.detail = f"{how}; node {node} {state} after {time.time() - rec.wall:.2f} s"
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
