"""Groups that span agents by node rank: `safeserve serve --nnodes 2` and two agents started as
peers' nodes are (`safeserve node --nnodes 2 --node-rank R --dist-init-addr HOST:PORT`, the same
address on both), each its own process tree on its own loopback address.

- The group's rank 0 is on the node-rank-0 agent and rank 1 on the node-rank-1 agent, though
  the node-rank-1 agent alone has room for the whole group (where the default placement puts
  it); the ranks meet at the given --dist-init-addr; greedy outputs through HTTP equal
  transformers'.
- The leader's agent SIGKILLed: the group is not placed on the other agent alone (its set lacks
  node-rank 0); once the agent is back the group is placed by node rank again, its rendezvous
  on the same port.

Placement rules without processes: `test_span_placement_rules`.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest
import torch
from agents import completion_ids, greedy, kill_tree, nodes_view, prompt, start_agent
from serving import admin_groups, free_port, start_server, stop_server
from transformers import AutoModelForCausalLM

from safeserve.config import ServerArgs
from safeserve.messages import NodeBeat, RankExited, StopRanks
from safeserve.server.nodes import Node, NodeHub, PlacementError, RemoteLink, RemoteRank
from safeserve.wire import keys

TOKENS = 12
LEADER_HOST = "127.0.0.5"  # node-rank 0's address: the rendezvous
# node id -> (its address, its devices: CPU rank slots, its node rank); node-rank 1 has room
# for both ranks
AGENTS = {"n1": ("127.0.0.4", "0,1", 1), "n0": (LEADER_HOST, "0", 0)}


def _start(node: str, node_port: int, key_dir: Path, addr: str, log: Path):  # type: ignore[no-untyped-def]
    host, devices, rank = AGENTS[node]
    span = ["--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", addr]
    return start_agent(node, node_port, key_dir, log, host, devices, *span)


@pytest.fixture(scope="module")
def span(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A frontend (--nnodes 2: one group of two ranks, alltoall, float32) and its two agents;
    yields (server, agents, key dir, node port, rendezvous address, log dir)."""
    d = tmp_path_factory.mktemp("nnodes")
    key_dir = d / "keys"
    keys.generate(key_dir)
    node_port = free_port()
    addr = f"{LEADER_HOST}:{free_port(LEADER_HOST)}"
    agents = {n: _start(n, node_port, key_dir, addr, d / f"node-{n}.log") for n in AGENTS}
    args = ["--model", str(checkpoint), "--dtype", "float32", "--placement", "remote"]
    args += ["--curve-keys-dir", str(key_dir), "--node-port", str(node_port), "--nnodes", "2"]
    args += ["--num-groups", "1", "--tp-size", "2", "--moe-a2a-backend", "alltoall"]
    args += ["--restart-backoff-s", "0.5", "--max-model-len", "512"]
    s = None
    try:
        s = start_server(args, d / "server.log", timeout=180)
        yield s, agents, key_dir, node_port, addr, d
    finally:
        if s is not None:
            stop_server(s.proc)
        for p in agents.values():
            kill_tree(p)


def _placed(s) -> dict[str, list[tuple[int, int]]]:  # type: ignore[no-untyped-def]
    """node -> its (group, rank) pairs."""
    return {n["id"]: [(r["group"], r["rank"]) for r in n["ranks"]] for n in nodes_view(s)["nodes"]}


def _check_span(s, addr: str) -> None:  # type: ignore[no-untyped-def]
    view = nodes_view(s)
    assert view["nnodes"] == 2
    assert _placed(s) == {"n0": [(0, 0)], "n1": [(0, 1)]}, view
    by_id = {n["id"]: n for n in view["nodes"]}
    for node, (_, _, rank) in AGENTS.items():
        n = by_id[node]
        # the set is the agents' --dist-init-addr (no --node-set given)
        assert (n["node_set"], n["node_rank"], n["nnodes"]) == (addr, rank, 2), n
        assert n["takes_no_group"] is None
        assert [r["rendezvous"] for r in n["ranks"]] == [f"tcp://{addr}"]
    (g,) = admin_groups(s)
    assert g["state"] == "READY" and [r["node"] for r in g["ranks"]] == ["n0", "n1"]
    host, _, port = addr.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5):  # rank 0's store listens there
        pass


def test_a_group_spans_agents_by_node_rank_and_meets_at_dist_init_addr(
    span, checkpoint: Path
) -> None:  # type: ignore[no-untyped-def]
    s, agents, key_dir, node_port, addr, d = span
    _check_span(s, addr)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for i in range(2):
        group, ids = completion_ids(s, str(checkpoint), prompt(i), TOKENS)
        assert (group, ids) == (0, greedy(hf, prompt(i), TOKENS)), i


def test_a_set_without_its_leader_takes_no_group_until_it_is_back(span, checkpoint: Path) -> None:  # type: ignore[no-untyped-def]
    s, agents, key_dir, node_port, addr, d = span
    kill_tree(agents["n0"])
    deadline = time.monotonic() + 10
    while next(n for n in nodes_view(s)["nodes"] if n["id"] == "n0")["state"] != "LOST":
        assert time.monotonic() < deadline, nodes_view(s)
        time.sleep(0.1)
    # n1 alone has room for both ranks, but it is node-rank 1: the group waits for node-rank 0
    time.sleep(3)
    assert _placed(s)["n1"] == [], nodes_view(s)
    assert admin_groups(s)[0]["state"] != "READY"
    agents["n0"] = _start("n0", node_port, key_dir, addr, d / "node-n0-2.log")
    deadline = time.monotonic() + 90
    while admin_groups(s)[0]["state"] != "READY":
        assert time.monotonic() < deadline, admin_groups(s)
        time.sleep(0.2)
    _check_span(s, addr)  # by node rank again, at the same rendezvous port
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert completion_ids(s, str(checkpoint), prompt(3), TOKENS)[1] == greedy(hf, prompt(3), TOKENS)
    assert httpx.get(s.url + "/ready", timeout=5).status_code == 200


