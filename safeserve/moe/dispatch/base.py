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


@dataclass
class StepTokens:
    """How this step's tokens sit on the group's ranks; the model runner sets it every step.

    `replicated`: every rank holds the same tokens (tensor-parallel attention); otherwise rank r
    holds its own `per_rank[r]` tokens (attention data-parallel).
    """

    per_rank: list[int]
    replicated: bool


class Dispatcher(ABC):
    """Moves tokens to their experts' ranks (`dispatch`) and the results back (`combine`)."""

    step: StepTokens | None = None
    # Tokens each source rank sends each destination rank in the last dispatch: the numbers the
    # admission guard reads before any token moves.
    last_count_matrix: torch.Tensor | None = None

    def begin_step(self, step: StepTokens) -> None:
        self.step = step

    @abstractmethod
    def dispatch(self, hidden_states: torch.Tensor, topk: TopKOutput) -> DispatchOutput: ...

    @abstractmethod
    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        """Returns [T, H] for the T tokens that entered `dispatch`, summed over all experts."""
