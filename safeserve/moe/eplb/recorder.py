"""How many tokens each physical expert receives, per MoE layer, summed over forward passes.

A MoE layer's router adds its routed top-k physical ids to `pass_row(layer)`, the open pass's row
of that layer (one atomic add per choice on the device, inside the launch that spreads choices
over replicas where there is one: `kernels.replica_spread`, else `kernels.expert_count`; no host
sync, and safe inside a captured CUDA graph since it writes a persistent buffer in place);
`end_pass()` closes the pass. Passes closed while `enabled` is False (warm-up, graph capture) are
dropped. The balancedness of the last 10/100/1000 counted passes is computed on request from
per-rank loads kept on the device, with the formula and windows of
`balancedness.BalancednessRecorder`.

A rank counts the ids it records; a group-wide distribution is the sum of its ranks' dumps.
"""

from __future__ import annotations

import torch

from safeserve.moe.eplb.balancedness import WINDOWS, BalancednessRecorder
from safeserve.moe.expert_map import ExpertMap


class ExpertDistributionRecorder:
    """Token counts per (layer, physical expert); physical slot p lives on rank p // slots_per_rank."""

    def __init__(
        self,
        num_layers: int,
        num_physical_experts: int,
        slots_per_rank: int,
        device: torch.device | str = "cpu",
        *,
        enabled: bool = True,
    ) -> None:
        if num_layers < 1 or num_physical_experts < 1:
            raise ValueError(
                f"need >= 1 layer and expert, got {num_layers} layers, "
                f"{num_physical_experts} physical experts"
            )
        if slots_per_rank < 1 or num_physical_experts % slots_per_rank:
            raise ValueError(
                f"{num_physical_experts} physical experts cannot be split into ranks of "
                f"{slots_per_rank} slots"
            )
        self.num_layers = num_layers
        self.num_physical_experts = num_physical_experts
        self.slots_per_rank = slots_per_rank
        self.num_ranks = num_physical_experts // slots_per_rank
        self.enabled = enabled
        shape = (num_layers, num_physical_experts)
        # the open pass in int32 (the counting kernel's atomics), the sums in int64
        self._pass = torch.zeros(shape, dtype=torch.int32, device=device)
        self._counts = torch.zeros(shape, dtype=torch.int64, device=device)
        # per-rank loads of the last max(WINDOWS) counted passes, a ring indexed by pass number
        self._rank_loads = torch.zeros(
            max(WINDOWS), num_layers, self.num_ranks, dtype=torch.int64, device=device
        )
        self._passes = 0
        self._balance = BalancednessRecorder()
        self._balance_passes = 0  # passes already folded into _balance

    @staticmethod
    def for_map(
        expert_map: ExpertMap, device: torch.device | str = "cpu", *, enabled: bool = True
    ) -> ExpertDistributionRecorder:
        """A recorder of `expert_map`'s layers and physical slots (its ranks' blocks of slots:
        the per-rank loads of the balancedness)."""
        return ExpertDistributionRecorder(
            expert_map.num_layers,
            expert_map.num_physical,
            expert_map.slots_per_rank,
            device,
            enabled=enabled,
        )

    @property
    def passes(self) -> int:
        """Counted passes since the last reset."""
        return self._passes

    def pass_row(self, layer: int) -> torch.Tensor:
        """The open pass's int32 counts of `layer` per physical slot, where its router adds its
        choices (`Router.forward(counts=...)`; -1 ids and padding rows are not counted)."""
        return self._pass[layer]

    def end_pass(self) -> None:
        """Closes the open pass: counted when enabled, dropped otherwise."""
        if self.enabled:
            self._counts += self._pass
            view = self._pass.view(self.num_layers, self.num_ranks, self.slots_per_rank)
            torch.sum(view, -1, out=self._rank_loads[self._passes % len(self._rank_loads)])
            self._passes += 1
        self._pass.zero_()

    def discard_pass(self) -> None:
        """Drops the open pass (a step that is not traffic)."""
        self._pass.zero_()

    def dump(self) -> torch.Tensor:
        """[num_layers, num_physical_experts] tokens per physical expert over the counted passes."""
        return self._counts.clone()

    def window_means(self) -> dict[int, float]:
        """Mean balancedness over the last w counted passes (fewer while fewer ran), per window.

        One host copy of the passes closed since the previous call.
        """
        new = self._passes - self._balance_passes
        ring = len(self._rank_loads)
        first = self._passes - min(new, ring)
        if first < self._passes:
            slots = [p % ring for p in range(first, self._passes)]
            for per_layer in self._rank_loads[slots].tolist():
                for loads in per_layer:
                    self._balance.record_layer(loads)
                self._balance.end_pass()
        self._balance_passes = self._passes
        return self._balance.window_means()

    def reset(self) -> None:
        """Forgets every pass, counted or open."""
        self._pass.zero_()
        self._counts.zero_()
        self._rank_loads.zero_()
        self._passes = 0
        self._balance.clear()
        self._balance_passes = 0


def physical_to_logical_counts(
    physical_count: torch.Tensor, physical_to_logical: torch.Tensor, num_logical_experts: int
) -> torch.Tensor:
    """[L, E] tokens per logical expert from [L, P] per physical slot: the sum over its replicas
    (`physical_to_logical`: an expert map's `phy2log_tensor()`)."""
    if physical_count.dim() != 2 or physical_count.shape != physical_to_logical.shape:
        raise ValueError(
            f"physical counts {tuple(physical_count.shape)} and physical_to_logical "
            f"{tuple(physical_to_logical.shape)} must both be [num_layers, num_physical_experts]"
        )
    index = physical_to_logical.to(physical_count.device, torch.int64)
    out = torch.zeros(
        physical_count.size(0),
        num_logical_experts,
        dtype=physical_count.dtype,
        device=physical_count.device,
    )
    return out.scatter_add_(1, index, physical_count)
