"""`safeserve chaos run`: serve (or reach) a server, offer the scenario's load, inject its faults
on time and watch; what the run observed goes to `report.py`, which builds and formats the report.

A scenario with `[nodes]` runs its groups on node agents: the runner makes a work directory
(keys, the server's and each agent's log), starts the agents (`nodes.py`) and the server with
`--placement remote`, and at the end stops the server and every agent it started.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import httpx

from safeserve.chaos.faults import FaultRecord, Injector
from safeserve.chaos.load import Load
from safeserve.chaos.nodes import LocalNodes
from safeserve.chaos.observer import Observer
from safeserve.chaos.report import build_report
from safeserve.chaos.scenario import Scenario
from safeserve.ports import free_port

PROGRESS_S = 2.0


class ServerStartError(RuntimeError):
    pass


def die_with_parent() -> None:
    """In a child before exec (Linux): SIGTERM when the process that started it dies, so a
    killed chaos run (or test) leaves no server behind; the server's ranks follow it."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class LocalServer:
    """`safeserve serve` with the scenario's arguments, in its own process group."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.log = log
        cmd = [sys.executable, "-m", "safeserve.cli", "serve", *args]
        cmd += [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--admin-port",
            str(self.admin_port),
        ]
        self.fh = log.open("w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"

    def wait_ready(self, timeout: float, progress: TextIO) -> None:
        deadline = time.monotonic() + timeout
        last = 0.0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-5:]
                raise ServerStartError(
                    f"the server exited with code {self.proc.returncode}: " + " | ".join(tail)
                )
            try:
                if httpx.get(self.url + "/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - last > 10:
                last = time.monotonic()
                print(f"[chaos] waiting for the server (log: {self.log})", file=progress)
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"the server was not ready within {timeout:.0f} s (log: {self.log})")

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.fh.close()


async def _all_ready(obs: Observer, timeout: float, progress: TextIO) -> list[dict]:
    """Waits until every group is READY: a run that starts half up measures the start-up."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            groups = await obs.groups(client)
            if groups and all(g["state"] == "READY" for g in groups):
                return groups
            if time.monotonic() > deadline:
                states = ", ".join(f"{g['id']}: {g['state']}" for g in groups)
                raise ServerStartError(f"not every group READY within {timeout:.0f} s ({states})")
            print(f"[chaos] waiting for every group READY ({len(groups)} groups)", file=progress)
            await asyncio.sleep(1.0)


