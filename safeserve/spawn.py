"""Rank processes on this host: `world` spawned processes of one function, each told its rank
and the group's rendezvous (a file store of its own, or a TCP port), what they report collected, and
every one of them stopped on the way out, whatever happened.

- `run_ranks(target, world, args)`: each rank runs `target(rank, world, init, *args)`; the
  values they return, by rank. The benchmark scripts' and most tests' way.
- `spawn_ranks(world, target, args)`: the processes, for ranks that report as they go (several
  messages each, on the queue they are given); `Ranks.get` reads the next one.

A rank that raises is reported as `RankFailed` naming it, with its traceback; a rank that dies
without a word (killed, or `os._exit`) as `RankFailed` with its exit code or signal. A rank's
process ends with `os._exit` once what it put on the queue is flushed: the interpreter's
teardown with torch loaded costs most of a second a process, and a rank stuck in it (a process
group's threads) would hold up the parent. Ranks start with the `spawn` method (no CUDA state or
threads copied from the parent), so `target` must be importable: a module's top-level function.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_POLL_S = 0.2  # how often a waiting `Ranks.get` looks for a rank that died without a word


class RankFailed(RuntimeError):
    """A rank raised (`detail` its traceback) or died without reporting (its exit code)."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail


@dataclass(frozen=True)
class _Failed:
    """What a rank's process puts on the queue when its target raised."""

    rank: int
    traceback: str


def rendezvous(port: int | None = None, directory: str | None = None) -> str:
    """The `init_method` of a group on this host: a TCP store on `port`; else a file store in
    `directory` (a new temporary one when None). A file needs no port: a free port picked now is
    only bound when rank 0 has started, seconds later, and another process may take it first
    (a group's ranks then meet another group's store, or none)."""
    if port is not None:
        return f"tcp://127.0.0.1:{port}"
    directory = directory or tempfile.mkdtemp(prefix="safeserve-rendezvous-")
    return f"file://{os.path.join(directory, f'store-{uuid.uuid4().hex}')}"


def rendezvous_dir(init: str) -> str | None:
    """The directory of a file-store `init_method` (None for a TCP one)."""
    return os.path.dirname(init.removeprefix("file://")) if init.startswith("file://") else None


class Ranks:
    """The spawned processes of a group, and the queue they report to."""

    def __init__(self, processes: list[mp.process.BaseProcess], queue: Any, init: str) -> None:
        self.processes = processes
        self.queue = queue
        self.init = init
        self._failed: set[int] = set()

    @property
    def world(self) -> int:
        return len(self.processes)

    def get(self, timeout: float | None = None) -> Any:
        """The next message a rank put on the queue. RankFailed when it is a rank's failure, or
        when a rank's process has ended with a non-zero code and the queue is empty; TimeoutError
        after `timeout` seconds without a message."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            try:
                msg = self.queue.get(timeout=max(wait, 0.001))
            except queue_mod.Empty:
                msg = self._last_words()
                if msg is None:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(f"no word from the ranks in {timeout} s") from None
                    continue
            if isinstance(msg, _Failed):
                self._failed.add(msg.rank)
                raise RankFailed(msg.rank, msg.traceback)
            return msg

    def _last_words(self) -> Any:
        """None while no rank has died unreported; else what it put last (a dead process's
        messages are in the pipe before its exit code is), or RankFailed naming how it ended."""
        for rank, p in enumerate(self.processes):
            if rank in self._failed or p.exitcode in (None, 0):
                continue
            try:
                return self.queue.get(timeout=1.0)
            except queue_mod.Empty:
                self._failed.add(rank)
                raise RankFailed(rank, f"its process {_ended(p.exitcode)} without a word") from None
        return None


def _ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _rank_process(target: Callable[..., object], rank: int, queue: Any, args: tuple) -> None:
    """The body of one rank's process: target(*args), a failure reported, then its output and
    the queue flushed and the process ended without the interpreter's teardown."""
    code = 0
    try:
        target(*args)
    except BaseException:  # SystemExit and KeyboardInterrupt end a rank as badly
        queue.put(_Failed(rank, traceback.format_exc()))
        code = 1
    for stream in (sys.stdout, sys.stderr):  # os._exit flushes nothing
        if stream is not None:
            stream.flush()
    queue.close()
    queue.join_thread()
    os._exit(code)


@contextmanager
def spawn_ranks(
    world: int,
    target: Callable[..., object],
    args: Callable[[int, str, Any], Sequence[object]],
    *,
    port: int | None = None,
    stop_s: float = 10.0,
) -> Iterator[Ranks]:
    """`world` processes, rank r running target(*args(r, init, queue)) (`init` the rendezvous:
    a TCP store on `port`, else a file store of its own; `queue` the one they report to). On leaving, each process
    gets `stop_s` seconds to end (none when leaving on an exception) and is then killed."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = rendezvous(port)
    processes: list[mp.process.BaseProcess] = []
    ok = False
    try:
        for rank in range(world):
            p = ctx.Process(
                target=_rank_process,
                args=(target, rank, queue, tuple(args(rank, init, queue))),
                name=f"rank {rank}",
            )
            p.start()
            processes.append(p)
        yield Ranks(processes, queue, init)
        ok = True
    finally:
        stop(processes, stop_s if ok else 0.0)
        queue.close()
        queue.cancel_join_thread()
        if port is None and (directory := rendezvous_dir(init)) is not None:
            shutil.rmtree(directory, ignore_errors=True)


def stop(processes: Sequence[mp.process.BaseProcess], grace_s: float) -> None:
    """Every process ended: `grace_s` seconds (in all) to end by itself, then killed."""
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def _returning(target: Callable[..., object], queue: Any, rank: int, *args: object) -> None:
    queue.put((rank, target(rank, *args)))


def run_ranks(
    target: Callable[..., object],
    world: int,
    args: Sequence[object] = (),
    *,
    port: int | None = None,
    timeout: float | None = 600.0,
    stop_s: float = 10.0,
) -> list:
    """What target(rank, world, init, *args) returns on each of `world` spawned ranks, in rank
    order (`init` the group's rendezvous address, on `port` or a free one). The first rank to
    fail raises RankFailed; TimeoutError when no rank reports for `timeout` seconds. Every
    process has ended when this returns or raises."""
    args = tuple(args)
    with spawn_ranks(
        world,
        _returning,
        lambda rank, init, q: (target, q, rank, world, init, *args),
        port=port,
        stop_s=stop_s,
    ) as ranks:
        got: dict[int, object] = {}
        while len(got) < world:
            rank, value = ranks.get(timeout)
            got[rank] = value
    return [got[r] for r in range(world)]
