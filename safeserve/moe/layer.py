"""An MoE block: router -> dispatch -> experts -> combine, plus shared experts.

Shared experts (DeepSeek-V3, Qwen2-MoE) run on the token's own rank, never dispatched: every
rank holds them (split by width across the attention-TP ranks, with their own all-reduce, like
a dense MLP) and their output is added to the combined routed output; they depend on the
block's input only, so with single-batch overlap they run while the combine moves. A shared-expert gate (Qwen2-MoE)
scales their output by sigmoid(gate(x)).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from safeserve.kernels.linear import gemm
from safeserve.moe.dispatch.base import Dispatcher, DispatchOutput
from safeserve.moe.dispatch.local import LocalDispatcher
from safeserve.moe.eplb.recorder import ExpertDistributionRecorder
from safeserve.moe.expert_map import ExpertMap
from safeserve.moe.placement import ExpertPlacement
from safeserve.moe.runner import ExpertRunner
from safeserve.moe.topk import Router, RouterConfig
from safeserve.parallel.schedule import Steps, drive


class MoELayer(torch.nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        router: RouterConfig,
        placement: ExpertPlacement,
        dispatcher: Dispatcher,
        shared_experts: torch.nn.Module | None = None,
        shared_expert_gate: bool = False,
    ) -> None:
        """`shared_experts`: a module of the block's input returning the shared experts' whole
        output (a DenseMLP); `shared_expert_gate`: a sigmoid gate (h -> 1) scales it."""
        super().__init__()
        self.placement = placement
        self.gate = Router(hidden_size, num_experts, router)
        # one stacked weight per local physical slot (its logical expert's, as the loader fills)
        self.experts = ExpertRunner(placement.experts_per_rank, hidden_size, intermediate_size)
        self.dispatcher = dispatcher
        self.on_phase: Callable[[str], None] | None = None  # heartbeat hook of the rank
        self.shared_experts = shared_experts
        self.shared_expert_gate = (
            torch.nn.Linear(hidden_size, 1, bias=False) if shared_expert_gate else None
        )
        # Where this layer counts its routed tokens per physical slot (EPLB), as MoE layer
        # `moe_index` of the model; None: not recorded.
        self.recorder: ExpertDistributionRecorder | None = None
        self.moe_index = 0
        # --enable-single-batch-overlap: the shared experts run while the combine moves
        self.single_batch_overlap = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return drive(self.steps(hidden_states))

    def steps(self, hidden_states: torch.Tensor) -> Steps[torch.Tensor]:
        """The block as a computation that yields while its dispatch or combine moves
        (`parallel/schedule.py`). With single-batch overlap the shared experts run once the
        last combine is issued, before it is waited for."""
        topk = self.gate(hidden_states, *self._counting())
        shared: list[torch.Tensor] = []  # the shared experts' output, once computed
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
            during = None
            if self.shared_experts is not None and self.single_batch_overlap:

                def during() -> None:
                    shared.append(self._shared(hidden_states))

            out = yield from self.dispatcher.steps(
                hidden_states, topk, self.experts, self.on_phase, during
            )
        if self.shared_experts is not None:
            out = out + (shared[0] if shared else self._shared(hidden_states))
        if self.on_phase is not None:
            self.on_phase("attention")
        return out

    def _counting(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Where the router counts the step's routed choices (the recorder's open row of this
        layer, or None: not recorded) and which rows are tokens (a graph bucket's padding rows
        are not)."""
        if self.recorder is None:
            return None, None
        step = self.dispatcher.step
        return self.recorder.pass_row(self.moe_index), step.real if step is not None else None

    def _shared(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts
        assert shared is not None
        out = shared(hidden_states)
        if self.shared_expert_gate is not None:
            gate = self.shared_expert_gate
            out = torch.sigmoid(gemm(hidden_states, gate.weight, gate.bias)) * out
        return out

    def _direct(self, hidden_states: torch.Tensor) -> bool:
        budget = self.dispatcher.budget
        return (
            isinstance(self.dispatcher, LocalDispatcher)
            and hidden_states.is_cuda
            and (budget is None or hidden_states.shape[0] <= budget)
        )


def write_expert_map(
    layers: Sequence[MoELayer],
    expert_map: ExpertMap,
    source: int | None,
    only: Sequence[int] | None = None,
) -> None:
    """Each MoE layer's router map from `expert_map`: the send table of `source` (this rank's EP
    rank where it routes its own tokens, None where every rank routes the same ones:
    `routing_source`); with redundant experts the candidates that tokens spread over (of
    `source`, or with None of every rank, one per share of the tokens),
    `layers` in MoE-layer order, one per row of the map; copied in place into the routers'
    buffers. `only`: the MoE layers whose placement changed (a layer's router rows depend on
    its own placement alone); the others are left as they are."""
    if len(layers) != expert_map.num_layers:
        raise ValueError(
            f"expert map of {expert_map.num_layers} MoE layers for a model of {len(layers)}"
        )
    which = list(range(len(layers))) if only is None else list(only)
    if not which:
        return
    if expert_map.num_redundant == 0:  # one replica per expert: a plain [E] row per layer
        table = expert_map.send_table(source)
        for i in which:
            gate = layers[i].gate
            gate.set_expert_map(table[i].to(gate.logical_to_physical.device))
        return
    # Replicas split an expert's tokens: each source spreads them over its candidates. Where
    # every rank routes the same tokens, each contiguous share of them spreads as its rank would.
    sources = [source] if source is not None else list(range(expert_map.ep_size))
    tables = [expert_map.candidate_table(s, layers=which) for s in sources]
    slots = torch.stack([t[0] for t in tables], dim=1)  # [len(which), S, E, M]
    counts = torch.stack([t[1] for t in tables], dim=1)  # [len(which), S, E]
    for i, rows, cnt in zip(which, slots, counts, strict=True):
        gate = layers[i].gate
        device = gate.logical_to_physical.device
        gate.set_expert_map(rows.to(device), cnt.to(device))
