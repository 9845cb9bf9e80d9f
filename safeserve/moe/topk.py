"""Stage 1: the router. Hidden states in, top-k physical expert ids and weights out."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TopKOutput:
    """Routing of a batch: for each token, its top-k physical expert ids and their weights."""

    topk_ids: torch.Tensor  # [T, k] int64, physical expert ids
    topk_weights: torch.Tensor  # [T, k] in the hidden dtype
    router_logits: torch.Tensor  # [T, E] (kept for load statistics and tests)


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, take the top k, optionally renormalize them to sum to 1."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids


def skew_ids(ids: torch.Tensor, skew: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Route skew (fault injection), as the router kernels apply it: where skew[0] >= 0, every
    row's ids become skew, skew + 1, ... (mod num_experts); else `ids` unchanged. No host sync."""
    top_k = ids.shape[-1]
    skewed = (skew + torch.arange(top_k, device=ids.device)) % num_experts
    return torch.where(skew >= 0, skewed.to(ids.dtype).expand_as(ids), ids)


class Router(torch.nn.Module):
    """Qwen3-MoE gate: a bias-free linear to expert logits, softmax, top-k."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k = top_k
        self.renormalize = renormalize
        # Logical -> physical expert id; identity until a load balancer moves experts.
        self.register_buffer("logical_to_physical", torch.arange(num_experts), persistent=False)
        # Fault injection (route_skew): the first expert every token is sent to, -1 = off. A
        # device tensor that the router kernels read at run time, so captured CUDA graphs
        # follow it being set and cleared.
        self.register_buffer("skew", torch.full((1,), -1, dtype=torch.int64), persistent=False)
        self._skew_expert: int | None = None

    def reset_buffers(self, device: torch.device | str) -> None:
        """Identity expert map and no skew, on `device` (after the model left the meta device)."""
        self.logical_to_physical = torch.arange(self.weight.shape[0], device=device)
        self.skew = torch.full((1,), -1, dtype=torch.int64, device=device)
        self._skew_expert = None

    @property
    def skew_expert(self) -> int | None:
        return self._skew_expert

    @skew_expert.setter
    def skew_expert(self, expert: int | None) -> None:
        """Set (or clear, None) the route skew; written in place on the router's stream."""
        self._skew_expert = expert
        self.skew.fill_(-1 if expert is None else expert % self.weight.shape[0])

    def forward(self, hidden_states: torch.Tensor) -> TopKOutput:
        if hidden_states.is_cuda:
            # Triton: the router GEMM (decode-sized batches) and the same float32 top-k math,
            # the weights' cast, the skew and the id mapping, in one launch.
            from safeserve.kernels.router_topk import router_topk

            weights, ids, logits = router_topk(
                hidden_states,
                self.weight,
                self.top_k,
                self.renormalize,
                hidden_states.dtype,
                self.logical_to_physical,
                skew=self.skew,
            )
            return TopKOutput(ids, weights, logits)
        logits = F.linear(hidden_states, self.weight)
        weights, logical_ids = softmax_topk(
            logits, self.top_k, self.renormalize, hidden_states.dtype
        )
        if self._skew_expert is not None:
            # Fault injection: every token picks the experts starting at one (the worst skew),
            # as the kernels do it.
            logical_ids = skew_ids(logical_ids, self.skew, logits.shape[-1])
        return TopKOutput(self.logical_to_physical[logical_ids], weights, logits)
