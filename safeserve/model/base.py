"""What every family's model is to the engine: token embeddings, decoder layers over the paged
KV cache (each with `is_moe`, and as `mlp` an `MoELayer` where it is), a final norm and the LM
head. A family builds its layers and its rotary embedding; the rest is here.

The engine relies on: `forward(input_ids, positions, meta, kv_caches)` -> final hidden states
[T, H]; `compute_logits(hidden)` -> float32 logits; `layers[i].is_moe` and `layers[i].mlp`
(`.gate`, `.experts`, `.on_phase`); `embed_tokens`, `lm_head`; `fuse_projections()` once the
parameters are allocated; `reset_buffers(device)` after the model left the meta device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from safeserve.kernels.linear import gemm
from safeserve.layers.norm import RMSNorm
from safeserve.layers.paged_attention import AttentionMetadata
from safeserve.model.config import ModelConfig
from safeserve.parallel.schedule import Steps, bound, drive, interleave


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], rotary: nn.Module) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Returns the final hidden states [T, H] of every scheduled token."""
        return drive(self.steps(input_ids, positions, meta, kv_caches))

    def steps(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> Steps[torch.Tensor]:
        """`forward` as a computation that yields while an MoE block's tokens move."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        residual: torch.Tensor | None = None
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            yield i  # about to compute layer i's attention (schedule.interleave)
            x, residual = yield from layer.steps(x, residual, cos, sin, meta, kv)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_norm(x, residual)[0]

    @torch.inference_mode()
    def forward_split(
        self,
        parts: Sequence[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        enter: Sequence[Callable[[], None]],
    ) -> torch.Tensor:
        """Two-batch overlap: two micro-batches' (input ids, positions, metadata) run layer by
        layer in turns (`schedule.interleave`), each taking a turn while the other's dispatch
        or combine moves; `enter[i]` makes micro-batch i the dispatcher's context before each
        of its turns. Returns the final hidden states of both, in order. The first always
        computes a layer's attention before the second does, so a sequence cut across the two
        finds its first piece's keys and values in the cache."""
        first, second = (
            bound(self.steps(ids, pos, meta, kv_caches), fn)
            for (ids, pos, meta), fn in zip(parts, enter, strict=True)
        )
        a, b = interleave(first, second)
        return torch.cat([a, b])

    def fuse_projections(self) -> None:
        """Projections of one input as one GEMM each; call once the parameters are allocated."""
        for m in self.modules():
            if m is not self and hasattr(m, "fuse_projections"):
                m.fuse_projections()

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recomputes the non-persistent buffers (rotary frequencies, router maps) on `device`."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_buffers"):
                m.reset_buffers(device)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gemm(hidden, self.lm_head.weight, self.lm_head.bias).float()
