"""The main loop of a group's rank process. Rank 0, the leader, runs the engine and talks to the
frontend over ZeroMQ: requests and aborts in, step outputs out, heartbeats on their own socket.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass

import zmq

from safeserve.config import ServerArgs
from safeserve.messages import (
    AbortRequest,
    GenerateRequest,
    GroupFatal,
    GroupReady,
    Heartbeat,
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
    def __init__(self, ctx: zmq.Context, addr: str, group: int, rank: int) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        self.sock.connect(addr)
        self.group, self.rank, self.pid = group, rank, os.getpid()
        self.step, self.phase, self.last = 0, "idle", 0.0

    def beat(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase
        self.last = time.time()
        msg = Heartbeat(self.group, self.rank, self.pid, step, phase, self.last)
        try:
            self.sock.send(pickle.dumps(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # the frontend is behind; the next beat says the same thing


def run_leader(args: ServerArgs, group: int, addrs: GroupAddresses) -> None:
    """Entry point of a group leader process (spawned by the frontend)."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s [group {group} rank 0] %(levelname)s %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides when we stop
    parent = os.getppid()
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 1000)
    out.connect(addrs.outputs)
    inp = ctx.socket(zmq.PULL)
    inp.connect(addrs.requests)
    hb = _Heartbeats(ctx, addrs.heartbeats, group, 0)
    hb.beat(0, "idle")
    try:
        import torch

        from safeserve.engine.engine import Engine

        torch.manual_seed(args.seed)
        engine = Engine(args, on_phase=hb.beat)
        _warm_up(engine)
    except Exception as e:  # start-up failure: tell the frontend in one line, then exit
        logger.error("start-up failed: %s", traceback.format_exc())
        out.send(pickle.dumps(GroupFatal(group, 0, f"{type(e).__name__}: {e}")))
        out.close(linger=2000)
        os._exit(1)
    out.send(
        pickle.dumps(
            GroupReady(
                group,
                engine.max_model_len,
                engine.num_blocks,
                args.block_size,
                engine.config.vocab_size,
            )
        )
    )
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
                    out.close(linger=500)
                    return
                outputs.extend(_handle(engine, msg))
        if engine.has_work():
            try:
                outputs.extend(engine.step())
            except Exception as e:
                logger.error("step failed: %s", traceback.format_exc())
                out.send(
                    pickle.dumps(GroupFatal(group, 0, f"step failed: {type(e).__name__}: {e}"))
                )
                out.close(linger=2000)
                os._exit(1)
        else:
            hb.beat(engine.step_id, "idle")
            if os.getppid() != parent:  # the frontend is gone: nobody will read our outputs
                logger.warning("frontend exited; leader stopping")
                os._exit(0)
        now = time.monotonic()
        if outputs or now - last_stats > args.heartbeat_interval_s:
            out.send(pickle.dumps(StepOutputs(group, outputs, engine.stats())))
            last_stats = now


def _handle(engine, msg: object) -> list[RequestOutput]:  # type: ignore[no-untyped-def]
    if isinstance(msg, GenerateRequest):
        try:
            engine.add_request(msg.rid, msg.prompt_ids, msg.params)
        except ValueError as e:
            logger.warning("request %s refused: %s", msg.rid, e)
            return [RequestOutput(msg.rid, [], "error", len(msg.prompt_ids), 0)]
        return []
    if isinstance(msg, AbortRequest):
        engine.abort_request(msg.rid)
        return []
    logger.warning("unknown message %r", type(msg).__name__)
    return []


def _warm_up(engine) -> None:  # type: ignore[no-untyped-def]
    """One short request through every stage, so the first client does not pay for it."""
    from safeserve.messages import SamplingParams

    engine.add_request("__warmup__", [0, 1, 2], SamplingParams(max_tokens=2, temperature=0))
    while engine.has_work():
        engine.step()
