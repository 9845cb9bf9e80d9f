"""Stage 1: the router. Hidden states in, top-k physical expert ids and weights out.

A `RouterConfig` says how a family routes: softmax or sigmoid scores, renormalized or not,
selection restricted to the best `topk_group` of `n_group` expert groups (a group's score: the
sum of its two best experts), a per-expert correction bias that steers the choice but not the
weights, and a scaling factor of the routed output. Softmax routing without groups, bias or
scaling runs as one Triton launch on CUDA (`safeserve.kernels.router_topk`); every other
configuration runs the router GEMM, then the grouped top-k kernel on CUDA
(`safeserve.kernels.grouped_topk`), or the torch path below elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from safeserve.kernels.common import batch_invariant
from safeserve.kernels.expert_count import count_experts
from safeserve.kernels.grouped_topk import fused_grouped_topk, grouped_topk_torch
from safeserve.kernels.linear import gemm
from safeserve.kernels.replica_spread import spread_ids
from safeserve.kernels.topk_softmax import skew_ids, softmax_topk

__all__ = ["RouterConfig", "Router", "TopKOutput", "grouped_topk", "skew_ids", "softmax_topk"]


@dataclass(frozen=True)
class RouterConfig:
    top_k: int
    renormalize: bool
    scoring: str = "softmax"  # or "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    correction_bias: bool = False  # `e_score_correction_bias`: steers the choice only
    routed_scaling_factor: float = 1.0
    logits_fp32: bool = False  # the router GEMM in float32 (DeepSeek-V3's gate)

    @property
    def plain_softmax(self) -> bool:
        """What the fused router kernel computes."""
        return (
            self.scoring == "softmax"
            and self.n_group <= 1
            and not self.correction_bias
            and self.routed_scaling_factor == 1.0
            and not self.logits_fp32
        )


@dataclass
class TopKOutput:
    """Routing of a batch: for each token, its top-k physical expert ids and their weights."""

    topk_ids: torch.Tensor  # [T, k] int64, physical expert ids
    topk_weights: torch.Tensor  # [T, k] in the hidden dtype
    router_logits: torch.Tensor  # [T, E] (kept for load statistics and tests)


def grouped_topk(
    router_logits: torch.Tensor,
    cfg: RouterConfig,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (softmax or sigmoid, float32), the choice among the best `topk_group` groups by
    score + bias, weights from the unbiased scores (renormalized, scaled). As transformers'
    DeepSeek-V3 router does it (`safeserve.kernels.grouped_topk.grouped_topk_torch`: the CPU
    path and the oracle of the kernel that routes these configurations on CUDA)."""
    return grouped_topk_torch(
        router_logits,
        cfg.top_k,
        cfg.renormalize,
        cfg.scoring,
        cfg.n_group,
        cfg.topk_group,
        bias,
        cfg.routed_scaling_factor,
        out_dtype,
    )


