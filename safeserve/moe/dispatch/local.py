"""One expert-parallel rank holds every expert: nothing moves."""

from __future__ import annotations

import torch

from safeserve.moe.dispatch.base import CombineInput, Dispatcher, DispatchOutput
from safeserve.moe.placement import ExpertPlacement
from safeserve.moe.topk import TopKOutput


class LocalDispatcher(Dispatcher):
    def __init__(self, placement: ExpertPlacement) -> None:
        if placement.ep_size != 1:
            raise ValueError("LocalDispatcher serves ep_size 1 only")
        self.placement = placement

    def dispatch(self, hidden_states: torch.Tensor, topk: TopKOutput) -> DispatchOutput:
        return DispatchOutput(hidden_states, topk.topk_ids, topk.topk_weights)

    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        return combine_input.hidden_states
