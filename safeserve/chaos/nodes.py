"""The node agents of a chaos run with a `[nodes]` table, and the node faults done to them.

`LocalNodes` writes a CurveZMQ key directory in the run's work directory, picks the frontend's
node port, and starts one `safeserve node` per node, each in its own session (its own process
tree, as on its own host) and each reaching the frontend through its own `TcpProxy`, so a
`partition` can cut one node off and leave the others be. The server it goes with is started
with `server_args()`. `stop()` ends every process it started, whole trees (a stopped tree is
continued first so it can end), and closes the proxies.

The fault primitives act on a node's whole tree as it is when the fault comes (the agent and
every rank it spawned): the agent's process and its descendants.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from safeserve.chaos.proxy import TcpProxy
from safeserve.chaos.scenario import NodeSpec
from safeserve.ports import free_port
from safeserve.wire import keys


def tree(pid: int) -> list[int]:
    """`pid` and every process below it (empty when it is gone)."""
    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class LocalNodes:
    def __init__(
        self, nodes: dict[str, NodeSpec], work_dir: Path, preexec: Callable[[], None] | None = None
    ) -> None:
        self.specs = nodes
        self.preexec = preexec  # run in each agent before exec (the runner's die_with_parent)
        self.work_dir = work_dir
        self.key_dir = work_dir / "keys"
        keys.generate(self.key_dir)
        self.node_port = free_port()
        # every agent reaches the frontend through its own proxy: a partition cuts one node off
        self.proxies = {n: TcpProxy(("127.0.0.1", self.node_port)) for n in nodes}
        self.agents: dict[str, subprocess.Popen] = {}
        self.started: list[subprocess.Popen] = []  # every agent this run started, replaced too
        self.logs: dict[str, list[Path]] = {n: [] for n in nodes}
        self.down: dict[str, str] = {}  # node -> the fault it is under (until healed)

    def server_args(self) -> list[str]:
        """What `safeserve serve` needs to take these agents."""
        return [
            "--placement",
            "remote",
            "--curve-keys-dir",
            str(self.key_dir),
            "--node-port",
            str(self.node_port),
        ]

    def start(self, node: str) -> subprocess.Popen:
        """Starts (or starts anew, with the same node id) the agent of `node`."""
        spec = self.specs[node]
        log = self.work_dir / f"node-{node}-{len(self.logs[node]) + 1}.log"
        self.logs[node].append(log)
        cmd = [sys.executable, "-m", "safeserve.cli", "node"]
        cmd += ["--frontend", f"127.0.0.1:{self.proxies[node].port}", "--node-id", node]
        cmd += ["--host", spec.host, "--devices", spec.devices]
        cmd += ["--curve-keys-dir", str(self.key_dir)]
        with log.open("w") as fh:
            p = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=self.preexec,
            )
        self.agents[node] = p
        self.started.append(p)
        return p

    def start_all(self) -> None:
        for n in self.specs:
            self.start(n)

    def tree(self, node: str) -> list[int]:
        return tree(self.agents[node].pid)

    def stop(self) -> None:
        """Ends every agent this run started and all below them; closes the proxies."""
        trees = [tree(p.pid) for p in self.started]
        for pids in trees:
            signal_all(pids, signal.SIGCONT)  # a stopped process takes no SIGTERM
            signal_all(pids, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.started:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pids in trees:
            signal_all(pids, signal.SIGKILL)
        for p in self.started:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for x in self.proxies.values():
            x.close()
