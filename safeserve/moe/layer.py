"""An MoE block: router -> dispatch -> experts -> combine."""

from __future__ import annotations

from collections.abc import Callable

import torch

from safeserve.moe.dispatch.base import Dispatcher
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
        out = self.dispatcher.run(hidden_states, topk, self.experts, self.on_phase)
        if self.on_phase is not None:
            self.on_phase("attention")
        return out
