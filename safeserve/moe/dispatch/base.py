"""The dispatcher interface and the small types that pass between the MoE stages."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from safeserve.moe.topk import TopKOutput


@dataclass
class DispatchOutput:
    """Tokens this rank must run its local experts on.

    `topk_ids` holds local expert indices (0 .. experts_per_rank-1), or -1 for a choice whose
    expert lives on another rank; the runner skips those.
    """

    hidden_states: torch.Tensor  # [N, H]
    topk_ids: torch.Tensor  # [N, k]
    topk_weights: torch.Tensor  # [N, k]
    handle: Any = None  # whatever the backend needs to combine


@dataclass
class CombineInput:
    """Per received row, the routing-weighted sum of this rank's experts' outputs."""

    hidden_states: torch.Tensor  # [N, H]
    handle: Any = None


class Dispatcher(ABC):
    """Moves tokens to their experts' ranks (`dispatch`) and the results back (`combine`)."""

    @abstractmethod
    def dispatch(self, hidden_states: torch.Tensor, topk: TopKOutput) -> DispatchOutput: ...

    @abstractmethod
    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        """Returns [T, H] for the T tokens that entered `dispatch`, summed over all experts."""
