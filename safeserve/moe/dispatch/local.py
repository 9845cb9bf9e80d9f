"""One expert-parallel rank holds every expert: nothing moves; rounds only bound the work."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from safeserve.guards.admission import plan_token_rounds
from safeserve.moe.dispatch.base import CombineInput, Dispatcher, DispatchOutput, recv_views
from safeserve.moe.placement import ExpertPlacement
from safeserve.moe.topk import TopKOutput
from safeserve.parallel.schedule import Steps


@dataclass
class _State:
    hidden: torch.Tensor
    topk: TopKOutput
    rounds: list[list[tuple[int, int]]]
    out: torch.Tensor | None


class LocalDispatcher(Dispatcher):
    def __init__(self, placement: ExpertPlacement) -> None:
        if placement.ep_size != 1:
            raise ValueError("LocalDispatcher serves ep_size 1 only")
        self.placement = placement

    def prepare(self, hidden_states: torch.Tensor, topk: TopKOutput) -> Steps[_State]:
        n = hidden_states.shape[0]
        budget = self.budget or max(1, n)
        rounds = plan_token_rounds([n], budget)
        out = hidden_states.new_empty(hidden_states.shape) if self.buffers is not None else None
        return _State(hidden_states, topk, rounds, out)
        yield  # a generator with nothing to wait for

    def num_rounds(self, state: _State) -> int:
        return len(state.rounds)

    def dispatch(self, state: _State, round_index: int) -> Steps[DispatchOutput]:
        lo, hi = state.rounds[round_index][0]
        x, ids, w = state.hidden[lo:hi], state.topk.topk_ids[lo:hi], state.topk.topk_weights[lo:hi]
        buf_x, _ = recv_views(self.buffers, hi - lo)
        if buf_x is not None:
            buf_x.copy_(x)
            x = buf_x
        return DispatchOutput(x, ids, w, (lo, hi))
        yield

    def combine(
        self,
        state: _State,
        round_index: int,
        combine_input: CombineInput,
        during: Callable[[], None] | None = None,
    ) -> Steps[None]:
        if during is not None:
            during()
        if state.out is None:
            state.out = combine_input.hidden_states
            return
        lo, hi = combine_input.handle
        state.out[lo:hi] = combine_input.hidden_states
        yield

    def finish(self, state: _State) -> Steps[torch.Tensor]:
        assert state.out is not None
        return state.out
        yield
