"""The main loop of a group's rank process. Rank 0, the leader, runs the engine and talks to the
frontend over ZeroMQ: requests and aborts in, step outputs out, heartbeats on their own socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from safeserve.config import ServerArgs
from safeserve.messages import (
    AbortRequest,
    EplbCommand,
    GenerateRequest,
    GroupFatal,
    GroupReady,
    Heartbeat,
    InjectFault,
    RankStats,
    RequestOutput,
    Shutdown,
    StepOutputs,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupAddresses:
    """ZeroMQ endpoints of one group; the frontend binds them, the leader connects."""

    requests: str  # frontend PUSH -> leader PULL
    outputs: str  # leader PUSH -> frontend PULL
    heartbeats: str  # every rank PUSH -> frontend PULL


class _Heartbeats:
    """The main thread records (step, phase) for free; a daemon thread sends them every
    interval. A rank blocked in a collective keeps beating with a phase that does not move; a
    stopped or dead rank stops beating. Both are what the watchdog tells apart."""

    def __init__(self, ctx: zmq.Context, addr: str, group: int, rank: int, interval: float) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100)
        self.sock.connect(addr)
        self.group, self.rank, self.pid = group, rank, os.getpid()
        self.interval = interval
        self.step, self.phase, self.phase_since = 0, "starting", time.time()
        self.stats: Callable[[], RankStats] = RankStats
        self._wake = threading.Event()
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()

    def beat(self, step: int, phase: str) -> None:
        if phase != self.phase or step != self.step:
            self.step, self.phase, self.phase_since = step, phase, time.time()

    def _run(self) -> None:
        while True:
            try:
                stats = self.stats()
            except Exception:  # stats must never stop the beat
                stats = RankStats()
            msg = Heartbeat(
                self.group,
                self.rank,
                self.pid,
                self.step,
                self.phase,
                time.time(),
                self.phase_since,
                stats,
            )
            try:
                self.sock.send(pickle.dumps(msg), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the frontend is behind; the next beat says the same thing
            self._wake.wait(self.interval)


def set_process_title(group: int, rank: int) -> None:
    """Names the process `safeserve: group G rank R` in `ps` and `top` (where setproctitle is
    installed; silently not otherwise)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    with contextlib.suppress(Exception):  # a title is a convenience, never a start-up failure
        setproctitle(f"safeserve: group {group} rank {rank}")


def _setup(args: ServerArgs, group: int, rank: int) -> None:
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s [group {group} rank {rank}] %(levelname)s %(message)s",
    )
    # Ctrl-C (and a SIGTERM to the whole process group) reaches every rank: the frontend
    # decides when ranks stop, and stops them in order; ranks exit by themselves if it dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _fatal(out: zmq.Socket, group: int, rank: int, what: str, e: BaseException) -> None:
    logger.error("%s: %s", what, traceback.format_exc())
    msg = pickle.dumps(GroupFatal(group, rank, f"{what}: {type(e).__name__}: {e}"))
    # os._exit ends ZeroMQ's I/O thread too: wait (at most 2 s) until it has handed the message
    # to the socket, or the frontend would learn of the death but not its reason. pyzmq copies
    # messages under its copy threshold and reports them sent at once: force zero-copy so the
    # tracker waits for ZeroMQ to release (write) the message.
    out.copy_threshold = 0
    tracker = out.send(msg, copy=False, track=True)
    with contextlib.suppress(zmq.NotDone):
        tracker.wait(2.0)
    out.close(linger=0)
    os._exit(1)


def run_rank(
    args: ServerArgs,
    group: int,
    rank: int,
    addrs: GroupAddresses,
    init_method: str,
    device_index: int | None = None,
    fail_at_start: bool = False,
) -> None:
    """Entry point of every rank process of a group (spawned by the frontend)."""
    set_process_title(group, rank)
    _setup(args, group, rank)
    parent = os.getppid()
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 1000)
    out.connect(addrs.outputs)
    hb = _Heartbeats(ctx, addrs.heartbeats, group, rank, args.heartbeat_interval_s)
    try:
        import torch

        from safeserve.engine.model_runner import ModelRunner

        torch.manual_seed(args.seed)
        if args.device == "cpu":
            torch.set_num_threads(cpu_threads(args, os.cpu_count() or 1))
        if fail_at_start:
            raise RuntimeError("injected start-up failure (--fault-fail-start-group)")
        runner = ModelRunner(args, rank, init_method, on_phase=hb.beat, device_index=device_index)
        runner.freeze_gc_on_serving = True  # this process lives as long as the runner
        hb.stats = runner.stats
    except Exception as e:  # start-up failure: tell the frontend in one line, then exit
        _fatal(out, group, rank, "start-up failed", e)
    if rank == 0:
        _lead(args, group, runner, out, ctx, addrs, hb, parent)
        _exit_after_shutdown()
    from safeserve.engine.engine import follower_loop

    def on_plan(step: int, idle: bool) -> None:
        if idle:
            hb.beat(step, "idle")
        if os.getppid() != parent:  # the frontend is gone (killed): do not outlive it
            os._exit(0)

    try:
        follower_loop(runner, on_plan)
    except Exception as e:  # the leader went away mid-collective, or the rank is unusable
        _fatal(out, group, rank, "step failed", e)
    logger.info("shut down")
    _exit_after_shutdown()


