"""The frontend's side of one EP group: spawns its processes, sends requests, routes outputs.

The frontend never blocks on a group: sends are non-blocking ZeroMQ pushes, and one asyncio task
per group reads its outputs and heartbeats into per-request queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import multiprocessing as mp
import pickle
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from safeserve.config import ServerArgs
from safeserve.engine.rank_worker import GroupAddresses, run_rank
from safeserve.guards import canary
from safeserve.guards.watchdog import Verdict, Watchdog, death_verdict, signal_name
from safeserve.messages import (
    AbortRequest,
    EngineStats,
    EplbCommand,
    EplbReply,
    GenerateRequest,
    GroupFatal,
    GroupReady,
    InjectFault,
    RankStats,
    RequestOutput,
    SamplingParams,
    Shutdown,
    StepOutputs,
)
from safeserve.server.metrics import Metrics, count_tbo_steps
from safeserve.server.nodes import NodeHub, PlacementError, RemoteLink, RemoteRank
from safeserve.spawn import rendezvous

logger = logging.getLogger(__name__)

# How long a rank's death may take to settle (its exit code known, the fatal error it reported
# read) before the verdict is given: the verdict then names the culprit and its cause.
SETTLE_S = 1.0
# A canary that has no answer by then counts as `timeout` (no verdict: a group that makes no
# progress is the watchdog's `stalled`).
CANARY_TIMEOUT_S = 60.0


# Incarnation ids: one per GroupClient of this frontend process (routes a node's messages).
_INCARNATIONS = itertools.count(1)


class GroupUnavailable(RuntimeError):
    """The group cannot answer: not READY, or it failed while a command waited."""


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
    phase_since: float = field(default_factory=time.time)
    received_at: float = field(default_factory=time.time)  # frontend clock
    stats: RankStats = field(default_factory=RankStats)
    utilization: float = 0.0


class GroupClient:
    def __init__(
        self,
        args: ServerArgs,
        group: int = 0,
        metrics: Metrics | None = None,
        watchdog: Watchdog | None = None,
        on_failed: Callable[[str], None] | None = None,
        hub: NodeHub | None = None,
    ) -> None:
        """`hub`: with --placement remote, the node agents that run the ranks (None: this host
        spawns them)."""
        self.args = args
        self.hub = hub
        self.incarnation = next(_INCARNATIONS)
        self.node_lost = False  # failed because a node agent running its ranks was lost
        self._link: RemoteLink | None = None
        self.group = group
        self.metrics = metrics
        self.on_failed = on_failed
        self.watchdog = watchdog or Watchdog(
            args.watchdog_stall_timeout, args.watchdog_slow_factor, args.watchdog_slow_window_s
        )
        self.verdicts: list[Verdict] = []  # every verdict so far (admin API shows the last ones)
        self.state = GroupState.STARTING
        self.ready_info: GroupReady | None = None
        self.fatal: str | None = None
        # rank -> the fatal error it reported (GroupFatal), in the order they came
        self.reports: dict[int, str] = {}
        self._fencing = False  # a death is being settled: no new requests, verdict coming
        self._gone_at: dict[int, float] = {}  # rank -> when first seen gone (orders culprits)
        self.stats = EngineStats()
        self.ranks = {r: RankStatus(r) for r in range(args.tp_size)}
        self.queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._eplb_waiting: dict[str, asyncio.Future[EplbReply]] = {}  # admin commands asked
        # the canary's first answer of this incarnation, and one canary run at a time
        self.canary_reference: canary.CanaryAnswer | None = None
        self._canary_lock = asyncio.Lock()
        self._ready_event = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # rank processes (index = rank): this host's, or as the node agents report them
        self.processes: list[mp.process.BaseProcess | RemoteRank] = []
        if hub is not None:
            return
        self._ipc_dir = tempfile.mkdtemp(prefix=f"safeserve-g{group}-")
        base = f"ipc://{self._ipc_dir}"
        self.addrs = GroupAddresses(f"{base}/requests", f"{base}/outputs", f"{base}/heartbeats")
        self._ctx = zmq.asyncio.Context()
        self._req = self._ctx.socket(zmq.PUSH)
        self._req.setsockopt(zmq.LINGER, 0)
        self._req.bind(self.addrs.requests)
        # sends through a blocking view of the same socket: an asyncio socket's NOBLOCK send
        # puts zmq.Again in a future nobody reads instead of raising it
        self._req_now = zmq.Socket.shadow(self._req.underlying)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(self.addrs.outputs)
        self._hb = self._ctx.socket(zmq.PULL)
        self._hb.bind(self.addrs.heartbeats)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.hub is not None:
            self._tasks = [asyncio.create_task(self._place(self.hub))]
            return
        ctx = mp.get_context("spawn")
        # a file store of this incarnation (no port to race other processes for)
        init_method = rendezvous(directory=self._ipc_dir)
        for rank in range(self.args.tp_size):
            fail = self.args.fault_fail_start_group == self.group
            p = ctx.Process(
                target=run_rank,
                args=(
                    self.args,
                    self.group,
                    rank,
                    self.addrs,
                    init_method,
                    self.args.device_index(self.group, rank),
                    fail,
                ),
                name=f"safeserve-g{self.group}-r{rank}",
                daemon=True,
            )
            p.start()
            self.processes.append(p)
            self.ranks[rank].pid = p.pid
        logger.info("group %d: started ranks %s", self.group, [p.pid for p in self.processes])
        self._start_tasks()

    def _start_tasks(self) -> None:
        self._tasks += [
            asyncio.create_task(self._read_outputs()),
            asyncio.create_task(self._read_heartbeats()),
            asyncio.create_task(self._watch()),
        ]
        if self.args.canary_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._canary_loop()))

    async def _place(self, hub: NodeHub) -> None:
        """--placement remote: the ranks on the node agents' devices (waiting for room)."""
        try:
            link = await hub.place(self.group, self.incarnation, self.args)
        except PlacementError as e:
            self._fail(f"placement: {e}")
            return
        if self.state is not GroupState.STARTING:  # stopped or failed while it waited
            link.stop()
            return
        self._link = link
        self.processes = list(link.ranks)
        for r in link.ranks:
            self.ranks[r.rank].pid = r.pid
        self._start_tasks()

    def _send(self, msg: object) -> None:
        """To the group's leader; never blocks (zmq.Again where no leader is there to read)."""
        if self.hub is None:
            if self._req.closed:  # stopped: its context is gone
                raise zmq.ZMQError(zmq.ENOTSOCK)
            self._req_now.send(pickle.dumps(msg), flags=zmq.NOBLOCK)
        elif self._link is not None:
            self._link.send(msg)
        else:
            raise zmq.Again()

    async def wait_ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._ready_event.wait(), timeout)

    async def stop(self) -> None:
        # First: the watchdog must not read an orderly exit as a death.
        if self.state is not GroupState.FAILED:
            self.state = GroupState.STOPPED
        try:
            self._send(Shutdown())
            grace = 5.0
        except zmq.ZMQError:
            # No leader connected to read it (still loading, or gone): nothing will shut the
            # ranks down in order, so waiting out the grace period would only delay the kill.
            grace = 0.0
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + grace
        if self._link is not None:
            await self._link.wait_exited(grace)
        for p in self.processes:
            if not isinstance(p, RemoteRank):
                await loop.run_in_executor(None, p.join, max(0.1, deadline - time.monotonic()))
        self.kill_all()
        for t in self._tasks:
            t.cancel()
        self.state = GroupState.STOPPED
        if self.hub is not None:
            return
        self._ctx.destroy(linger=0)
        with contextlib.suppress(OSError):
            shutil.rmtree(self._ipc_dir)  # the sockets' files and the rendezvous store

    @property
    def ready(self) -> bool:
        return self.state is GroupState.READY and not self._fencing

    # -- requests -------------------------------------------------------------------------------
    def submit(
        self, rid: str, prompt_ids: list[int], params: SamplingParams
    ) -> asyncio.Queue[RequestOutput]:
        """The request's output queue; GroupUnavailable where the leader cannot take it now
        (none connected, or its inbox full): nothing was sent."""
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.queues[rid] = q
        try:
            self._send(GenerateRequest(rid, prompt_ids, params))
        except zmq.ZMQError as e:
            self.queues.pop(rid, None)
            raise GroupUnavailable(f"group {self.group} could not take the request: {e}") from e
        return q

    def abort(self, rid: str) -> None:
        if self.queues.pop(rid, None) is not None and self.state is GroupState.READY:
            with contextlib.suppress(zmq.ZMQError):
                self._send(AbortRequest(rid))

    def inject_fault(self, fault: InjectFault) -> None:
        self._send(fault)

    async def eplb_command(self, op: str, timeout: float) -> EplbReply:
        """Asks the group's leader an expert-placement command (messages.EplbCommand) and
        waits for its reply. Raises TimeoutError when none comes within `timeout` seconds, and
        GroupUnavailable when the group fails meanwhile."""
        if self.state is not GroupState.READY:
            raise GroupUnavailable(f"group {self.group} is {self.state.value}")
        request_id = uuid.uuid4().hex
        fut: asyncio.Future[EplbReply] = asyncio.get_running_loop().create_future()
        self._eplb_waiting[request_id] = fut
        try:
            self._send(EplbCommand(op, request_id))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._eplb_waiting.pop(request_id, None)

    # -- the canary ---------------------------------------------------------------------------
    async def run_canary(self) -> canary.CanaryRun:
        """Runs the canary once (guards/canary.py): the first answer of this incarnation is its
        reference; an answer unlike it is checked once more at once, and two in a row are a
        `corrupt` verdict that fences the group. One run at a time (a second caller waits)."""
        async with self._canary_lock:
            start = time.monotonic()
            run = await self._canary_run()
            run.latency_s = time.monotonic() - start
        if self.metrics is not None:
            self.metrics.canary_runs.labels(str(self.group), run.result).inc()
        return run

    async def _canary_run(self) -> canary.CanaryRun:
        if not self.ready:
            return canary.CanaryRun(
                self.group, "unavailable", [], f"group {self.group} is {self.state.value}"
            )
        try:
            answer = await self._canary_answer()
            if answer is None:
                return canary.CanaryRun(self.group, "unavailable", [], "the group failed")
            if self.canary_reference is None:
                self.canary_reference = answer
                return canary.CanaryRun(self.group, "reference", answer.tokens)
            why = canary.compare(self.canary_reference, answer)
            if why is None:
                return canary.CanaryRun(self.group, "ok", answer.tokens)
            logger.warning("group %d canary answered wrong (%s): checking again", self.group, why)
            again = await self._canary_answer()
            if again is None:
                return canary.CanaryRun(self.group, "unavailable", [], "the group failed")
            why_again = canary.compare(self.canary_reference, again)
            if why_again is None:
                return canary.CanaryRun(self.group, "ok", again.tokens, f"once: {why}")
        except TimeoutError:
            return canary.CanaryRun(
                self.group, "timeout", [], f"no answer within {CANARY_TIMEOUT_S:g} s"
            )
        except RuntimeError as e:
            return canary.CanaryRun(self.group, "error", [], str(e))
        if self.state is GroupState.READY:
            reason = (
                f"the canary answered wrong twice in a row: {why_again} (reference tokens "
                f"{self.canary_reference.tokens}, got {again.tokens})"
            )
            self._record(Verdict("corrupt", self.group, None, reason))
            self._fail(f"watchdog: corrupt: {reason}")
        return canary.CanaryRun(self.group, "corrupt", again.tokens, why_again)

    async def _canary_answer(self) -> canary.CanaryAnswer | None:
        """The canary prompt's answer from the group (None: the group failed meanwhile)."""
        assert self.ready_info is not None
        rid = f"__canary_{uuid.uuid4().hex}__"
        prompt = canary.canary_prompt(self.ready_info.vocab_size)
        q = self.submit(rid, prompt, canary.canary_params())
        tokens: list[int] = []
        logprobs: list = []
        deadline = time.monotonic() + CANARY_TIMEOUT_S
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                o = await asyncio.wait_for(q.get(), left)
                tokens += o.new_token_ids
                logprobs += o.logprobs or []
                if o.finish_reason is None:
                    continue
                if o.finish_reason == "group_failed":
                    return None
                if o.finish_reason != "length":
                    raise RuntimeError(f"the canary ended with {o.finish_reason}: {o.error}")
                return canary.CanaryAnswer(tokens, logprobs)
        finally:
            self.abort(rid)

    async def _canary_loop(self) -> None:
        await self._ready_event.wait()
        while self.state is GroupState.READY:
            await self.run_canary()
            await asyncio.sleep(self.args.canary_interval_s)

    def release(self, rid: str) -> None:
        """The request finished normally: forget its queue."""
        self.queues.pop(rid, None)

    # -- background tasks -----------------------------------------------------------------------
    async def _read_outputs(self) -> None:
        while True:
            if self._link is not None:
                msg = await self._link.outputs.get()
            else:
                msg = pickle.loads(await self._out.recv())
            if isinstance(msg, StepOutputs):
                if self.metrics is not None:
                    count_tbo_steps(self.metrics, self.group, self.stats, msg.stats)
                self.stats = msg.stats
                for reply in msg.replies:
                    fut = self._eplb_waiting.get(reply.request_id)
                    if fut is not None and not fut.done():
                        fut.set_result(reply)
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
                self.reports.setdefault(msg.rank, msg.message)
                if self.state is GroupState.READY:
                    # The reporter is exiting; a peer's collective often fails first when a rank
                    # dies: the verdict waits for the exits to settle (reading on meanwhile).
                    self._tasks.append(asyncio.create_task(self._fence_death(msg.rank)))
                else:
                    self._fail(f"rank {msg.rank}: {msg.message}")

    async def _read_heartbeats(self) -> None:
        while True:
            if self._link is not None:
                hb = await self._link.heartbeats.get()
            else:
                hb = pickle.loads(await self._hb.recv())
            st = self.ranks.setdefault(hb.rank, RankStatus(hb.rank))
            st.pid, st.step, st.phase, st.phase_since = hb.pid, hb.step, hb.phase, hb.phase_since
            st.stats = hb.stats
            st.received_at = time.time()

    @property
    def has_work(self) -> bool:
        return bool(self.queues) or self.stats.num_running + self.stats.num_waiting > 0

    def kill_all(self) -> None:
        """Kills every process of the group (a collective with a dead peer is never waited out);
        remote ranks: their agents are told to (and the incarnation's outputs are dropped)."""
        if self._link is not None:
            self._link.stop()
            return
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(2.0)

    async def _watch(self) -> None:
        """The watchdog's loop for this group: dead processes at any time; stalls and slow ranks
        once READY (loading and warm-up never count as a stall)."""
        period = min(0.25, self.args.heartbeat_interval_s)
        while self.state in (GroupState.STARTING, GroupState.READY):
            await asyncio.sleep(period)
            if self.state not in (GroupState.STARTING, GroupState.READY):
                return
            if self._node_lost():
                return
            alive = {r: p.is_alive() for r, p in enumerate(self.processes)}
            if self.state is GroupState.STARTING:
                dead = [r for r, ok in alive.items() if not ok]
                if dead:
                    await asyncio.sleep(0.2)  # let a GroupFatal sent before the exit arrive
                    if self.state is GroupState.STARTING:
                        p = self.processes[dead[0]]
                        self._fail(f"rank {dead[0]} (pid {p.pid}) exited with code {p.exitcode}")
                continue
            codes = {r: p.exitcode for r, p in enumerate(self.processes)}
            self._note_gone(alive)
            verdicts = self.watchdog.check(
                self.group, self.ranks, alive, self.has_work, codes, self.reports, self._gone_at
            )
            if verdicts and verdicts[0].kind in ("dead", "crashed"):
                await self._fence_death()
                return
            for verdict in verdicts:
                self._record(verdict)
                if verdict.fences:
                    self._fail(f"watchdog: {verdict.kind}: {verdict.reason}")
                    break
            for r, st in self.ranks.items():
                st.utilization = self.watchdog.track(self.group, r).utilization

    def _node_lost(self) -> bool:
        """A rank whose node agent is lost (killed, frozen, cut off): a `dead` verdict naming the
        node; the group is fenced at once (its ranks there stop when their lease lapses)."""
        verdict = self._lost_verdict()
        if verdict is None:
            return False
        self.node_lost = True
        self._record(verdict)
        self._fail(f"watchdog: dead: {verdict.reason}")
        return True

    def _lost_verdict(self) -> Verdict | None:
        lost = [p for p in self.processes if isinstance(p, RemoteRank) and p.lost is not None]
        if not lost:
            return None
        r = lost[0]
        reason = f"rank {r.rank} (pid {r.pid}) is gone: node {r.node.node_id} lost: {r.lost}"
        return Verdict("dead", self.group, r.rank, reason)

    async def _fence_death(self, reporter: int | None = None) -> None:
        """A rank is gone, or reported a fatal error and is going: wait (at most SETTLE_S) until
        every dead rank's exit code is known and a rank that exited 1 had its report read, so
        the verdict names the culprit and the cause (`crashed` with its error; `dead` with the
        signal or exit code); then record it and fail the group. No new requests meanwhile."""
        if self._fencing or self.state is not GroupState.READY:
            return
        self._fencing = True
        deadline = time.monotonic() + SETTLE_S
        while True:
            alive = {r: p.is_alive() for r, p in enumerate(self.processes)}
            codes = {r: p.exitcode for r, p in enumerate(self.processes)}
            self._note_gone(alive)
            verdicts = self.watchdog.check(
                self.group, self.ranks, alive, False, codes, self.reports, self._gone_at
            )
            deaths = [v for v in verdicts if v.kind in ("dead", "crashed")]
            # Settled: the reporter is gone, and every rank seen gone (its process reaped here,
            # or a zombie psutil saw after that) has its exit code, and its report or signal.
            settled = (
                (reporter is None or not alive.get(reporter, False))
                and all(
                    codes[r] is not None
                    and (r in self.reports or signal_name(codes[r]) is not None)
                    for r, ok in alive.items()
                    if not ok
                )
                and all(v.exit_code is not None for v in deaths)
            )
            lost = self._lost_verdict()  # a lost node's ranks report no exit: it is the cause
            if settled or lost is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.02)
        if self.state is not GroupState.READY:
            return
        if lost is not None:
            verdict = lost
            self.node_lost = True
        elif deaths:
            verdict = deaths[0]
        else:  # the reporter has not exited (yet): its report is the cause all the same
            rank = reporter if reporter is not None else 0
            pid = self.ranks[rank].pid if rank in self.ranks else None
            verdict = death_verdict(self.group, rank, pid, None, self.reports.get(rank))
        self._record(verdict)
        self._fail(f"watchdog: {verdict.kind}: {verdict.reason}")

    def _note_gone(self, alive: dict[int, bool]) -> None:
        now = time.time()
        for r, ok in alive.items():
            if not ok:
                self._gone_at.setdefault(r, now)

    def _record(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        del self.verdicts[:-50]
        log = logger.error if verdict.fences else logger.warning
        log("group %d watchdog verdict %s: %s", self.group, verdict.kind, verdict.reason)
        if self.metrics is not None:
            self.metrics.watchdog_verdicts.labels(str(self.group), verdict.kind).inc()

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
        for fut in self._eplb_waiting.values():
            if not fut.done():
                fut.set_exception(GroupUnavailable(f"group {self.group} failed: {reason}"))
        if self.on_failed is not None:
            self.on_failed(reason)
