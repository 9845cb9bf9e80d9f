"""Groups on node agents (`--placement remote`), each agent a separate process tree whose ranks
rendezvous on its own loopback address (127.0.0.1, .2, .3 stand for three hosts), everything
between the frontend and the agents over CurveZMQ in the typed encoding.

- A frontend and three agents; two groups of 2 ranks, one on one agent, the other spanning the
  two others: greedy outputs through HTTP equal transformers' (what the local placement serves).
- Node loss: an agent and its ranks SIGKILLed while greedy streams run: the node is found lost
  within 2 s, the other group serves on, every stream completes with the unfaulted text (none
  lost, none repeated), and the group is READY again within 60 s of the agent's return.
- Security: a client without an authorized key registers nothing and is counted; the admin API
  lists the nodes; `--placement remote` without keys refuses to start.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import zmq
from agents import completion_ids, greedy, kill_tree, nodes_view, prompt, start_agent
from serving import (
    admin_groups,
    free_port,
    greedy_streams_under_fault,
    metric,
    oncall,
    start_server,
    stop_server,
)
from transformers import AutoModelForCausalLM

from safeserve import messages as m
from safeserve.chaos.proxy import TcpProxy
from safeserve.wire import codec, keys

N, TOKENS = 6, 20
# node id -> (the address its ranks rendezvous on, its devices: CPU rank slots)
NODES = {"a": ("127.0.0.1", "0,1"), "b": ("127.0.0.2", "0"), "c": ("127.0.0.3", "0")}


def _greedy(hf, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    return greedy(hf, ids, TOKENS)


def _agent(node: str, port: int, key_dir: Path, log: Path) -> subprocess.Popen:
    """Agent `node`, reaching the frontend at `port` (its own proxy's)."""
    return start_agent(node, port, key_dir, log, *NODES[node])


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A frontend (two groups of two ranks, alltoall, float32) and three agents; yields
    (server, agents by node id, key dir, node port, log dir); stops them all."""
    d = tmp_path_factory.mktemp("nodes")
    key_dir = d / "keys"
    keys.generate(key_dir)
    node_port = free_port()
    # every agent reaches the frontend through its own proxy: a partition cuts one node off
    proxies = {n: TcpProxy(("127.0.0.1", node_port)) for n in NODES}
    agents = {n: _agent(n, proxies[n].port, key_dir, d / f"node-{n}.log") for n in NODES}
    args = ["--model", str(checkpoint), "--dtype", "float32", "--placement", "remote"]
    args += ["--curve-keys-dir", str(key_dir), "--node-port", str(node_port)]
    args += ["--num-groups", "2", "--tp-size", "2", "--moe-a2a-backend", "alltoall"]
    args += ["--node-lease-s", "3", "--restart-backoff-s", "0.5", "--max-model-len", "512"]
    s = None
    try:
        s = start_server(args, d / "server.log", timeout=180)
        deadline = time.monotonic() + 120
        while not all(g["state"] == "READY" for g in admin_groups(s)):
            assert time.monotonic() < deadline, admin_groups(s)
            time.sleep(0.2)
        yield s, agents, key_dir, node_port, d, proxies
    finally:
        if s is not None:
            stop_server(s.proc)
        for p in agents.values():
            kill_tree(p)
        for x in proxies.values():
            x.close()


def test_groups_on_agents_serve_transformers_greedy(cluster, checkpoint: Path) -> None:  # type: ignore[no-untyped-def]
    s, agents, *_ = cluster
    view = nodes_view(s)
    assert view["placement"] == "remote"
    placed = {n["id"]: [(r["group"], r["device"]) for r in n["ranks"]] for n in view["nodes"]}
    # one group on node a (both its slots), the other spanning b and c
    groups_on = {n: {g for g, _ in rs} for n, rs in placed.items()}
    assert len(placed["a"]) == 2 and len(groups_on["a"]) == 1
    spanning = (groups_on["b"] | groups_on["c"]).pop()
    assert groups_on["b"] == groups_on["c"] == {spanning} != groups_on["a"]
    # every rank's node, as the groups view shows it
    for g in admin_groups(s):
        nodes = {r["node"] for r in g["ranks"]}
        assert nodes == ({"b", "c"} if g["id"] == spanning else {"a"})
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    seen = set()
    for i in range(N):  # equal groups take turns: both answer (X-Safeserve-Group says which)
        group, ids = completion_ids(s, str(checkpoint), prompt(i), TOKENS)
        seen.add(group)
        assert ids == _greedy(hf, prompt(i)), i
    assert seen == {0, 1}


def test_node_loss_costs_its_group_only_and_no_request(cluster, checkpoint: Path) -> None:  # type: ignore[no-untyped-def]
    s, agents, key_dir, node_port, d, proxies = cluster
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ref = [_greedy(hf, prompt(i)) for i in range(N)]
    victim = "b"  # holds a rank of the spanning group
    spanning = next(
        r["group"] for n in nodes_view(s)["nodes"] if n["id"] == victim for r in n["ranks"]
    )
    killed_at: list[float] = []

    def fault(running: dict[int, int]) -> None:
        killed_at.append(time.monotonic())
        kill_tree(agents[victim])

    results = asyncio.run(
        greedy_streams_under_fault(
            s.url, str(checkpoint), [prompt(i) for i in range(N)], TOKENS, fault
        )
    )
    for i, r in enumerate(results):
        assert not r["errors"], r["errors"]
        assert r["ids"] == ref[i], i  # nothing lost, nothing repeated
    # the lost node's requests moved on together: a host failure makes no query-of-death suspects
    assert metric(s, "safeserve:request_migrations_total") >= 1
    assert metric(s, "safeserve:requests_suspect_cleared_total") == 0
    assert metric(s, "safeserve:requests_suspect") == 0
    _lost_by(s, victim, killed_at[0] + nodes_view(s)["lease_s"] + 1.0)
    (g,) = [g for g in admin_groups(s) if g["id"] == spanning]
    assert g["failures"] >= 1
    other = 1 - spanning
    assert next(x for x in admin_groups(s) if x["id"] == other)["state"] == "READY"
    # the on-call view: the node LOST, and the runbook its group's verdict points to
    listing = oncall(s, "get", "nodes").stdout
    row = next(line for line in listing.splitlines() if line.startswith(victim + " "))
    assert "LOST" in row
    described = oncall(s, "describe", "node", victim)
    assert described.returncode == 0, described.stderr
    assert "Runbook:     node-lost" in described.stdout
    assert "node-lost" in oncall(s, "describe", "group", str(spanning)).stdout
    assert oncall(s, "describe", "node", "nosuch").returncode == 1
    # the node comes back: the group is READY again within 60 s
    agents[victim] = _agent(victim, proxies[victim].port, key_dir, d / f"node-{victim}-2.log")
    back = time.monotonic()
    while next(x for x in admin_groups(s) if x["id"] == spanning)["state"] != "READY":
        assert time.monotonic() - back < 60, admin_groups(s)
        time.sleep(0.2)
    assert next(n for n in nodes_view(s)["nodes"] if n["id"] == victim)["state"] == "READY"


def test_node_loss_is_detected_within_2_s(cluster) -> None:  # type: ignore[no-untyped-def]
    s, agents, key_dir, node_port, d, proxies = cluster
    victim = "c"
    kill_tree(agents[victim])
    killed = time.monotonic()
    while next(n for n in nodes_view(s)["nodes"] if n["id"] == victim)["state"] != "LOST":
        assert time.monotonic() - killed < 2.0
        time.sleep(0.05)
    agents[victim] = _agent(victim, proxies[victim].port, key_dir, d / f"node-{victim}-3.log")
    deadline = time.monotonic() + 60
    while not all(g["state"] == "READY" for g in admin_groups(s)):
        assert time.monotonic() < deadline, admin_groups(s)
        time.sleep(0.2)


def _placement(s) -> dict[str, set[int]]:  # type: ignore[no-untyped-def]
    """node -> the groups it runs ranks of."""
    return {n["id"]: {r["group"] for r in n["ranks"]} for n in nodes_view(s)["nodes"]}


def _rank_pids(s, group: int) -> list[int]:  # type: ignore[no-untyped-def]
    (g,) = [g for g in admin_groups(s) if g["id"] == group]
    return [r["pid"] for r in g["ranks"]]


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def _wait_ready(s, within: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not all(g["state"] == "READY" for g in admin_groups(s)):
        assert time.monotonic() < deadline, admin_groups(s)
        time.sleep(0.2)
    assert all(n["state"] == "READY" for n in nodes_view(s)["nodes"]), nodes_view(s)


def _lost_by(s, victim: str, deadline: float) -> dict:  # type: ignore[no-untyped-def]
    """`victim`'s node view once it is LOST, asserting that happens by `deadline` (monotonic):
    a group's own watchdog can fail it and move its streams on before the node's lease ends."""
    while True:
        node = next(n for n in nodes_view(s)["nodes"] if n["id"] == victim)
        if node["state"] == "LOST":
            return node
        assert time.monotonic() < deadline, node
        time.sleep(0.05)


def _streams_through(s, checkpoint: Path, victim: str, fault) -> list[int]:  # type: ignore[no-untyped-def]
    """With every group READY: the rank pids of `victim`'s group, then N greedy streams with
    `fault` done once they run; each checked against transformers (none lost or repeated: a
    faulted group returns nothing more)."""
    _wait_ready(s, 60)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ref = [_greedy(hf, prompt(i)) for i in range(N)]
    (group,) = _placement(s)[victim]
    pids = _rank_pids(s, group)
    prompts = [prompt(i) for i in range(N)]
    results = asyncio.run(
        greedy_streams_under_fault(s.url, str(checkpoint), prompts, TOKENS, fault)
    )
    for i, r in enumerate(results):
        assert not r["errors"], r["errors"]
        assert r["ids"] == ref[i], i
    return pids


def test_partition_costs_one_group_and_its_ranks_stop_by_the_lease(
    cluster, checkpoint: Path
) -> None:  # type: ignore[no-untyped-def]
    s, agents, key_dir, node_port, d, proxies = cluster
    victim = "b"
    cut_at: list[float] = []

    def fault(running: dict[int, int]) -> None:
        cut_at.append(time.monotonic())
        proxies[victim].partition()

    pids = _streams_through(s, checkpoint, victim, fault)
    lease = nodes_view(s)["lease_s"]
    node = _lost_by(s, victim, cut_at[0] + lease + 1.0)
    assert "lease" in node["lost_reason"], node
    # the cut-off group's ranks are gone by the lease deadline: the agent stops its own, the
    # frontend's fence stops those on the other node
    while not _gone(pids):
        assert time.monotonic() < cut_at[0] + lease + 1.0, pids
        time.sleep(0.05)
    proxies[victim].heal()
    _wait_ready(s, 60)


def test_frozen_node_costs_one_group_and_its_ranks_stop_when_it_thaws(
    cluster, checkpoint: Path
) -> None:  # type: ignore[no-untyped-def]
    s, agents, key_dir, node_port, d, proxies = cluster
    victim = "a"
    _wait_ready(s, 60)  # every rank of the victim's tree started
    tree = [agents[victim].pid] + [
        c.pid for c in psutil.Process(agents[victim].pid).children(recursive=True)
    ]
    stopped_at: list[float] = []

    def fault(running: dict[int, int]) -> None:
        stopped_at.append(time.monotonic())
        for pid in tree:
            os.kill(pid, signal.SIGSTOP)

    try:
        pids = _streams_through(s, checkpoint, victim, fault)
        _lost_by(s, victim, stopped_at[0] + nodes_view(s)["lease_s"] + 1.0)
    finally:
        thawed = time.monotonic()
        for pid in tree:
            os.kill(pid, signal.SIGCONT)
    # thawed past its lease, the agent stops its ranks at once (none of their tokens counts)
    while not _gone(pids):
        assert time.monotonic() < thawed + 2.0, pids
        time.sleep(0.05)
    _wait_ready(s, 60)


def test_a_client_without_the_keys_registers_nothing(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    s, agents, key_dir, node_port, d, proxies = cluster
    other = tmp_path / "other"
    keys.generate(other)
    stranger = keys.load(other, keys.NODE)
    front = keys.load(key_dir, keys.FRONTEND)
    before = sum(nodes_view(s)["refused"].values())
    ctx = zmq.Context()
    try:
        socks = []
        for k in (keys.CurveKeys(stranger.public, stranger.secret, server_public=front.public),):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            keys.secure_client(sock, k)
            sock.connect(f"tcp://127.0.0.1:{node_port}")
            socks.append(sock)
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(f"tcp://127.0.0.1:{node_port}")
        socks.append(plain)
        for sock in socks:
            sock.send_multipart(
                codec.Writer().frames(m.NodeHello("evil", "x", "127.0.0.9", [0], 1))
            )
        deadline = time.monotonic() + 10
        while sum(nodes_view(s)["refused"].values()) < before + 2:
            assert time.monotonic() < deadline, nodes_view(s)
            time.sleep(0.1)
        assert "evil" not in {n["id"] for n in nodes_view(s)["nodes"]}
        for sock in socks:
            sock.close(linger=0)
    finally:
        ctx.term()


def test_remote_placement_without_keys_refuses_to_start(checkpoint: Path) -> None:
    cmd = [sys.executable, "-m", "safeserve.cli", "serve", "--placement", "remote"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--curve-keys-dir" in r.stderr and "--insecure-nodes" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
