"""Backend `alltoall`: each token travels once to every rank holding one of its experts.

Before tokens move, ranks all-gather their per-destination counts into the count matrix
(source rank x destination rank); `all_to_all_single` with those splits sends the rows there
(in rounds that fit every destination's budget), and again with the splits swapped brings each
rank's expert sums back, where they are added up per token. With tensor-parallel attention
(tokens on every rank) each rank dispatches its own share of the tokens and the results are
all-gathered afterwards. Needs `ep_size == tp_size`.

A step that a CUDA graph captures (`StepTokens.graph`: decode steps, and prefill or mixed steps
up to --cuda-graph-max-tokens) cannot size its all-to-all from counts read on the host. There
the backend works as `none` does (it is its subclass): every rank holds the step's tokens (with
attention data-parallel, after an all-gather of fixed size: every rank's rows padded to the
graph's bucket), runs its own experts on them (the fused MoE skips the pairs whose experts live
elsewhere, so each (token, expert) pair is still computed once, on its expert's rank) and an
all-reduce sums the ranks' parts. No host sync, fixed shapes. Eager steps, the large ones that
the all-to-all's smaller transfers are for, keep the all-to-all. (DeepEP's peers split the same
way: normal mode for large eager steps, low-latency mode with fixed sizes for graphs.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from safeserve.guards.admission import plan_rounds
from safeserve.moe.dispatch.allgather import AllGatherDispatcher
from safeserve.moe.dispatch.base import CombineInput, DispatchOutput, recv_views
from safeserve.moe.placement import ExpertPlacement
from safeserve.moe.topk import TopKOutput
from safeserve.parallel.comm import Comm
from safeserve.parallel.schedule import Steps


@dataclass
class _State:
    send_rows: torch.Tensor  # which local token each sent row is, grouped by destination
    dest_rank: torch.Tensor  # where each sent row goes
    send_x: torch.Tensor  # [S, H] the rows, in that order
    send_meta: torch.Tensor  # [S, 2k] float32: weights, then destination-local expert ids
    counts: list[list[int]]  # the count matrix
    seg_start: list[int]  # first sent row of each destination
    rounds: list[list[list[tuple[int, int]]]]
    back: torch.Tensor  # [S + 1, H] results per sent row; the last row stays zero
    num_local: int
    top_k: int
    dtype: torch.dtype
    shares: list[int] | None  # per-rank shares when tokens were replicated


class AllToAllDispatcher(AllGatherDispatcher):
    def __init__(self, placement: ExpertPlacement, comm: Comm) -> None:
        if placement.ep_size != comm.world:
            raise ValueError("alltoall needs ep_size == tp_size")
        super().__init__(placement, comm)

    # A graph-captured step runs the `none` backend's methods (their state is not a _State).
    def _gathered(self, state: object) -> bool:
        return not isinstance(state, _State)

    def _share(self, num_tokens: int) -> list[int]:
        world = self.comm.world
        base, extra = divmod(num_tokens, world)
        return [base + (1 if r < extra else 0) for r in range(world)]

    def prepare(self, hidden_states: torch.Tensor, topk: TopKOutput) -> Steps[Any]:
        step = self.step
        assert step is not None, "begin_step() first"
        if step.graph:
            return (yield from super().prepare(hidden_states, topk))
        rank, world = self.comm.layout.rank, self.comm.world
        ids, weights = topk.topk_ids, topk.topk_weights
        shares = None
        if step.replicated:
            shares = self._share(hidden_states.shape[0])
            start = sum(shares[:rank])
            rows = slice(start, start + shares[rank])
            hidden_states, ids, weights = hidden_states[rows], ids[rows], weights[rows]
        num_local = hidden_states.shape[0]
        dest = self.placement.rank_of(ids)  # [n, k] destination rank of each choice
        hit = torch.zeros(num_local, world, dtype=torch.bool, device=ids.device)
        hit.scatter_(1, dest, True)
        # Per destination: the rows it receives and the (token, expert) pairs it computes (its
        # load, for the balancedness record), gathered in one collective.
        pairs = torch.bincount(dest.reshape(-1), minlength=world)
        pending = self.comm.start_all_gather_counts(
            torch.cat([hit.sum(dim=0), pairs]), self.asynchronous
        )
        # (destination, token) pairs grouped by destination, found without a second host sync.
        order = torch.argsort((~hit.t().reshape(-1)).to(torch.uint8), stable=True)
        gathered = yield from self._wait(pending)
        matrix = gathered[:, :world]
        both = self.comm.to_host(gathered)  # the one host sync: the splits and rounds need it
        counts = [row[:world] for row in both]
        self._record_loads([sum(row[world + d] for row in both) for d in range(world)])
        self.last_count_matrix = matrix
        step_tokens = sum(step.per_rank) if not step.replicated else step.per_rank[0]
        self._note_share(max(sum(c[d] for c in counts) for d in range(world)), step_tokens)
        chosen = order[: sum(counts[rank])]
        dest_rank, send_rows = chosen // num_local, chosen % num_local
        mine = dest[send_rows] == dest_rank[:, None]
        local_ids = torch.where(mine, self.placement.local_slot(ids[send_rows]), -1)
        # Routing travels as float32 columns (ids are exact in float32 up to 2**24).
        meta = torch.cat([weights[send_rows].to(torch.float32), local_ids.to(torch.float32)], dim=1)
        budget = self.budget or max(
            1, max((sum(c[d] for c in counts) for d in range(world)), default=1)
        )
        seg_start = [sum(counts[rank][:d]) for d in range(world)]
        total = len(send_rows)
        back = hidden_states.new_empty((total + 1, hidden_states.shape[1]))
        back[total].zero_()
        return _State(
            send_rows,
            dest_rank,
            hidden_states[send_rows],
            meta,
            counts,
            seg_start,
            plan_rounds(counts, budget),
            back,
            num_local,
            ids.shape[1],
            weights.dtype,
            shares,
        )

    def num_rounds(self, state: Any) -> int:
        return super().num_rounds(state) if self._gathered(state) else len(state.rounds)

    def _round_rows(
        self, state: _State, round_index: int
    ) -> tuple[torch.Tensor | None, list[int], list[int]]:
        """This rank's sent rows in a round (None: all of them), send and receive splits."""
        me = self.comm.layout.rank
        plan = state.rounds[round_index]
        send_splits = [hi - lo for lo, hi in plan[me]]
        recv_splits = [plan[s][me][1] - plan[s][me][0] for s in range(len(plan))]
        if len(state.rounds) == 1:
            return None, send_splits, recv_splits
        pieces = [
            torch.arange(
                state.seg_start[d] + lo, state.seg_start[d] + hi, device=state.send_x.device
            )
            for d, (lo, hi) in enumerate(plan[me])
        ]
        return torch.cat(pieces), send_splits, recv_splits

    def dispatch(self, state: Any, round_index: int) -> Steps[DispatchOutput]:
        if self._gathered(state):
            return (yield from super().dispatch(state, round_index))
        idx, send_splits, recv_splits = self._round_rows(state, round_index)
        x = state.send_x if idx is None else state.send_x[idx]
        meta = state.send_meta if idx is None else state.send_meta[idx]
        buf_x, buf_meta = recv_views(self.buffers, sum(recv_splits))
        a = self.asynchronous
        moving_x = self.comm.start_all_to_all(x, send_splits, recv_splits, buf_x, a)
        moving_meta = self.comm.start_all_to_all(meta, send_splits, recv_splits, buf_meta, a)
        recv_x = yield from self._wait(moving_x)
        recv_meta = moving_meta.wait()
        k = state.top_k
        return DispatchOutput(
            recv_x, recv_meta[:, k:].to(torch.int64), recv_meta[:, :k].to(state.dtype), round_index
        )

    def combine(
        self,
        state: Any,
        round_index: int,
        combine_input: CombineInput,
        during: Callable[[], None] | None = None,
    ) -> Steps[None]:
        if self._gathered(state):
            yield from super().combine(state, round_index, combine_input, during)
            return
        idx, send_splits, recv_splits = self._round_rows(state, round_index)
        out = state.back[:-1] if idx is None else None
        pending = self.comm.start_all_to_all(
            combine_input.hidden_states, recv_splits, send_splits, out, self.asynchronous
        )
        back = yield from self._wait(pending, during)
        if idx is not None:
            state.back[idx] = back

    def finish(self, state: Any) -> Steps[torch.Tensor]:
        if self._gathered(state):
            return (yield from super().finish(state))
        world = self.comm.world
        total = state.back.shape[0] - 1
        slot = torch.full(
            (state.num_local, world), total, dtype=torch.int64, device=state.back.device
        )
        slot[state.send_rows, state.dest_rank] = torch.arange(total, device=state.back.device)
        # A gather and a sum in float32, in rank order: no atomics, the same result every run.
        out = state.back[slot].sum(dim=1, dtype=torch.float32).to(state.back.dtype)
        if state.shares is not None:
            pending = self.comm.start_all_gather_rows(out, state.shares, self.asynchronous)
            out = yield from self._wait(pending)
        return out
