"""Backend `alltoall`: each token travels once to every rank holding one of its experts.

Before tokens move, ranks all-gather their per-destination counts into the count matrix
(source rank x destination rank); `all_to_all_single` with those splits sends tokens there, and
again with the splits swapped brings each rank's expert sums back, where they are added up per
token. With tensor-parallel attention (tokens on every rank) each rank dispatches its own share
of the tokens and the results are all-gathered afterwards. Needs `ep_size == tp_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from safeserve.engine.parallel import Comm
from safeserve.moe.dispatch.base import CombineInput, Dispatcher, DispatchOutput
from safeserve.moe.placement import ExpertPlacement
from safeserve.moe.topk import TopKOutput


@dataclass
class _Handle:
    send_rows: torch.Tensor  # which local token each sent row is
    dest_rank: torch.Tensor  # where each sent row went
    send_splits: list[int]
    recv_splits: list[int]
    num_local: int  # tokens this rank dispatched
    shares: list[int] | None  # per-rank shares when tokens were replicated


class AllToAllDispatcher(Dispatcher):
    def __init__(self, placement: ExpertPlacement, comm: Comm) -> None:
        if placement.ep_size != comm.world:
            raise ValueError("alltoall needs ep_size == tp_size")
        self.placement = placement
        self.comm = comm

    def _share(self, num_tokens: int) -> list[int]:
        world = self.comm.world
        base, extra = divmod(num_tokens, world)
        return [base + (1 if r < extra else 0) for r in range(world)]

    def dispatch(self, hidden_states: torch.Tensor, topk: TopKOutput) -> DispatchOutput:
        step = self.step
        assert step is not None, "begin_step() first"
        rank, world = self.comm.layout.rank, self.comm.world
        ids, weights = topk.topk_ids, topk.topk_weights
        shares = None
        if step.replicated:
            shares = self._share(hidden_states.shape[0])
            start = sum(shares[:rank])
            rows = slice(start, start + shares[rank])
            hidden_states, ids, weights = hidden_states[rows], ids[rows], weights[rows]
        num_local = hidden_states.shape[0]
        per_rank = self.placement.experts_per_rank
        dest = ids // per_rank  # [n, k] destination rank of each choice
        hit = torch.zeros(num_local, world, dtype=torch.bool, device=ids.device)
        hit.scatter_(1, dest, True)
        matrix = self.comm.all_gather_counts(hit.sum(dim=0))
        # (destination, token) pairs grouped by destination, found without a second host sync.
        flat = hit.t().reshape(-1)
        order = torch.argsort((~flat).to(torch.uint8), stable=True)
        counts = matrix.tolist()  # the one host sync: NCCL needs the splits on the host
        self.last_count_matrix = matrix
        send_splits = counts[rank]
        recv_splits = [row[rank] for row in counts]
        chosen = order[: sum(send_splits)]
        dest_rank, send_rows = chosen // num_local, chosen % num_local
        sent_ids = ids[send_rows]
        mine = dest[send_rows] == dest_rank[:, None]
        local_ids = torch.where(mine, sent_ids - dest_rank[:, None] * per_rank, -1)
        # Routing travels in one small all-to-all: weights and local ids as float32 columns
        # (ids are exact in float32 up to 2**24).
        top_k = ids.shape[1]
        meta = torch.cat([weights[send_rows].to(torch.float32), local_ids.to(torch.float32)], dim=1)
        recv_x = self.comm.all_to_all(hidden_states[send_rows], send_splits, recv_splits)
        recv_meta = self.comm.all_to_all(meta, send_splits, recv_splits)
        recv_w = recv_meta[:, :top_k].to(weights.dtype)
        recv_ids = recv_meta[:, top_k:].to(torch.int64)
        handle = _Handle(send_rows, dest_rank, send_splits, recv_splits, num_local, shares)
        return DispatchOutput(recv_x, recv_ids, recv_w, handle)

    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        h: _Handle = combine_input.handle
        world = self.comm.world
        # One spare zero row: tokens that did not go to some rank read it.
        back = self.comm.all_to_all(
            combine_input.hidden_states, h.recv_splits, h.send_splits, spare_rows=1
        )
        total = back.shape[0] - 1
        slot = torch.full((h.num_local, world), total, dtype=torch.int64, device=back.device)
        slot[h.send_rows, h.dest_rank] = torch.arange(total, device=back.device)
        # A gather and a sum in float32, in rank order: no atomics, the same result every run.
        out = back[slot].sum(dim=1, dtype=torch.float32).to(back.dtype)
        if h.shares is not None:
            out = self.comm.all_gather_rows(out, h.shares)
        return out
