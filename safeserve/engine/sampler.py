"""Next-token sampling: greedy, temperature, top-k, top-p, and per-request seeds.

A seeded request draws its i-th token from a generator seeded by (seed, i), so its output does not
depend on what it was batched with, nor on a preemption that recomputes it.

Sampling never raises for one row's problem: a row whose logits hold NaN or inf, or whose
distribution after temperature, top-k and top-p is not a distribution (not finite, or summing to
0), fails alone; `sample` returns an error string in its place and every other row's token is
what it would have been without it.
"""

from __future__ import annotations

import torch

from safeserve.messages import SamplingParams

_SEED_STRIDE = 1_000_003
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF  # torch generators take seeds below 2**64; keep them positive


class SamplingError(ValueError):
    """One row cannot be sampled (its logits or probabilities are not a distribution)."""


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_positions: list[int],
    default_seed: int = 0,
    greedy_tokens: torch.Tensor | None = None,
) -> list[int | str]:
    """logits [B, V] float32; returns one token id per row, or for a row that failed its error
    as one line ("sample: <ExcType>: <msg>"). `greedy_tokens` [B]: the rows' argmax when already
    computed (a decode CUDA graph does), to skip computing it again."""
    if greedy_tokens is None:
        greedy_tokens = torch.argmax(logits, dim=-1)
    # One batched finiteness check, folded into the one host copy the greedy tokens need anyway:
    # a row with NaN or inf comes back as -1 (token ids are >= 0). argmax of a NaN row is
    # garbage, so greedy rows are checked too, at no extra host sync.
    finite = torch.isfinite(logits).all(dim=-1)
    host = torch.where(finite, greedy_tokens, torch.full_like(greedy_tokens, -1)).tolist()
    tokens: list[int | str] = []
    for row, (p, pos) in enumerate(zip(params, output_positions, strict=True)):
        tok = host[row]
        if tok < 0:
            tokens.append(_error(SamplingError("logits hold NaN or inf")))
        elif p.greedy:
            tokens.append(tok)
        else:
            try:
                tokens.append(_sample_row(logits[row], p, pos, default_seed))
            except Exception as e:  # this row alone fails
                tokens.append(_error(e))
    return tokens


def _error(e: BaseException) -> str:
    return f"sample: {type(e).__name__}: {e}"


def _seed(p: SamplingParams, pos: int, default_seed: int) -> int:
    if p.seed is not None:
        # Python ints: any seed (negative, past 2**64) maps into the generator's range.
        return (int(p.seed) * _SEED_STRIDE + pos) & _SEED_MASK
    return (int(torch.randint(0, 2**62, (1,)).item()) ^ int(default_seed)) & _SEED_MASK


def _sample_row(logits: torch.Tensor, p: SamplingParams, pos: int, default_seed: int) -> int:
    x = logits.to(torch.float32)
    # Shift the largest logit to 0 before dividing: (x - max) / T <= 0 cannot overflow for any
    # temperature (a tiny one sends the rest to -inf, which is probability 0), and the largest
    # token always keeps probability mass.
    x = (x - x.max()) / float(p.temperature)
    if 0 < p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p, always at least the first token
        # (a top_p of 1e-300 is 0 in float32, and would otherwise drop every token).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        drop[0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    total = float(probs.sum())
    if not (total > 0 and bool(torch.isfinite(probs).all())):
        raise SamplingError(f"probabilities are not a distribution (sum {total})")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_seed(p, pos, default_seed))
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
