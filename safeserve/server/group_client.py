"""The frontend's side of one EP group: spawns its processes, sends requests, routes outputs.

The frontend never blocks on a group: sends are non-blocking ZeroMQ pushes, and one asyncio task
per group reads its outputs and heartbeats into per-request queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from safeserve.config import ServerArgs
from safeserve.engine.rank_worker import GroupAddresses, run_rank
from safeserve.messages import (
    AbortRequest,
    EngineStats,
    GenerateRequest,
    GroupFatal,
    GroupReady,
    Heartbeat,
    RequestOutput,
    SamplingParams,
    Shutdown,
    StepOutputs,
)

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GroupState(enum.Enum):
    STARTING = "STARTING"
    READY = "READY"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


@dataclass
class RankStatus:
    rank: int
    pid: int | None = None
    step: int = 0
    phase: str = "starting"
    last_beat: float = field(default_factory=time.time)


class GroupClient:
    def __init__(self, args: ServerArgs, group: int = 0) -> None:
        self.args = args
        self.group = group
        self.state = GroupState.STARTING
        self.ready_info: GroupReady | None = None
        self.fatal: str | None = None
        self.stats = EngineStats()
        self.ranks = {r: RankStatus(r) for r in range(args.tp_size)}
        self.queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._ready_event = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._ipc_dir = tempfile.mkdtemp(prefix=f"safeserve-g{group}-")
        base = f"ipc://{self._ipc_dir}"
        self.addrs = GroupAddresses(f"{base}/requests", f"{base}/outputs", f"{base}/heartbeats")
        self._ctx = zmq.asyncio.Context()
        self._req = self._ctx.socket(zmq.PUSH)
        self._req.setsockopt(zmq.LINGER, 0)
        self._req.bind(self.addrs.requests)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(self.addrs.outputs)
        self._hb = self._ctx.socket(zmq.PULL)
        self._hb.bind(self.addrs.heartbeats)
        self.processes: list[mp.process.BaseProcess] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(self.args.tp_size):
            p = ctx.Process(
                target=run_rank,
                args=(self.args, self.group, rank, self.addrs, init_method),
                name=f"safeserve-g{self.group}-r{rank}",
                daemon=True,
            )
            p.start()
            self.processes.append(p)
            self.ranks[rank].pid = p.pid
        logger.info("group %d: started ranks %s", self.group, [p.pid for p in self.processes])
        self._tasks = [
            asyncio.create_task(self._read_outputs()),
            asyncio.create_task(self._read_heartbeats()),
            asyncio.create_task(self._watch_process()),
        ]

    async def wait_ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._ready_event.wait(), timeout)

    async def stop(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await self._req.send(pickle.dumps(Shutdown()), flags=zmq.NOBLOCK)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + 5.0
        for p in self.processes:
            await loop.run_in_executor(None, p.join, max(0.1, deadline - time.monotonic()))
        self.kill_all()
        for t in self._tasks:
            t.cancel()
        self.state = GroupState.STOPPED
        self._ctx.destroy(linger=0)
        with contextlib.suppress(OSError):
            for name in ("requests", "outputs", "heartbeats"):
                os.unlink(os.path.join(self._ipc_dir, name))
            os.rmdir(self._ipc_dir)

    @property
    def ready(self) -> bool:
        return self.state is GroupState.READY

    # -- requests -------------------------------------------------------------------------------
    def submit(
        self, rid: str, prompt_ids: list[int], params: SamplingParams
    ) -> asyncio.Queue[RequestOutput]:
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.queues[rid] = q
        self._req.send(pickle.dumps(GenerateRequest(rid, prompt_ids, params)), flags=zmq.NOBLOCK)
        return q

    def abort(self, rid: str) -> None:
        if self.queues.pop(rid, None) is not None and self.state is GroupState.READY:
            with contextlib.suppress(zmq.ZMQError):
                self._req.send(pickle.dumps(AbortRequest(rid)), flags=zmq.NOBLOCK)

    def release(self, rid: str) -> None:
        """The request finished normally: forget its queue."""
        self.queues.pop(rid, None)

    # -- background tasks -----------------------------------------------------------------------
    async def _read_outputs(self) -> None:
        while True:
            msg = pickle.loads(await self._out.recv())
            if isinstance(msg, StepOutputs):
                self.stats = msg.stats
                for o in msg.outputs:
                    q = self.queues.get(o.rid)
                    if q is not None:
                        q.put_nowait(o)
                        if o.finish_reason is not None:
                            self.queues.pop(o.rid, None)
            elif isinstance(msg, GroupReady):
                self.ready_info = msg
                self.state = GroupState.READY
                self._ready_event.set()
                logger.info(
                    "group %d ready: max model length %d, %d KV blocks",
                    self.group,
                    msg.max_model_len,
                    msg.num_kv_blocks,
                )
            elif isinstance(msg, GroupFatal):
                self._fail(f"rank {msg.rank}: {msg.message}")

    async def _read_heartbeats(self) -> None:
        while True:
            hb: Heartbeat = pickle.loads(await self._hb.recv())
            st = self.ranks.setdefault(hb.rank, RankStatus(hb.rank))
            st.pid, st.step, st.phase, st.last_beat = hb.pid, hb.step, hb.phase, hb.time

    def kill_all(self) -> None:
        """Kills every process of the group (a collective with a dead peer is never waited out)."""
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(2.0)

    async def _watch_process(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            dead = [(r, p) for r, p in enumerate(self.processes) if not p.is_alive()]
            if dead and self.state in (GroupState.STARTING, GroupState.READY):
                # Give a GroupFatal sent just before the exit a moment to arrive first.
                await asyncio.sleep(0.2)
                if self.state in (GroupState.STARTING, GroupState.READY):
                    r, p = dead[0]
                    self._fail(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}")
            if dead:
                return

    def _fail(self, reason: str) -> None:
        if self.state is GroupState.FAILED:
            return
        self.state = GroupState.FAILED
        self.fatal = reason
        self._ready_event.set()
        logger.error("group %d failed: %s", self.group, reason)
        self.kill_all()  # never leave half a group running
        for rid, q in list(self.queues.items()):
            q.put_nowait(RequestOutput(rid, [], "group_failed"))
        self.queues.clear()
