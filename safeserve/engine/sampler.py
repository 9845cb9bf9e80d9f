"""Next-token sampling: greedy, temperature, top-k, top-p, and per-request seeds.

A seeded request draws its i-th token from a generator seeded by (seed, i), so its output does not
depend on what it was batched with, nor on a preemption that recomputes it.
"""

from __future__ import annotations

import torch

from safeserve.messages import SamplingParams

_SEED_STRIDE = 1_000_003


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_positions: list[int],
    default_seed: int = 0,
    greedy_tokens: torch.Tensor | None = None,
) -> list[int]:
    """logits [B, V] float32; returns one token id per row. `greedy_tokens` [B]: the rows'
    argmax when already computed (a decode CUDA graph does), to skip computing it again."""
    if greedy_tokens is None:
        greedy_tokens = torch.argmax(logits, dim=-1)
    tokens = greedy_tokens.tolist()
    for row, (p, pos) in enumerate(zip(params, output_positions, strict=True)):
        if p.greedy:
            continue
        tokens[row] = _sample_row(logits[row], p, pos, default_seed)
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, pos: int, default_seed: int) -> int:
    x = logits.to(torch.float32) / p.temperature
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    seed = p.seed if p.seed is not None else None
    gen = torch.Generator(device="cpu")
    if seed is not None:
        gen.manual_seed((seed * _SEED_STRIDE + pos) & 0x7FFF_FFFF_FFFF_FFFF)
    else:
        gen.manual_seed(int(torch.randint(0, 2**62, (1,)).item()) ^ default_seed)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
