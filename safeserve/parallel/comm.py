"""The collectives the model uses (`Layout`, who a rank is in its group, is in `layout.py`).

A group of `tp_size` ranks forms its own `torch.distributed` world (gloo on CPU, NCCL on GPU),
plus a gloo group on which the leader broadcasts each step's plan. Expert parallelism splits the
same ranks into `ep_size` expert blocks of `moe_tp_size = tp_size / ep_size` ranks each; each
rank of a block holds a slice of those experts' FFN width.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from safeserve.parallel.layout import Layout

# A collective is never waited out: the watchdog fences a group long before this.
_COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)


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
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.active:
            with self._waiting():
                dist.all_reduce(x)
        return x

    def all_gather_rows(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenates every rank's rows (rank r holds sizes[r] rows) on every rank."""
        if not self.active:
            return x
        width = max(sizes)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        with self._waiting():
            dist.all_gather(parts, padded)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])

    def all_gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D count vector stacked: `[world, len(counts)]`."""
        if not self.active:
            return counts[None]
        parts = [torch.empty_like(counts) for _ in range(self.world)]
        with self._waiting():
            dist.all_gather(parts, counts)
        return torch.stack(parts)

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
        if out is None:
            out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        if not self.active:
            out.copy_(x)
            return out
        with self._waiting():
            dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits)
        return out

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
    def broadcast_object(self, obj: object) -> object:
        if not self.active:
            return obj
        box = [obj]
        with self._waiting():
            dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def gather_objects(self, obj: object) -> list[object] | None:
        """Every rank's object on the leader (None elsewhere)."""
        if not self.active:
            return [obj]
        out: list[object] | None = [None] * self.world if self.layout.rank == 0 else None
        with self._waiting():
            dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out