async def served_model(url: str, key: str | None) -> str:
    """The model id the server at `url` serves (/v1/models)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=10.0) as c:
        r = await c.get(url + "/v1/models", headers=headers)
        r.raise_for_status()
        return r.json()["data"][0]["id"]


async def _faults(
    sc: Scenario, inj: Injector, load: Load, out: list[FaultRecord], progress: TextIO
) -> None:
    for f in sc.faults:
        await asyncio.sleep(max(0.0, f.at_s - load.now()))
        rec = await inj.inject(f, load.now())
        out.append(rec)
        state = "took effect" if rec.verified else "DID NOT take effect"
        where = f"group {f.group}" + (f" rank {f.rank}" if f.rank is not None else "")
        if f.node is not None:
            where = f"node {f.node}"
        print(f"[chaos] t={rec.at:.1f}s {f.action} {where}: {state} ({rec.detail})", file=progress)


async def _progress(
    sc: Scenario, load: Load, obs: Observer, stop: asyncio.Event, progress: TextIO
) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), PROGRESS_S)
        except TimeoutError:
            pass
        t = load.now()
        done = sum(1 for r in load.records if r.finish_reason or r.error or r.broken)
        rates, states = [], []
        if obs.samples:
            last = obs.samples[-1]
            for g in last.groups:
                r = obs.rate(g["id"], max(0.0, last.t - PROGRESS_S), last.t)
                rates.append(f"g{g['id']}={0 if r is None else r:.0f}")
                states.append(f"g{g['id']} {g['state']}")
        print(
            f"[chaos] t={t:.0f}s/{sc.load.duration_s:.0f}s sent={len(load.records)} done={done} "
            f"in-flight={load.in_flight} tok/s {' '.join(rates)} | {', '.join(states)}",
            file=progress,
        )


async def run(
    sc: Scenario,
    url: str,
    admin_url: str,
    api_key: str | None,
    admin_key: str | None,
    progress: TextIO,
    ready_timeout: float,
    nodes: LocalNodes | None = None,
) -> dict[str, Any]:
    obs = Observer(url.rstrip("/"), admin_url.rstrip("/"), admin_key, watch_nodes=nodes is not None)
    groups_before = await _all_ready(obs, ready_timeout, progress)
    model = await served_model(obs.url, api_key)
    async with httpx.AsyncClient(timeout=10.0) as c:
        before = await obs.metrics(c)
    load = Load(obs.url, sc.load, model, api_key)
    inj = Injector(obs.admin_url, admin_key, obs.url, api_key, model, nodes)
    faults: list[FaultRecord] = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    offered = (
        f"{sc.load.rate:g} requests/s (open loop)"
        if sc.load.mode == "open"
        else f"{sc.load.concurrency} streams"
    )
    print(
        f"[chaos] {sc.name}: {offered} for {sc.load.duration_s:.0f} s, {len(sc.faults)} fault(s)",
        file=progress,
    )
    poll = asyncio.create_task(obs.poll(t0, stop))
    prog = asyncio.create_task(_progress(sc, load, obs, stop, progress))
    fault_task = asyncio.create_task(_faults(sc, inj, load, faults, progress))
    try:
        await load.run(t0)
        await fault_task
    finally:
        fault_task.cancel()
        inj.release()
        await asyncio.sleep(2 * 0.25)  # a last sample after the last token
        stop.set()
        await asyncio.gather(poll, prog, return_exceptions=True)
    async with httpx.AsyncClient(timeout=10.0) as c:
        after, groups_after = await asyncio.gather(obs.metrics(c), obs.groups(c))
    reference = None
    if sc.load.reference:  # after the counters: the lone answers are not part of the load
        await _all_ready(obs, ready_timeout, progress)
        print("[chaos] sending each prompt once alone (the unfaulted reference)", file=progress)
        reference = await load.reference()
    return build_report(
        sc,
        obs,
        load.records,
        faults,
        elapsed_s=load.now(),
        before=before,
        after=after,
        groups_before=groups_before,
        groups_after=groups_after,
        reference=reference,
    )


def run_scenario(
    sc: Scenario,
    url: str | None,
    admin_url: str | None,
    api_key: str | None,
    admin_key: str | None,
    server_log: Path | None,
    extra_args: list[str],
    progress: TextIO = sys.stderr,
) -> dict[str, Any]:
    server, nodes = None, None
    try:
        if url is None:
            assert sc.server is not None
            log = server_log
            args = [*sc.server.args, *extra_args]
            if sc.nodes:
                work = Path(tempfile.mkdtemp(prefix=f"safeserve-chaos-{sc.name}-"))
                nodes = LocalNodes(sc.nodes, work, preexec=die_with_parent)
                nodes.start_all()
                args += nodes.server_args()
                log = log or work / "server.log"
                print(
                    f"[chaos] started {len(sc.nodes)} node agents ({', '.join(sc.nodes)}; "
                    f"keys and logs: {work})",
                    file=progress,
                )
            if log is None:
                fd, name = tempfile.mkstemp(prefix=f"safeserve-chaos-{sc.name}-", suffix=".log")
                os.close(fd)  # the server's own handle writes it
                log = Path(name)
            server = LocalServer(args, log)
            print(f"[chaos] starting the server (log: {log})", file=progress)
            server.wait_ready(sc.server.ready_timeout_s, progress)
            url, admin_url = server.url, server.admin_url
        assert admin_url is not None
        timeout = sc.server.ready_timeout_s if sc.server else 60.0
        report = asyncio.run(run(sc, url, admin_url, api_key, admin_key, progress, timeout, nodes))
    finally:
        if server is not None:
            server.stop()
        if nodes is not None:
            nodes.stop()
    if server is not None:
        report["server_log"] = str(server.log)
    if nodes is not None:
        report["node_logs"] = {n: [str(x) for x in logs] for n, logs in nodes.logs.items()}
    return report
