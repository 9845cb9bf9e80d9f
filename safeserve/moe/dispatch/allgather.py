"""Backend `none`: every rank computes its experts over all the group's tokens, then a sum.

With tensor-parallel attention the tokens are already on every rank; with attention
data-parallel they are all-gathered first and each rank keeps its own rows of the sum. Works for
any layout, including `ep_size < tp_size` (each rank then holds a slice of every expert's FFN).
Every rank receives every token, so rounds cut the group's tokens (in rank order) into pieces of
at most the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from safeserve.guards.admission import plan_token_rounds
from safeserve.moe.dispatch.base import CombineInput, Dispatcher, DispatchOutput, recv_views
from safeserve.moe.placement import ExpertPlacement
from safeserve.moe.topk import TopKOutput
from safeserve.parallel.comm import Comm
from safeserve.parallel.schedule import Steps


@dataclass
class _State:
    hidden: torch.Tensor
    topk: TopKOutput
    sources: list[int]  # tokens per source (one source when replicated)
    rounds: list[list[tuple[int, int]]]
    out: torch.Tensor
    loads: torch.Tensor | None = None  # [ep_size] (token, expert) pairs per EP rank


class AllGatherDispatcher(Dispatcher):
    def __init__(self, placement: ExpertPlacement, comm: Comm) -> None:
        """`placement`: this rank's view of the expert map (which rank holds each physical
        slot, and this rank's local slot of it)."""
        self.placement = placement
        self.comm = comm

    def prepare(self, hidden_states: torch.Tensor, topk: TopKOutput) -> Steps[_State]:
        step = self.step
        assert step is not None, "begin_step() first"
        sources = [hidden_states.shape[0]] if step.replicated else list(step.per_rank)
        budget = self.budget or max(1, sum(sources))
        matrix = torch.tensor([[n] * self.comm.world for n in sources])
        self.host_effect(lambda: setattr(self, "last_count_matrix", matrix))
        rounds = plan_token_rounds(sources, budget)
        self._note_share(sum(sources), sum(sources))  # every rank receives every token
        return _State(
            hidden_states, topk, sources, rounds, hidden_states.new_empty(hidden_states.shape)
        )
        yield  # nothing to wait for: every rank knows every source's token count

    def num_rounds(self, state: _State) -> int:
        return len(state.rounds)

    def _mine(self, state: _State, round_index: int) -> tuple[int, int]:
        me = 0 if len(state.sources) == 1 else self.comm.layout.rank
        return state.rounds[round_index][me]

    def dispatch(self, state: _State, round_index: int) -> Steps[DispatchOutput]:
        lo, hi = self._mine(state, round_index)
        x, ids, w = state.hidden[lo:hi], state.topk.topk_ids[lo:hi], state.topk.topk_weights[lo:hi]
        real = self.step.real if self.step is not None else None
        if real is not None:  # a graph bucket's padding rows: no expert, no load
            ids = torch.where(real[lo:hi, None], ids, -1)
        if len(state.sources) > 1:
            sizes = [b - a for a, b in state.rounds[round_index]]
            a = self.asynchronous
            gathers = [self.comm.start_all_gather_rows(t, sizes, a) for t in (x, ids, w)]
            x = yield from self._wait(gathers[0])
            ids, w = gathers[1].wait(), gathers[2].wait()
        if self.placement.ep_size > 1:  # every rank sees the round's whole routing
            # A scatter, not torch.bincount: no host sync, so the step can be a CUDA graph.
            dest = self.placement.rank_of(ids).reshape(-1).long()
            loads = torch.zeros(self.placement.ep_size, dtype=torch.int64, device=ids.device)
            loads.scatter_add_(0, dest.clamp(min=0), (dest >= 0).long())  # -1: dropped
            state.loads = loads if state.loads is None else state.loads + loads
        buf_x, _ = recv_views(self.buffers, x.shape[0])
        if buf_x is not None:
            buf_x.copy_(x)
            x = buf_x
        return DispatchOutput(x, self.placement.to_local_ids(ids), w, round_index)

    def combine(
        self,
        state: _State,
        round_index: int,
        combine_input: CombineInput,
        during: Callable[[], None] | None = None,
    ) -> Steps[None]:
        pending = self.comm.start_all_reduce(combine_input.hidden_states, self.asynchronous)
        y = yield from self._wait(pending, during)
        lo, hi = self._mine(state, round_index)
        if len(state.sources) > 1:
            me = self.comm.layout.rank
            start = sum(b - a for a, b in state.rounds[round_index][:me])
            y = y[start : start + hi - lo]
        state.out[lo:hi] = y

    def finish(self, state: _State) -> Steps[torch.Tensor]:
        if state.loads is not None:
            self._record_loads(state.loads)
        return state.out
        yield