# -- placement rules, without processes ---------------------------------------------------------
def test_span_placement_rules() -> None:
    args = ServerArgs(placement="remote", insecure_nodes=True, node_port=free_port())
    hub = NodeHub(args)
    try:
        hub.args = ServerArgs(
            placement="remote", insecure_nodes=True, node_port=args.node_port, nnodes=2, tp_size=4
        )

        def node(name: str, devices: int, node_set: str | None, rank: int | None, nnodes=None):  # type: ignore[no-untyped-def]
            n = Node(name, name, "h", list(range(devices)), 1, name.encode(), node_set=node_set)
            n.node_rank, n.nnodes = rank, nnodes
            hub.nodes[name] = n
            return n

        lone = node("a-lone", 8, None, None)  # room for everything, but no node rank
        with pytest.raises(PlacementError, match="no set of 2 node agents"):
            hub._choose(4, 2)
        assert "no --node-rank" in (hub.span_refusal(lone) or "")
        # set x: node-rank 1 listed first, both with room: block k on node-rank k
        x1, x0 = node("x-1", 4, "x", 1), node("x-0", 2, "x", 0)
        assert [(n.node_id, d) for n, d in hub._choose(4, 2)] == [
            ("x-0", 0),
            ("x-0", 1),
            ("x-1", 0),
            ("x-1", 1),
        ]
        # set y has fewer free devices: it is taken first (the tightest fit)
        node("y-0", 2, "y", 0)
        node("y-1", 2, "y", 1)
        assert {n.node_set for n, _ in hub._choose(4, 2)} == {"y"}
        x0.used = {0: (0, 0)}  # x-0 lacks room now; y still fits
        assert {n.node_set for n, _ in hub._choose(4, 2)} == {"y"}
        # a second node-rank 0 in y, or one of another --nnodes: y is out
        twin = node("y-0b", 2, "y", 0)
        assert "also y-0" in (hub.span_refusal(twin) or "")
        with pytest.raises(PlacementError, match="y: node-rank 0 y-0"):
            hub._choose(4, 2)
        twin.lost = "gone"
        hub.nodes["y-1"].nnodes = 4
        assert "--nnodes 4" in (hub.span_refusal(hub.nodes["y-1"]) or "")
        with pytest.raises(PlacementError):
            hub._choose(4, 2)
        # --nnodes 1: one agent, the tightest that fits; node ranks do not matter
        assert {n.node_id for n, _ in hub._choose(4, 1)} == {"x-1"}
        # no --nnodes: today's rule (one agent where one fits)
        assert {n.node_id for n, _ in hub._choose(8, None)} == {"a-lone"}
        assert x1.node_rank == 1
    finally:
        hub._monitor.close(linger=0)
        hub._sock.close(linger=0)
        hub._ctx.term()


def test_links_of_released_incarnations_are_forgotten_once_their_ranks_are_gone() -> None:
    """One link per group incarnation: dropped once released with no rank running (every rank
    exited, or its node lost), kept while one still runs; an agent that still reports a
    forgotten incarnation is told to stop it, as a fenced one."""
    args = ServerArgs(placement="remote", insecure_nodes=True, node_port=free_port())
    hub = NodeHub(args)
    sent: list[tuple[str, object]] = []
    hub.send = lambda node, msg, *a: sent.append((node.node_id, msg))  # type: ignore[method-assign]
    try:
        a = hub.nodes["a"] = Node("a", "a", "h", [0, 1], 1, b"a")
        b = hub.nodes["b"] = Node("b", "b", "h", [0], 1, b"b")

        def placed(group: int, incarnation: int, where: list[tuple[Node, int]]) -> RemoteLink:
            link = RemoteLink(hub, group, incarnation)
            link.ranks = [RemoteRank(r, n, d) for r, (n, d) in enumerate(where)]
            for n, d in where:
                n.used[d] = (group, incarnation)
            hub.links[(group, incarnation)] = link
            return link

        first = placed(0, 1, [(a, 0), (a, 1)])
        first.stop()  # released, both ranks still running
        assert (0, 1) in hub.links and a.used == {}
        hub._rank_exited(a, RankExited(0, 1, 0, 100, -9))
        assert (0, 1) in hub.links  # rank 1 still runs: its exit must still be heard
        hub._rank_exited(a, RankExited(0, 1, 1, 101, -9))
        assert (0, 1) not in hub.links
        # an exit heard before the release: dropped at the release
        second = placed(0, 2, [(a, 0)])
        hub._rank_exited(a, RankExited(0, 2, 0, 102, 1))
        assert (0, 2) in hub.links  # its group has not let it go yet
        second.stop()
        assert (0, 2) not in hub.links
        # a lost node: its ranks count as gone
        third = placed(1, 1, [(b, 0)])
        third.stop()
        assert (1, 1) in hub.links
        hub._lose(b, "lease expired")
        assert (1, 1) not in hub.links
        # a running incarnation is kept; a forgotten one an agent reports is stopped
        running = placed(0, 3, [(a, 0)])
        sent.clear()
        hub._beat(a, NodeBeat("a", 0.0, [(0, 1), (0, 3)]))
        stops = [m for _, m in sent if isinstance(m, StopRanks)]
        assert [(m.group, m.incarnation) for m in stops] == [(0, 1)]
        assert hub.links[(0, 3)] is running
    finally:
        hub._monitor.close(linger=0)
        hub._sock.close(linger=0)
        hub._ctx.term()
