"""Where physical experts live: contiguous blocks per expert-parallel rank."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlacement:
    """Physical expert p lives on EP rank `p // experts_per_rank`."""

    num_physical_experts: int
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        if self.num_physical_experts % self.ep_size:
            raise ValueError(
                f"{self.num_physical_experts} experts cannot be split evenly over ep_size "
                f"{self.ep_size}"
            )

    @property
    def experts_per_rank(self) -> int:
        return self.num_physical_experts // self.ep_size

    @property
    def local_start(self) -> int:
        return self.ep_rank * self.experts_per_rank

    @property
    def local_experts(self) -> range:
        return range(self.local_start, self.local_start + self.experts_per_rank)

    def rank_of(self, physical_expert: int) -> int:
        return physical_expert // self.experts_per_rank
