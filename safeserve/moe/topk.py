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


class Router(torch.nn.Module):
    """Qwen3-MoE gate: a bias-free linear to expert logits, softmax, top-k."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k = top_k
        self.renormalize = renormalize
        # Logical -> physical expert id; identity until a load balancer moves experts.
        self.register_buffer("logical_to_physical", torch.arange(num_experts), persistent=False)
        self.skew_expert: int | None = None  # set only by fault injection (route_skew)

    def forward(self, hidden_states: torch.Tensor) -> TopKOutput:
        if hidden_states.is_cuda and self.skew_expert is None:
            # Triton: the router GEMM (decode-sized batches) and the same float32 top-k math,
            # the weights' cast and the id mapping, in one launch.
            from safeserve.kernels.topk_softmax import router_topk

            weights, ids, logits = router_topk(
                hidden_states,
                self.weight,
                self.top_k,
                self.renormalize,
                hidden_states.dtype,
                self.logical_to_physical,
            )
            return TopKOutput(ids, weights, logits)
        logits = F.linear(hidden_states, self.weight)
        weights, logical_ids = softmax_topk(
            logits, self.top_k, self.renormalize, hidden_states.dtype
        )
        if self.skew_expert is not None:
            # Fault injection: every token picks the experts starting at one (the worst skew).
            skewed = (
                self.skew_expert + torch.arange(self.top_k, device=logits.device)
            ) % logits.shape[-1]
            logical_ids = skewed.expand_as(logical_ids)
        return TopKOutput(self.logical_to_physical[logical_ids], weights, logits)