class Router(torch.nn.Module):
    """The gate: a bias-free linear to expert logits, then the family's top-k selection."""

    def __init__(self, hidden_size: int, num_experts: int, cfg: RouterConfig) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.cfg = cfg
        self.top_k = cfg.top_k
        self.renormalize = cfg.renormalize
        self.e_score_correction_bias = (
            torch.nn.Parameter(torch.zeros(num_experts), requires_grad=False)
            if cfg.correction_bias
            else None
        )
        # Logical -> physical expert id: this layer's row of the rank's send table (the expert
        # map's `send_table`), written in place by `set_expert_map`; identity until then.
        self.register_buffer("logical_to_physical", torch.arange(num_experts), persistent=False)
        # With redundant experts: `spread[S, E, M]` physical slots and `spread_count[S, E]`,
        # each source share's candidates per expert (`ExpertMap.candidates`); S is 1 where this
        # rank routes its own tokens, the EP size where every rank routes the same tokens (share
        # s: the s-th contiguous equal share of them, as the all-to-all splits them). The
        # kernels then map through the identity and the n-th (token, expert) pair of share s
        # choosing e in the batch (pairs in token order) goes to
        # `spread[s, e, n % spread_count[s, e]]`: an expert's replicas take equal shares of
        # each batch (within one). None: `logical_to_physical` alone.
        self.register_buffer("spread", None, persistent=False)
        self.register_buffer("spread_count", None, persistent=False)
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
        if self.cfg.logits_fp32:  # kept in float32 whatever the model's dtype, as transformers
            # keeps DeepSeek-V3's `gate.weight` and `e_score_correction_bias` (values kept)
            for name in ("weight", "e_score_correction_bias"):
                p = getattr(self, name)
                if p is not None and p.dtype != torch.float32:
                    setattr(self, name, torch.nn.Parameter(p.detach().float(), requires_grad=False))

    def set_expert_map(self, rows: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Writes this layer's logical -> physical map into the buffers the router reads, in
        place (captured CUDA graphs follow them): `rows` `[E]` physical slots, one replica per
        expert; or `rows` `[S, E, M]` candidates with their `counts` `[S, E]` (`spread`;
        allocated by the first call, before any graph is captured, and only copied into
        after)."""
        experts = self.logical_to_physical.shape[0]
        if rows.dim() == 1 and rows.shape[0] == experts and counts is None:
            if self.spread is not None:
                raise ValueError("this router spreads tokens over replicas: give [S, E, M] rows")
            self.logical_to_physical.copy_(rows)
            return
        if (
            rows.dim() != 3
            or rows.shape[1] != experts
            or counts is None
            or counts.shape != rows.shape[:2]
        ):
            raise ValueError(
                f"expert map rows of shape {tuple(rows.shape)} (counts "
                f"{None if counts is None else tuple(counts.shape)}) for a router of {experts} "
                "experts"
            )
        device = self.logical_to_physical.device
        if self.spread is None:
            self.logical_to_physical.copy_(torch.arange(experts))
            self.spread = torch.empty_like(rows, device=device)
            self.spread_count = torch.empty_like(counts, device=device)
        elif self.spread.shape != rows.shape:
            raise ValueError(
                f"expert map rows of shape {tuple(rows.shape)} for a router spreading over "
                f"{tuple(self.spread.shape)}"
            )
        self.spread.copy_(rows)
        self.spread_count.copy_(counts)  # type: ignore[union-attr]

    @property
    def skew_expert(self) -> int | None:
        return self._skew_expert

    @skew_expert.setter
    def skew_expert(self, expert: int | None) -> None:
        """Set (or clear, None) the route skew; written in place on the router's stream."""
        self._skew_expert = expert
        self.skew.fill_(-1 if expert is None else expert % self.weight.shape[0])

    def forward(
        self,
        hidden_states: torch.Tensor,
        counts: torch.Tensor | None = None,
        real: torch.Tensor | None = None,
    ) -> TopKOutput:
        """The batch's routing; with `counts` (a recorder's open row of this layer, int32 per
        physical slot) its physical choices are added there, but for the rows where `real` (bool,
        one per token) is False: inside the replica spread's launch where experts have
        replicas."""
        if hidden_states.is_cuda and self.cfg.plain_softmax and not batch_invariant():
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
            return self._output(ids, weights, logits, counts, real)
        if self.cfg.logits_fp32:
            logits = gemm(hidden_states.float(), self.weight.float())
        else:
            logits = gemm(hidden_states, self.weight)
        if hidden_states.is_cuda:
            # Triton: the grouped / biased / scaled top-k, the skew and the id mapping.
            cfg = self.cfg
            weights, ids = fused_grouped_topk(
                logits,
                cfg.top_k,
                cfg.renormalize,
                cfg.scoring,
                cfg.n_group,
                cfg.topk_group,
                self.e_score_correction_bias,
                cfg.routed_scaling_factor,
                hidden_states.dtype,
                self.logical_to_physical,
                skew=self.skew,
            )
            return self._output(ids, weights, logits, counts, real)
        if self.cfg.plain_softmax:
            weights, logical_ids = softmax_topk(
                logits, self.top_k, self.renormalize, hidden_states.dtype
            )
        else:
            weights, logical_ids = grouped_topk(
                logits, self.cfg, self.e_score_correction_bias, hidden_states.dtype
            )
        if self._skew_expert is not None:
            # Fault injection: every token picks the experts starting at one (the worst skew),
            # as the kernels do it.
            logical_ids = skew_ids(logical_ids, self.skew, logits.shape[-1])
        return self._output(self.logical_to_physical[logical_ids], weights, logits, counts, real)

    def _output(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        logits: torch.Tensor,
        counts: torch.Tensor | None,
        real: torch.Tensor | None,
    ) -> TopKOutput:
        if self.spread is not None:  # the kernels mapped through the identity: ids are logical
            assert self.spread_count is not None
            ids = spread_ids(ids, self.spread, self.spread_count, counts, real)
        elif counts is not None:
            count_experts(ids, counts, real)
        return TopKOutput(ids, weights, logits)
