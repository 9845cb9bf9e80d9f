"""Dispatch-buffer admission: no routing can make a rank receive more than its budget.

Every rank has a fixed receive budget `max_recv_tokens` (rows: one row is one token sent to one
rank, with its top-k choices that live there) and preallocates, once, the buffers those rows and
their expert work need. Before tokens move, the ranks share the count matrix (source x
destination). When a destination would receive more than its budget, the dispatch runs in rounds
that each fit. Every rank plans the same rounds from the same matrix, so no extra exchange is
needed, and the per-token results are summed after the last round: the output is the same as
with an unlimited budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from safeserve.guards.sizing import recv_row_bytes

# Received rows per round on one rank, planned per (source, destination) pair:
# rounds[r][s][d] = (start, stop) within the rows source s sends to destination d.
RoundPlan = list[list[list[tuple[int, int]]]]


def plan_rounds(counts: list[list[int]], budget: int) -> RoundPlan:
    """Cuts the rows of a count matrix into rounds that each fit `budget` at every destination.

    Per destination, rows are taken greedily in source order; a pair's rows may span rounds.
    The number of rounds is the largest `ceil(column sum / budget)` (at least 1).
    """
    if budget < 1:
        raise ValueError("budget must be at least 1")
    sources = len(counts)
    dests = len(counts[0]) if sources else 0
    col = [sum(counts[s][d] for s in range(sources)) for d in range(dests)]
    num_rounds = max([1] + [(c + budget - 1) // budget for c in col])
    rounds: RoundPlan = [[[(0, 0)] * dests for _ in range(sources)] for _ in range(num_rounds)]
    for d in range(dests):
        r, room = 0, budget
        for s in range(sources):
            start, left = 0, counts[s][d]
            while left > 0:
                take = min(left, room)
                rounds[r][s][d] = (start, start + take)
                start += take
                left -= take
                room -= take
                if room == 0:
                    r, room = r + 1, budget
    return rounds


def plan_token_rounds(per_rank: list[int], budget: int) -> list[list[tuple[int, int]]]:
    """Backend `none` (every rank receives every token): rounds over the tokens of all ranks, in
    rank order; `rounds[r][s]` = (start, stop) within source s's tokens."""
    total = sum(per_rank)
    num_rounds = max(1, (total + budget - 1) // budget)
    rounds = []
    offsets = [sum(per_rank[:s]) for s in range(len(per_rank))]
    for r in range(num_rounds):
        lo, hi = r * budget, min(total, (r + 1) * budget)
        rounds.append(
            [
                (max(lo, off) - off, max(max(lo, off), min(hi, off + n)) - off)
                for off, n in zip(offsets, per_rank, strict=True)
            ]
        )
    return rounds


def bytes_per_recv_row(
    hidden: int, moe_width: int, top_k: int, local_experts: int, dtype: torch.dtype
) -> int:
    """Memory one received row may need (`sizing.recv_row_bytes` at the dtype's size)."""
    return recv_row_bytes(hidden, moe_width, top_k, local_experts, dtype.itemsize)


@dataclass
class AdmissionStats:
    budget: int
    recv_peak: int = 0  # most rows received in one round since start
    rounds_total: int = 0  # rounds run (one per dispatch when nothing had to be cut)
    dispatches_cut: int = 0  # dispatches that needed more than one round
    buffer_bytes: int = 0  # preallocated
    buffer_peak_bytes: int = 0  # most of it ever in use

    def count_cut(self) -> None:
        self.dispatches_cut += 1


@dataclass
class DispatchBuffers:
    """Preallocated once, at the budget: received rows, their routing, the experts' output,
    and the per-expert intermediates of the torch expert path."""

    max_recv_tokens: int
    hidden: torch.Tensor  # [B, H]
    routing: torch.Tensor  # [B, 2k] float32: weights, then local ids
    expert_out: torch.Tensor  # [B, H]
    work_x: torch.Tensor  # [B, H]    one expert's rows
    work_gate_up: torch.Tensor  # [B, 2I]
    work_act: torch.Tensor  # [B, I]
    work_y: torch.Tensor  # [B, H]
    stats: AdmissionStats = field(init=False)

    @classmethod
    def allocate(
        cls,
        max_recv_tokens: int,
        hidden: int,
        moe_width: int,
        top_k: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> DispatchBuffers:
        b = max_recv_tokens

        def empty(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dt, device=device)

        bufs = cls(
            b,
            empty(b, hidden),
            empty(b, 2 * top_k, dt=torch.float32),
            empty(b, hidden),
            empty(b, hidden),
            empty(b, 2 * moe_width),
            empty(b, moe_width),
            empty(b, hidden),
        )
        bufs.stats = AdmissionStats(budget=b, buffer_bytes=bufs.nbytes)
        return bufs

    def halves(self) -> tuple[DispatchBuffers, DispatchBuffers]:
        """The buffers as two disjoint halves (views, no memory added), each with half the
        budget: the two micro-batches of a split step dispatch into their own half, one
        while the other's rows are still in use. Statistics stay shared."""
        half = self.max_recv_tokens // 2
        if half < 1:
            raise ValueError("splitting the dispatch buffers needs a budget of at least 2")
        parts = []
        for lo, hi in ((0, half), (half, 2 * half)):
            part = DispatchBuffers(
                hi - lo,
                self.hidden[lo:hi],
                self.routing[lo:hi],
                self.expert_out[lo:hi],
                self.work_x[lo:hi],
                self.work_gate_up[lo:hi],
                self.work_act[lo:hi],
                self.work_y[lo:hi],
            )
            part.stats = self.stats
            parts.append(part)
        return parts[0], parts[1]

    @property
    def nbytes(self) -> int:
        parts = (
            self.hidden,
            self.routing,
            self.expert_out,
            self.work_x,
            self.work_gate_up,
            self.work_act,
            self.work_y,
        )
        return sum(t.numel() * t.element_size() for t in parts)

    def row_bytes(self) -> int:
        return self.nbytes // self.max_recv_tokens

    def record_round(self, received: int) -> None:
        if received > self.max_recv_tokens:
            raise RuntimeError(
                f"admission violated: {received} rows > budget {self.max_recv_tokens}"
            )
        s = self.stats
        s.rounds_total += 1
        s.recv_peak = max(s.recv_peak, received)
        s.buffer_peak_bytes = max(s.buffer_peak_bytes, received * self.row_bytes())
