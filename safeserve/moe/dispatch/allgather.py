"""Backend `none`: every rank computes its experts over all the group's tokens, then a sum.

With tensor-parallel attention the tokens are already on every rank; with attention
data-parallel they are all-gathered first and each rank keeps its own rows of the sum. Works for
any layout, including `ep_size < tp_size` (each rank then holds a slice of every expert's FFN).
"""

from __future__ import annotations

import torch

from safeserve.engine.parallel import Comm
from safeserve.moe.dispatch.base import CombineInput, Dispatcher, DispatchOutput
from safeserve.moe.placement import ExpertPlacement
from safeserve.moe.topk import TopKOutput


def to_local_ids(topk_ids: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """Physical ids -> this rank's local expert index, -1 for experts held elsewhere."""
    local = topk_ids - placement.local_start
    held = (local >= 0) & (local < placement.experts_per_rank)
    return torch.where(held, local, torch.full_like(local, -1))


class AllGatherDispatcher(Dispatcher):
    def __init__(self, placement: ExpertPlacement, comm: Comm) -> None:
        self.placement = placement
        self.comm = comm

    def dispatch(self, hidden_states: torch.Tensor, topk: TopKOutput) -> DispatchOutput:
        step = self.step
        assert step is not None, "begin_step() first"
        ids, weights = topk.topk_ids, topk.topk_weights
        if not step.replicated:
            hidden_states = self.comm.all_gather_rows(hidden_states, step.per_rank)
            ids = self.comm.all_gather_rows(ids, step.per_rank)
            weights = self.comm.all_gather_rows(weights, step.per_rank)
        return DispatchOutput(hidden_states, to_local_ids(ids, self.placement), weights)

    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        step = self.step
        assert step is not None
        out = self.comm.all_reduce(combine_input.hidden_states)
        if step.replicated:
            return out
        rank = self.comm.layout.rank
        start = sum(step.per_rank[:rank])
        return out[start : start + step.per_rank[rank]]
