"""The collectives the model uses (`Layout`, who a rank is in its group, is in `layout.py`).

A group of `tp_size` ranks forms its own `torch.distributed` world (gloo on CPU, NCCL on GPU),
plus a gloo group on which the leader broadcasts each step's plan. Expert parallelism splits the
same ranks into `ep_size` expert blocks of `moe_tp_size = tp_size / ep_size` ranks each; each
rank of a block holds a slice of those experts' FFN width.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from safeserve.parallel.layout import Layout
from safeserve.wire.tree import TreeCodec

# A collective is never waited out: the watchdog fences a group long before this.
_COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)


class Pending:
    """A collective issued by `Comm.start_*`: `wait()` completes it (once) and returns its
    result. The tensors it reads and writes must not be touched before then."""

    def __init__(self, comm: Comm, work: Any, result: Callable[[], Any]) -> None:
        self._comm = comm
        self._work = work  # the torch.distributed Work of an asynchronous collective, or None
        self._result = result

    def wait(self) -> Any:
        if self._work is not None:
            with self._comm._waiting():
                self._work.wait()
            self._work = None
        return self._result()


class Comm:
    """The group's collectives; with one rank every operation is the identity."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.world = layout.tp_size
        self.cpu_group: dist.ProcessGroup | None = None
        # Host time spent inside collectives (waiting for peers, mostly): the watchdog's "own
        # step time" of a rank is its step time minus this.
        self.wait_s = 0.0
        self.codec: TreeCodec | None = None  # the control plane's encoding across hosts

    @contextmanager
    def _waiting(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - start

    @property
    def active(self) -> bool:
        return self.world > 1

    def init(self, init_method: str) -> None:
        if not self.active:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=self.layout.rank,
            world_size=self.world,
            timeout=_COLLECTIVE_TIMEOUT,
            device_id=self.device if self.device.type == "cuda" else None,
        )
        self.cpu_group = (
            dist.new_group(backend="gloo", timeout=_COLLECTIVE_TIMEOUT)
            if backend == "nccl"
            else dist.group.WORLD
        )

    def shutdown(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()

    # -- model collectives ----------------------------------------------------------------------
    # Each collective has a `start_` form returning a `Pending`: with `asynchronous` it is only
    # issued (gloo's threads or NCCL's stream carry it on) and `wait()` completes it, so a
    # micro-batch can compute while the other's transfer is in flight; without, it runs to the
    # end before `start_` returns, exactly as the plain form does.
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.start_all_reduce(x).wait()

    def start_all_reduce(self, x: torch.Tensor, asynchronous: bool = False) -> Pending:
        if not self.active:
            return Pending(self, None, lambda: x)
        with self._waiting():
            work = dist.all_reduce(x, async_op=asynchronous)
        return Pending(self, work, lambda: x)

    def all_gather_rows(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenates every rank's rows (rank r holds sizes[r] rows) on every rank."""
        return self.start_all_gather_rows(x, sizes).wait()

    def start_all_gather_rows(
        self, x: torch.Tensor, sizes: list[int], asynchronous: bool = False
    ) -> Pending:
        if not self.active:
            return Pending(self, None, lambda: x)
        width = max(sizes)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        with self._waiting():
            work = dist.all_gather(parts, padded, async_op=asynchronous)
        return Pending(
            self, work, lambda: torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
        )

    def all_gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D count vector stacked: `[world, len(counts)]`."""
        return self.start_all_gather_counts(counts).wait()

    def start_all_gather_counts(self, counts: torch.Tensor, asynchronous: bool = False) -> Pending:
        if not self.active:
            return Pending(self, None, lambda: counts[None])
        parts = [torch.empty_like(counts) for _ in range(self.world)]
        with self._waiting():
            work = dist.all_gather(parts, counts, async_op=asynchronous)
        return Pending(self, work, lambda: torch.stack(parts))

    def to_host(self, t: torch.Tensor) -> list:
        """`t.tolist()`, counted as waiting: on GPUs this is where a late peer is waited for."""
        with self._waiting():
            return t.tolist()

    def all_to_all(
        self,
        x: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows to every rank by `send_splits`; received into `out` when given (a preallocated
        buffer view of exactly `sum(recv_splits)` rows)."""
        return self.start_all_to_all(x, send_splits, recv_splits, out).wait()

    def start_all_to_all(
        self,
        x: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        out: torch.Tensor | None = None,
        asynchronous: bool = False,
    ) -> Pending:
        if out is None:
            out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        result = out
        if not self.active:
            result.copy_(x)
            return Pending(self, None, lambda: result)
        with self._waiting():
            work = dist.all_to_all_single(
                result, x.contiguous(), recv_splits, send_splits, async_op=asynchronous
            )
        return Pending(self, work, lambda: result)

    def exchange(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]
    ) -> None:
        """Point-to-point: each (peer, tensor) of `sends` to its peer, each of `recvs` filled
        from its peer, all posted at once (no pair of ranks waits on the other's order). Between
        two ranks the i-th send of one side meets the i-th receive of the other."""
        if not self.active or not (sends or recvs):
            return
        ops = [dist.P2POp(dist.isend, t, peer) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in recvs]
        with self._waiting():
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    # -- control plane (CPU) --------------------------------------------------------------------
    # With a `codec` (a group whose ranks may run on several hosts: --placement remote) objects
    # travel in its closed-world encoding (`wire/tree.py`) as byte tensors; without, pickled by
    # torch.distributed's object collectives.
    def broadcast_object(self, obj: object) -> object:
        if not self.active:
            return obj
        if self.codec is not None:
            return self._broadcast_encoded(obj)
        box = [obj]
        with self._waiting():
            dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def gather_objects(self, obj: object) -> list[object] | None:
        """Every rank's object on the leader (None elsewhere)."""
        if not self.active:
            return [obj]
        if self.codec is not None:
            return self._gather_encoded(obj)
        out: list[object] | None = [None] * self.world if self.layout.rank == 0 else None
        with self._waiting():
            dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def _broadcast_encoded(self, obj: object) -> object:
        assert self.codec is not None
        leader = self.layout.rank == 0
        data = self.codec.encode(obj) if leader else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        with self._waiting():
            dist.broadcast(size, src=0, group=self.cpu_group)
            buf = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if leader
                else torch.empty(int(size.item()), dtype=torch.uint8)
            )
            if buf.numel():
                dist.broadcast(buf, src=0, group=self.cpu_group)
        return obj if leader else self.codec.decode(buf.numpy().tobytes())

    def _gather_encoded(self, obj: object) -> list[object] | None:
        assert self.codec is not None
        data = self.codec.encode(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        with self._waiting():
            dist.all_gather(sizes, size, group=self.cpu_group)
            width = max(int(s.item()) for s in sizes)
            padded = torch.zeros(width, dtype=torch.uint8)
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            leader = self.layout.rank == 0
            parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world)]
            dist.gather(padded, parts if leader else None, dst=0, group=self.cpu_group)
        if not leader:
            return None
        return [
            self.codec.decode(p[: int(n.item())].numpy().tobytes())
            for p, n in zip(parts, sizes, strict=True)
        ]
