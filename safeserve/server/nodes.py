"""The frontend's side of the node agents (`--placement remote`).

Agents (`safeserve node`, `node/agent.py`) connect to one ROUTER socket on
`--node-host:--node-port` (CurveZMQ: only authorized keys get through; `wire/keys.py`), say
who they are (`NodeHello`) and beat (`NodeBeat`); every beat is answered with a lease
(`NodeLease`). The hub places each group incarnation's ranks on the agents' free devices (on one
agent where one has room, else spread over several), relays the group's messages both ways in
the typed encoding (`wire/codec.py`), and hands each incarnation a `RemoteLink`, the
`GroupClient`'s view of its ranks: their processes as the agents report them, their outputs and
heartbeats. With `--nnodes N` every group spans exactly N agents of one set (the agents' own
`--node-set`, `--node-rank`), its k-th block of ranks on node-rank k: rank 0 on node-rank 0,
whose agent opens the group's rendezvous (its `--dist-init-addr`).

A node is lost when it has not beaten for `--node-lease-s`, or, sooner, when a connection
dropped and it has not beaten since (noticed within two beats). Its ranks count as gone; their
group's watchdog fences the group (`dead`), and the agent, whose lease lapses at the same
deadline, stops the ranks by itself. A lost node that beats again is back: its old
incarnations are stopped (already, by its lease) and it offers its devices anew. Outputs of an
incarnation that is fenced are dropped: a group cut off by a partition can never return tokens
for a request that has moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from safeserve.config import ServerArgs
from safeserve.messages import (
    Heartbeat,
    NodeBeat,
    NodeHello,
    NodeLease,
    RankExited,
    RanksSpawned,
    SpawnRanks,
    StopRanks,
)
from safeserve.wire import codec, keys

logger = logging.getLogger(__name__)

BEAT_S = 0.25  # how often agents beat (they are told nothing else: it is their default too)


class PlacementError(RuntimeError):
    """No agent has room, or an agent did not answer a spawn."""


@dataclass
class Node:
    """One connected agent."""

    node_id: str
    agent_id: str
    host: str
    devices: list[int]
    pid: int
    identity: bytes  # its ZeroMQ routing id
    last_beat: float = field(default_factory=time.monotonic)
    connected_at: float = field(default_factory=time.time)
    lost: str | None = None  # why it is lost (None: alive)
    lost_at: float | None = None  # time.time() it was found lost (chaos runs time detection)
    # devices in use: device -> (group, incarnation)
    used: dict[int, tuple[int, int]] = field(default_factory=dict)
    # its place in a set of agents groups span (NodeHello); None: not given
    node_set: str | None = None
    node_rank: int | None = None
    nnodes: int | None = None
    dist_init_addr: str | None = None

    @property
    def free(self) -> list[int]:
        return [d for d in self.devices if d not in self.used]


class RemoteRank:
    """A rank process on an agent, as the agent reports it (the process API GroupClient's
    watchdog reads: `is_alive`, `exitcode`, `pid`)."""

    def __init__(self, rank: int, node: Node, device: int) -> None:
        self.rank, self.node, self.device = rank, node, device
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.exited = False

    def is_alive(self) -> bool:
        return not self.exited and self.node.lost is None

    @property
    def lost(self) -> str | None:
        """Why the rank counts as gone without an exit report: its node is lost."""
        return None if self.exited else self.node.lost


class RemoteLink:
    """One group incarnation's ranks on the agents, and its messages."""

    def __init__(self, hub: NodeHub, group: int, incarnation: int) -> None:
        self.hub, self.group, self.incarnation = hub, group, incarnation
        self.ranks: list[RemoteRank] = []
        self.outputs: asyncio.Queue[object] = asyncio.Queue()
        self.heartbeats: asyncio.Queue[Heartbeat] = asyncio.Queue()
        self.fenced = False  # outputs from here on are dropped
        self.released = False  # its devices given back (`NodeHub.release`)
        self.leader: Node | None = None
        self.init_method: str | None = None  # the rendezvous rank 0's agent opened

    def send(self, msg: object) -> None:
        """To the group's leader, through its agent (never blocks; dropped when it cannot go)."""
        if self.leader is not None and self.leader.lost is None:
            self.hub.send(self.leader, msg, self.group, self.incarnation)

    def stop(self, grace_s: float = 0.0) -> None:
        """Asks every agent holding ranks of the incarnation to stop them; frees their devices."""
        self.fenced = grace_s == 0.0 or self.fenced
        for node in {id(r.node): r.node for r in self.ranks}.values():
            if node.lost is None:
                self.hub.send(node, StopRanks(self.group, self.incarnation, grace_s))
        self.hub.release(self)

    async def wait_exited(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(r.is_alive() for r in self.ranks) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


class NodeHub:
    def __init__(self, args: ServerArgs, on_change: Callable[[], None] | None = None) -> None:
        self.args = args
        self.on_change = on_change or (lambda: None)
        self.nodes: dict[str, Node] = {}
        self.links: dict[tuple[int, int], RemoteLink] = {}
        self.reader = codec.Reader()
        self.writer = codec.Writer()
        self.handshakes: Counter[str] = Counter()
        self._spawned: dict[tuple[int, int, str], asyncio.Future[RanksSpawned]] = {}
        self._ctx = zmq.asyncio.Context()
        self._auth = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable peer raises, not hangs
        if args.curve_keys_dir:
            from pathlib import Path

            k = keys.load(Path(args.curve_keys_dir), keys.FRONTEND)
            self._auth = keys.start_authenticator(self._ctx, k)
            keys.secure_server(self._sock, k)
        else:
            logger.warning(
                "--insecure-nodes: node agents connect to %s:%d without authentication; "
                "anyone who reaches that port can run ranks and read the traffic",
                args.node_host,
                args.node_port,
            )
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        self._sock.bind(f"tcp://{args.node_host}:{args.node_port}")
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._receive()),
            asyncio.create_task(self._watch_connections()),
            asyncio.create_task(self._watch_leases()),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for link in list(self.links.values()):
            link.stop()
        await asyncio.sleep(0.1)  # the stops leave before the socket closes
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # -- sending --------------------------------------------------------------------------------
    def send(self, node: Node, msg: object, group: int = -1, incarnation: int = -1) -> None:
        frames = self.writer.frames(msg, group, incarnation)
        try:
            self._sock.send_multipart([node.identity, *frames], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # gone, or not connected (yet): the lease decides its fate
            logger.debug("node %s: %s not sent: %s", node.node_id, type(msg).__name__, e)

    # -- placement ------------------------------------------------------------------------------
    def free_devices(self) -> int:
        return sum(len(n.free) for n in self.nodes.values() if n.lost is None)

    async def wait_for_room(
        self, tp: int, nnodes: int | None, timeout: float
    ) -> list[tuple[Node, int]]:
        """(node, device) per rank once the agents have room for a group (`_choose`), waiting
        up to `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._choose(tp, nnodes)
            except PlacementError as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PlacementError(f"{e} after {timeout:g} s") from None
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))

    def _choose(self, tp: int, nnodes: int | None = None) -> list[tuple[Node, int]]:
        """(node, device) per rank. Without --nnodes: one node with room for the whole group
        where there is one (the one with the fewest free devices that fits), else the nodes
        with the most free devices first; ties by node id. With it, `_choose_span`."""
        if nnodes is not None:
            return self._choose_span(tp, nnodes)
        alive = [n for n in self.nodes.values() if n.lost is None and n.free]
        if self.free_devices() < tp:
            raise PlacementError(
                f"{tp} free devices needed, {self.free_devices()} offered by "
                f"{sum(n.lost is None for n in self.nodes.values())} node agents"
            )
        fits = sorted(
            (n for n in alive if len(n.free) >= tp), key=lambda n: (len(n.free), n.node_id)
        )
        if fits:
            return [(fits[0], d) for d in fits[0].free[:tp]]
        out: list[tuple[Node, int]] = []
        for n in sorted(alive, key=lambda n: (-len(n.free), n.node_id)):
            out += [(n, d) for d in n.free[: tp - len(out)]]
            if len(out) == tp:
                return out
        raise PlacementError(f"no room for {tp} ranks on the node agents")

    def _choose_span(self, tp: int, nnodes: int) -> list[tuple[Node, int]]:
        """--nnodes N: tp / N ranks on each of N agents. N = 1: one agent, the one with the
        fewest free devices that fits. N > 1: the agents of one set with node-ranks 0..N-1
        (one live agent each, none announcing another --nnodes), block k of the ranks on
        node-rank k; of the sets with room, the one with the fewest free devices (ties by
        name)."""
        per = tp // nnodes
        alive = [n for n in self.nodes.values() if n.lost is None and n.nnodes in (None, nnodes)]
        if nnodes == 1:
            fits = sorted(
                (n for n in alive if len(n.free) >= tp), key=lambda n: (len(n.free), n.node_id)
            )
            if not fits:
                raise PlacementError(f"no node agent with {tp} free devices (--nnodes 1)")
            return [(fits[0], d) for d in fits[0].free[:tp]]
        sets: dict[str, dict[int, list[Node]]] = {}
        for n in alive:
            if n.node_rank is not None and n.node_rank < nnodes:
                sets.setdefault(n.node_set or "", {}).setdefault(n.node_rank, []).append(n)
        room = []
        for name, ranks in sets.items():
            members = [ranks.get(k, []) for k in range(nnodes)]
            if all(len(m) == 1 and len(m[0].free) >= per for m in members):
                room.append((sum(len(m[0].free) for m in members), name, [m[0] for m in members]))
        if not room:
            seen = "; ".join(
                f"{name or '(unnamed)'}: "
                + ", ".join(
                    f"node-rank {k} {'+'.join(n.node_id for n in ns)} ({len(ns[0].free)} free)"
                    for k, ns in sorted(ranks.items())
                )
                for name, ranks in sorted(sets.items())
            )
            raise PlacementError(
                f"no set of {nnodes} node agents (--node-rank 0..{nnodes - 1}, one live agent "
                f"each) with {per} free devices each; sets: {seen or 'none'}"
            )
        _, _, members = min(room, key=lambda x: (x[0], x[1]))
        return [(m, d) for m in members for d in m.free[:per]]

    def span_refusal(self, node: Node) -> str | None:
        """Why a node takes no group under --nnodes (None: it may)."""
        want = self.args.nnodes
        if want is None or want == 1 and node.nnodes in (None, 1):
            return None
        if node.nnodes not in (None, want):
            return f"it says --nnodes {node.nnodes}, the frontend's is {want}"
        if node.node_rank is None:
            return f"it has no --node-rank (the frontend's --nnodes is {want})"
        if node.node_rank >= want:
            return f"its --node-rank {node.node_rank} is not below the frontend's --nnodes {want}"
        twins = [
            n.node_id
            for n in self.nodes.values()
            if n is not node
            and n.lost is None
            and n.node_set == node.node_set
            and n.node_rank == node.node_rank
        ]
        if twins:
            return f"node-rank {node.node_rank} of its set is also {', '.join(sorted(twins))}"
        return None

    async def place(self, group: int, incarnation: int, args: ServerArgs) -> RemoteLink:
        """Spawns the incarnation's ranks on the agents (waiting up to --node-wait-s for free
        devices); returns its link once every agent has answered."""
        chosen = await self.wait_for_room(args.tp_size, args.nnodes, args.node_wait_s)
        link = RemoteLink(self, group, incarnation)
        link.ranks = [RemoteRank(r, node, dev) for r, (node, dev) in enumerate(chosen)]
        link.leader = chosen[0][0]
        for node, dev in chosen:
            node.used[dev] = (group, incarnation)
        self.links[(group, incarnation)] = link
        flags = {k: v for k, v in args.to_dict().items()}
        by_node: dict[str, list[RemoteRank]] = {}
        for r in link.ranks:
            by_node.setdefault(r.node.node_id, []).append(r)
        order = sorted(by_node, key=lambda nid: by_node[nid][0].rank)  # rank 0's node first
        init_method: str | None = None
        try:
            for nid in order:
                ranks = by_node[nid]
                node = ranks[0].node
                key = (group, incarnation, nid)
                fut: asyncio.Future[RanksSpawned] = asyncio.get_running_loop().create_future()
                self._spawned[key] = fut
                msg = SpawnRanks(
                    group,
                    incarnation,
                    [r.rank for r in ranks],
                    [r.device for r in ranks],
                    init_method,
                    flags,
                )
                self.send(node, msg)
                try:
                    done = await asyncio.wait_for(fut, 30.0)
                except TimeoutError:
                    raise PlacementError(f"node {nid} did not start its ranks") from None
                finally:
                    self._spawned.pop(key, None)
                init_method = link.init_method = done.init_method
                for r, pid in zip(ranks, done.pids, strict=True):
                    r.pid = pid
        except BaseException:
            link.stop()
            raise
        logger.info(
            "group %d incarnation %d placed: %s; rendezvous %s",
            group,
            incarnation,
            ", ".join(f"rank {r.rank} on {r.node.node_id} device {r.device}" for r in link.ranks),
            link.init_method,
        )
        return link

    def release(self, link: RemoteLink) -> None:
        for r in link.ranks:
            if r.node.used.get(r.device) == (link.group, link.incarnation):
                del r.node.used[r.device]
        link.released = True
        self._forget_if_done(link)
        self._changed.set()

    def _forget_if_done(self, link: RemoteLink) -> None:
        """Drops a released incarnation's link once none of its ranks runs (each exited, or its
        node is lost): one entry per incarnation would otherwise stay for the server's life. An
        incarnation without a link is treated as a fenced one: its messages are dropped, and an
        agent still reporting it is told to stop it."""
        if link.released and not any(r.is_alive() for r in link.ranks):
            if self.links.get((link.group, link.incarnation)) is link:
                del self.links[(link.group, link.incarnation)]

    def _rank_exited(self, node: Node, msg: RankExited) -> None:
        link = self.links.get((msg.group, msg.incarnation))
        if link is None:
            return
        for r in link.ranks:
            if r.rank == msg.rank and r.node is node:
                r.exitcode, r.exited = msg.exitcode, True
        self._forget_if_done(link)

    # -- receiving ------------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            identity, *frames = await self._sock.recv_multipart()
            try:
                env = self.reader.read(frames, identity)
            except codec.BadFrame as e:
                logger.warning("node frame refused: %s", e)
                continue
            msg = env.msg
            node = self._node_of(identity)
            if isinstance(msg, NodeHello):
                self._hello(msg, identity)
                continue
            if node is None:  # speaks before saying who it is: not a node (yet)
                self.reader.refused["unknown_sender"] += 1
                continue
            if isinstance(msg, NodeBeat):
                self._beat(node, msg)
            elif isinstance(msg, RanksSpawned):
                fut = self._spawned.get((msg.group, msg.incarnation, node.node_id))
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, RankExited):
                self._rank_exited(node, msg)
            else:  # a group's message: to its incarnation's link (a fenced one drops it)
                link = self.links.get((env.group, env.incarnation))
                if link is None or link.fenced:
                    continue
                if isinstance(msg, Heartbeat):
                    link.heartbeats.put_nowait(msg)
                else:
                    link.outputs.put_nowait(msg)

    def _node_of(self, identity: bytes) -> Node | None:
        for n in self.nodes.values():
            if n.identity == identity:
                return n
        return None

    def _hello(self, msg: NodeHello, identity: bytes) -> None:
        old = self.nodes.get(msg.node_id)
        if old is not None and old.agent_id == msg.agent_id:  # reconnected (a partition healed)
            old.identity, old.last_beat = identity, time.monotonic()
            self._back(old)
            return
        if old is not None:
            self._lose(old, "restarted (a new agent)")
        node = self.nodes[msg.node_id] = Node(
            msg.node_id,
            msg.agent_id,
            msg.host,
            list(msg.devices),
            msg.pid,
            identity,
            node_set=msg.node_set,
            node_rank=msg.node_rank,
            nnodes=msg.nnodes,
            dist_init_addr=msg.dist_init_addr,
        )
        logger.info(
            "node %s joined: host %s, devices %s, agent pid %d%s",
            msg.node_id,
            msg.host,
            msg.devices,
            msg.pid,
            ""
            if msg.node_rank is None
            else f", node-rank {msg.node_rank} of set {msg.node_set or '(unnamed)'}",
        )
        if (why := self.span_refusal(node)) is not None:
            logger.warning("node %s takes no group: %s", msg.node_id, why)
        self._changed.set()
        self.on_change()

    def _back(self, node: Node) -> None:
        """A lost node heard from again (its connection healed, or it thawed): its devices are
        offered anew; the incarnations it ran were fenced, and its lease stopped their ranks
        (any still running are stopped on its next beat)."""
        if node.lost is not None:
            logger.warning("node %s is back (was lost: %s)", node.node_id, node.lost)
            node.lost = node.lost_at = None
            node.used.clear()
        self._changed.set()
        self.on_change()

    def _beat(self, node: Node, msg: NodeBeat) -> None:
        node.last_beat = time.monotonic()
        if node.lost is not None:
            self._back(node)
        self.send(node, NodeLease(self.args.node_lease_s, msg.sent))
        # incarnations it runs that the frontend has let go of: stop them
        for group, inc in msg.groups:
            link = self.links.get((group, inc))
            if link is None or link.fenced:
                self.send(node, StopRanks(group, inc, 0.0))

    def _lose(self, node: Node, why: str) -> None:
        if node.lost is not None:
            return
        node.lost, node.lost_at = why, time.time()
        logger.error("node %s lost: %s", node.node_id, why)
        for link in list(self.links.values()):
            self._forget_if_done(link)
        self._changed.set()
        self.on_change()

    async def _watch_leases(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            for n in list(self.nodes.values()):
                if n.lost is None and now - n.last_beat > self.args.node_lease_s:
                    self._lose(n, f"no beat for {now - n.last_beat:.1f} s (lease)")

    async def _watch_connections(self) -> None:
        """A dropped connection: a node that has not beaten since within two beats is lost
        (an agent killed with its host is noticed in about half a second, not a lease)."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            kind = event["event"]
            if kind != zmq.EVENT_DISCONNECTED:
                self.handshakes[keys.HANDSHAKE_FAILED.get(kind, "handshake")] += 1
                continue
            dropped = time.monotonic()
            await asyncio.sleep(2 * BEAT_S + 0.05)
            for n in list(self.nodes.values()):
                if n.lost is None and n.last_beat < dropped:
                    self._lose(n, "its connection dropped and it has not beaten since")
