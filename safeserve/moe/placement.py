"""One EP rank's view of the expert map (`expert_map.py`): the slots it holds, where others live.

Built as `ExpertPlacement.of(expert_map, ep_rank)`, or (as before the map) from the slot count
alone, `ExpertPlacement(num_physical_experts, ep_size, ep_rank)`: the trivial map, whatever the
number of layers. Every number here is the map's; the contiguous-block arithmetic lives there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from safeserve.moe.expert_map import ExpertMap


@dataclass(frozen=True)
class ExpertPlacement:
    """Physical slot p lives on EP rank `p // experts_per_rank`; `expert_map` (None: the trivial
    one) says which logical expert each slot holds, per MoE layer."""

    num_physical_experts: int
    ep_size: int = 1
    ep_rank: int = 0
    expert_map: ExpertMap | None = None
    _slots: ExpertMap = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        m = self.expert_map
        if m is None:  # the trivial map with no layer rows: the slots alone
            m = ExpertMap.trivial(self.num_physical_experts, self.ep_size, num_layers=0)
        elif (m.num_physical, m.ep_size) != (self.num_physical_experts, self.ep_size):
            raise ValueError(
                f"expert map of {m.num_physical} slots over {m.ep_size} ranks is not a placement "
                f"of {self.num_physical_experts} slots over {self.ep_size}"
            )
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"EP rank {self.ep_rank} not in [0, {self.ep_size})")
        object.__setattr__(self, "_slots", m)

    @staticmethod
    def of(expert_map: ExpertMap, ep_rank: int) -> ExpertPlacement:
        return ExpertPlacement(expert_map.num_physical, expert_map.ep_size, ep_rank, expert_map)

    def map_for(self, num_logical: int, num_layers: int) -> ExpertMap:
        """The expert map of a model with `num_logical` experts in `num_layers` MoE layers: the
        one given (checked against those sizes), else the trivial one."""
        m = self.expert_map
        if m is None:
            if num_logical != self.num_physical_experts:
                raise ValueError(
                    f"{self.num_physical_experts} physical experts without an expert map cannot "
                    f"place {num_logical} logical ones"
                )
            return ExpertMap.trivial(num_logical, self.ep_size, num_layers)
        if (m.num_logical, m.num_layers) != (num_logical, num_layers):
            raise ValueError(
                f"expert map of {m.num_logical} experts in {m.num_layers} MoE layers does not fit "
                f"a model of {num_logical} experts in {num_layers} MoE layers"
            )
        return m

    @property
    def experts_per_rank(self) -> int:
        """Physical slots per rank (this rank's local experts)."""
        return self._slots.slots_per_rank

    @property
    def local_start(self) -> int:
        return self.local_experts.start

    @property
    def local_experts(self) -> range:
        """This rank's physical slots."""
        return self._slots.local_slots(self.ep_rank)

    def rank_of(self, physical_expert: Any) -> Any:
        """The EP rank of physical slot(s) (an int, or a tensor elementwise)."""
        return self._slots.rank_of(physical_expert)

    def local_slot(self, physical_expert: Any) -> Any:
        """A slot's index on its own rank (an int, or a tensor elementwise; ids >= 0)."""
        return self._slots.local_slot(physical_expert)

    def to_local_ids(self, physical_ids: Any) -> Any:
        """Physical ids -> this rank's local slot index, -1 for slots held elsewhere."""
        return self._slots.to_local_ids(physical_ids, self.ep_rank)
