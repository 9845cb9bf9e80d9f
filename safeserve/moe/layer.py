"""An MoE block: router -> dispatch -> experts -> combine."""

from __future__ import annotations

from collections.abc import Callable

import torch

from safeserve.moe.dispatch.base import Dispatcher, DispatchOutput
from safeserve.moe.dispatch.local import LocalDispatcher
from safeserve.moe.placement import ExpertPlacement
from safeserve.moe.runner import ExpertRunner
from safeserve.moe.topk import Router


class MoELayer(torch.nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        placement: ExpertPlacement,
        dispatcher: Dispatcher,
    ) -> None:
        super().__init__()
        self.placement = placement
        self.gate = Router(hidden_size, num_experts, top_k, renormalize)
        self.experts = ExpertRunner(placement.experts_per_rank, hidden_size, intermediate_size)
        self.dispatcher = dispatcher
        self.on_phase: Callable[[str], None] | None = None  # heartbeat hook of the rank

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk = self.gate(hidden_states)
        if self._direct(hidden_states):
            # One rank, one round, CUDA: the fused MoE allocates its own (budget-bounded)
            # buffers, so staging the rows in the receive buffer and back is two copies for
            # nothing; the round is still recorded as the dispatcher would.
            buffers, rows = self.dispatcher.buffers, hidden_states.shape[0]
            if buffers is not None:
                self.dispatcher.host_effect(lambda: buffers.record_round(rows))
            if self.on_phase is not None:
                self.on_phase("experts")
            d = DispatchOutput(hidden_states, topk.topk_ids, topk.topk_weights)
            out = self.experts(d).hidden_states
        else:
            out = self.dispatcher.run(hidden_states, topk, self.experts, self.on_phase)
        if self.on_phase is not None:
            self.on_phase("attention")
        return out

    def _direct(self, hidden_states: torch.Tensor) -> bool:
        budget = self.dispatcher.budget
        return (
            isinstance(self.dispatcher, LocalDispatcher)
            and hidden_states.is_cuda
            and (budget is None or hidden_states.shape[0] <= budget)
        )