def _exit_after_shutdown() -> None:
    """Ends the rank's process (exit code 0) once it has shut down in order, without the
    interpreter's teardown (torch, gloo, ZeroMQ: half a second or more per rank at every group
    stop) that has nothing left to do: log records are flushed as they are written, the process
    group is destroyed, and the ZeroMQ context is not terminated at interpreter exit either."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _lead(args, group, runner, out, ctx, addrs, hb, parent) -> None:  # type: ignore[no-untyped-def]
    from safeserve.engine.engine import Engine

    inp = ctx.socket(zmq.PULL)
    inp.connect(addrs.requests)
    try:
        engine = Engine(args, runner, on_phase=hb.beat)
        engine.warm_up()
    except Exception as e:
        _fatal(out, group, 0, "start-up failed", e)
    ready = GroupReady(
        group,
        engine.max_model_len,
        engine.num_blocks,
        args.block_size,
        engine.config.vocab_size,
        engine.guards(),
    )
    out.send(pickle.dumps(ready))
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    last_stats = 0.0
    while True:
        timeout_ms = 0 if engine.has_work() else int(args.heartbeat_interval_s * 1000)
        events = dict(poller.poll(timeout_ms))
        outputs: list[RequestOutput] = []
        if inp in events:
            while True:
                try:
                    msg = pickle.loads(inp.recv(flags=zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, Shutdown):
                    logger.info("shutting down")
                    engine.shutdown()
                    out.close(linger=500)
                    return
                outputs.extend(_handle(engine, msg))
        if os.getppid() != parent:  # the frontend is gone: nobody will read our outputs
            logger.warning("frontend exited; leader stopping")
            os._exit(0)
        try:  # a step's exception that a request caused comes back as that request's error
            if engine.has_work():
                outputs.extend(engine.step())
            else:
                hb.beat(engine.step_id, "idle")
                engine.broadcast_idle()
        except Exception as e:
            _fatal(out, group, 0, "step failed", e)
        now = time.monotonic()
        if outputs or engine.replies or now - last_stats > args.heartbeat_interval_s:
            replies, engine.replies = engine.replies, []
            out.send(pickle.dumps(StepOutputs(group, outputs, engine.stats(), replies)))
            last_stats = now


def _handle(engine, msg: object) -> list[RequestOutput]:  # type: ignore[no-untyped-def]
    if isinstance(msg, GenerateRequest):
        try:
            engine.add_request(msg.rid, msg.prompt_ids, msg.params)
        except ValueError as e:
            logger.warning("request %s refused: %s", msg.rid, e)
            error = f"add_request: {type(e).__name__}: {e}"
            return [RequestOutput(msg.rid, [], "error", len(msg.prompt_ids), 0, error=error)]
        return []
    if isinstance(msg, AbortRequest):
        engine.abort_request(msg.rid)
        return []
    if isinstance(msg, InjectFault):
        engine.inject_fault(msg)
        return []
    if isinstance(msg, EplbCommand):
        engine.eplb_command(msg)  # its reply goes out with the next outputs
        return []
    logger.warning("unknown message %r", type(msg).__name__)
    return []


def cpu_threads(args: ServerArgs, cores: int) -> int:
    """Torch threads of a CPU rank: the machine's cores shared by every rank it runs. Local
    placement runs every group's ranks here (`num_groups` x `tp_size`); on a node agent's host
    only this group's are known (`tp_size`). More threads than cores thrash: with two threads
    for each of two one-rank groups on two cores, the survivor of a chaos kill made about nine
    times the tokens per second its group had made beside the other."""
    ranks = args.tp_size * (args.num_groups if args.placement == "local" else 1)
    return max(1, cores // ranks)
