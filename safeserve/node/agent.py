"""The node agent (`safeserve node`): runs on each machine, spawns and watches the ranks the
frontend places on its devices, and relays their traffic.

One DEALER socket to the frontend (`--frontend HOST:PORT`; CurveZMQ with the keys of
`--curve-keys-dir`, typed frames of `wire/codec.py`). On every (re)connect the agent says hello,
then beats every `BEAT_S`; each beat is answered with a lease. Ranks it starts talk to it over
local IPC sockets as they would to a frontend on their own host (pickled dataclasses that never
leave the host; `engine/rank_worker.py`), and it forwards their outputs and heartbeats to the
frontend, typed, with the group incarnation's route; the frontend's requests go the other way
to the group's leader when it runs here.

The lease: when the frontend has not answered for its lease (a partition, a frontend gone), the
agent stops generating: it kills its ranks at the deadline the frontend fences them at, so a
group cut off can never serve a request the frontend has moved on. Its ranks also exit by
themselves if the agent dies (they watch their parent). It reports every rank that ends
(`RankExited`) and keeps trying to reconnect; once back, the frontend places groups on it anew.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from safeserve.config import ServerArgs
from safeserve.engine.rank_worker import GroupAddresses, run_rank
from safeserve.messages import (
    AbortRequest,
    EplbCommand,
    GenerateRequest,
    Heartbeat,
    InjectFault,
    NodeBeat,
    NodeHello,
    NodeLease,
    RankExited,
    RanksSpawned,
    Shutdown,
    SpawnRanks,
    StopRanks,
)
from safeserve.ports import free_port
from safeserve.wire import codec, keys

logger = logging.getLogger(__name__)

BEAT_S = 0.25
# What the frontend may send on to a group's leader.
_TO_LEADER = (GenerateRequest, AbortRequest, InjectFault, Shutdown, EplbCommand)


@dataclass
class NodeOptions:
    frontend: str  # HOST:PORT
    node_id: str
    host: str  # the address ranks rendezvous on
    devices: list[int]
    curve_keys_dir: str | None = None
    insecure: bool = False
    # Its place in a set of agents a group spans (the frontend's --nnodes); None: not given.
    node_set: str | None = None
    node_rank: int | None = None
    nnodes: int | None = None
    # (host, port): the rendezvous of groups whose rank 0 runs here; None: --host, a free port
    dist_init_addr: tuple[str, int] | None = None


@dataclass
class LocalGroup:
    """The ranks of one group incarnation on this node, and their local sockets."""

    group: int
    incarnation: int
    ipc_dir: str
    requests: zmq.Socket | None
    outputs: zmq.Socket
    heartbeats: zmq.Socket
    procs: dict[int, mp.process.BaseProcess] = field(default_factory=dict)  # rank -> process
    stop_at: float | None = None  # kill what is still running at this time
    port: int | None = None  # the --dist-init-addr port its rank 0 listens on, if it does


class Agent:
    def __init__(self, opts: NodeOptions) -> None:
        self.opts = opts
        self.agent_id = uuid.uuid4().hex
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"{opts.node_id}/{self.agent_id}".encode())
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues while not connected
        if opts.curve_keys_dir:
            keys.secure_client(self.sock, keys.load(Path(opts.curve_keys_dir), keys.NODE))
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.writer, self.reader = codec.Writer(), codec.Reader()
        self.groups: dict[tuple[int, int], LocalGroup] = {}
        self.lease_until: float | None = None  # monotonic; None: no lease (yet, or lapsed)
        self.lease_s: float | None = None
        self.stopping = False

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        self.sock.connect(f"tcp://{self.opts.frontend}")
        logger.info(
            "node %s (agent %s, pid %d): connecting to %s, devices %s",
            self.opts.node_id,
            self.agent_id[:8],
            os.getpid(),
            self.opts.frontend,
            self.opts.devices,
        )
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        next_beat = 0.0
        try:
            while not self.stopping:
                for g in self.groups.values():
                    for s in (g.outputs, g.heartbeats):
                        if s not in _registered(poller):
                            poller.register(s, zmq.POLLIN)
                events = dict(poller.poll(20))
                if self.monitor in events:
                    self.monitor.recv_multipart()
                    self._hello()  # every (re)connection starts with who we are
                if self.sock in events:
                    self._from_frontend()
                for g in list(self.groups.values()):
                    self._relay(g, events, poller)
                now = time.monotonic()
                if now >= next_beat:
                    self._beat()
                    next_beat = now + BEAT_S
                self._check_lease(now)
                self._reap(now, poller)
        finally:
            for g in list(self.groups.values()):
                self._kill(g)
            self.ctx.destroy(linger=0)

    def _send(self, msg: object, group: int = -1, incarnation: int = -1) -> None:
        try:
            self.sock.send_multipart(self.writer.frames(msg, group, incarnation), zmq.NOBLOCK)
        except zmq.Again:  # not connected: the lease covers what is lost meanwhile
            pass

    def _hello(self) -> None:
        o = self.opts
        self._send(
            NodeHello(
                o.node_id,
                self.agent_id,
                o.host,
                list(o.devices),
                os.getpid(),
                o.node_set,
                o.node_rank,
                o.nnodes,
                None if o.dist_init_addr is None else join_addr(*o.dist_init_addr),
            )
        )

    def _beat(self) -> None:
        self._send(NodeBeat(self.opts.node_id, time.monotonic(), list(self.groups)))

    def _check_lease(self, now: float) -> None:
        if self.lease_until is None or now <= self.lease_until:
            return
        running = [g for g in self.groups.values() if g.stop_at is None]
        if running:
            logger.error(
                "lease lapsed (%.1f s without an answer from the frontend): stopping %d group(s)",
                self.lease_s or 0.0,
                len(running),
            )
            for g in running:
                g.stop_at = now  # killed now: a fenced group must not generate on
        self.lease_until = None

    # -- from the frontend ----------------------------------------------------------------------
    def _from_frontend(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                env = self.reader.read(frames, b"frontend")
            except codec.BadFrame as e:
                logger.warning("frame from the frontend refused: %s", e)
                continue
            msg = env.msg
            if isinstance(msg, NodeLease):
                # from when the beat it answers was sent: never past the frontend's deadline,
                # which counts from when that beat arrived
                until = msg.beat_sent + msg.seconds
                self.lease_s = msg.seconds
                if until > time.monotonic():
                    self.lease_until = max(self.lease_until or 0.0, until)
            elif isinstance(msg, SpawnRanks):
                self._spawn(msg)
            elif isinstance(msg, StopRanks):
                g = self.groups.get((msg.group, msg.incarnation))
                if g is not None:
                    self._stop(g, msg.grace_s)
            elif isinstance(msg, _TO_LEADER):
                g = self.groups.get((env.group, env.incarnation))
                if g is not None and g.requests is not None:
                    try:
                        g.requests.send(pickle.dumps(msg), zmq.NOBLOCK)
                    except zmq.Again:
                        logger.warning("group %d: leader not connected, %s dropped", g.group, msg)

    def _spawn(self, msg: SpawnRanks) -> None:
        key = (msg.group, msg.incarnation)
        if key in self.groups:
            return
        args = ServerArgs(**msg.args)  # type: ignore[arg-type]
        ipc_dir = tempfile.mkdtemp(prefix=f"safeserve-node-g{msg.group}-")
        base = f"ipc://{ipc_dir}"
        addrs = GroupAddresses(f"{base}/requests", f"{base}/outputs", f"{base}/heartbeats")
        requests = None
        if 0 in msg.ranks:
            requests = self.ctx.socket(zmq.PUSH)
            requests.setsockopt(zmq.LINGER, 0)
            requests.bind(addrs.requests)
        outputs = self.ctx.socket(zmq.PULL)
        outputs.bind(addrs.outputs)
        heartbeats = self.ctx.socket(zmq.PULL)
        heartbeats.bind(addrs.heartbeats)
        g = LocalGroup(msg.group, msg.incarnation, ipc_dir, requests, outputs, heartbeats)
        init_method = msg.init_method or self._rendezvous(g)
        self.groups[key] = g
        ctx = mp.get_context("spawn")
        fail = args.fault_fail_start_group == msg.group
        for rank, device in zip(msg.ranks, msg.devices, strict=True):
            p = ctx.Process(
                target=run_rank,
                args=(args, msg.group, rank, addrs, init_method, device, fail),
                name=f"safeserve-g{msg.group}-r{rank}",
                daemon=True,
            )
            p.start()
            g.procs[rank] = p
        pids = [g.procs[r].pid or 0 for r in msg.ranks]
        logger.info(
            "group %d incarnation %d: started ranks %s (pids %s), rendezvous %s",
            msg.group,
            msg.incarnation,
            msg.ranks,
            pids,
            init_method,
        )
        self._send(RanksSpawned(msg.group, msg.incarnation, list(msg.ranks), pids, init_method))

    def _rendezvous(self, g: LocalGroup) -> str:
        """The TCP store of a group whose rank 0 runs here: --dist-init-addr (its port, or the
        next one no other group of this agent holds), else --host and a free port."""
        if self.opts.dist_init_addr is None:
            return f"tcp://{join_addr(self.opts.host, free_port(self.opts.host))}"
        host, port = self.opts.dist_init_addr
        held = {x.port for x in self.groups.values()}
        while port in held:
            port += 1
        g.port = port
        return f"tcp://{join_addr(host, port)}"

    def _stop(self, g: LocalGroup, grace_s: float) -> None:
        if grace_s > 0 and g.requests is not None:
            try:
                g.requests.send(pickle.dumps(Shutdown()), zmq.NOBLOCK)
            except zmq.Again:
                grace_s = 0.0
        deadline = time.monotonic() + grace_s
        g.stop_at = deadline if g.stop_at is None else min(g.stop_at, deadline)

    # -- the ranks ------------------------------------------------------------------------------
    def _relay(self, g: LocalGroup, events: dict, poller: zmq.Poller) -> None:
        for sock in (g.outputs, g.heartbeats):
            if sock not in events:
                continue
            while True:
                try:
                    raw = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = pickle.loads(raw)  # from this host's own rank processes only
                if isinstance(msg, Heartbeat) and g.stop_at is not None:
                    continue  # a group being stopped beats no more
                self._send(msg, g.group, g.incarnation)

    def _reap(self, now: float, poller: zmq.Poller) -> None:
        for key, g in list(self.groups.items()):
            if g.stop_at is not None and now >= g.stop_at:
                for p in g.procs.values():
                    if p.is_alive():
                        p.kill()
            for rank, p in list(g.procs.items()):
                if not p.is_alive():
                    p.join(0)
                    self._send(
                        RankExited(g.group, g.incarnation, rank, p.pid or 0, p.exitcode),
                        g.group,
                        g.incarnation,
                    )
                    del g.procs[rank]
            if not g.procs:
                if g.stop_at is None:  # every rank ended by itself: the group is over here
                    g.stop_at = now
                self._close(g, poller)
                del self.groups[key]

    def _kill(self, g: LocalGroup) -> None:
        for p in g.procs.values():
            if p.is_alive():
                p.kill()
        for p in g.procs.values():
            p.join(2.0)

    def _close(self, g: LocalGroup, poller: zmq.Poller) -> None:
        for s in (g.requests, g.outputs, g.heartbeats):
            if s is None:
                continue
            if s in _registered(poller):
                poller.unregister(s)
            s.close(linger=0)
        shutil.rmtree(g.ipc_dir, ignore_errors=True)


def _registered(poller: zmq.Poller) -> set:
    return {s for s, _ in poller.sockets}


def parse_addr(value: str, flag: str) -> tuple[str, int]:
    """`HOST:PORT` (`[V6]:PORT` for an IPv6 address) -> (host, port); ValueError (one line,
    naming `flag`) for anything else or a port outside 1..65535."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 address without brackets: its port cannot be told apart
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{flag} must be HOST:PORT with a port in 1..65535, got {value!r}")
    return host, int(port)


def join_addr(host: str, port: int) -> str:
    """(host, port) -> `HOST:PORT`, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_devices(spec: str) -> list[int]:
    """`0-7`, `0,2,5` or a mix (`0-3,6`) -> the device indices."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad device range {part!r}")
        out.extend(range(first, last + 1))
    if not out or len(set(out)) != len(out):
        raise ValueError(f"--devices {spec!r}: no devices, or one named twice")
    return out
