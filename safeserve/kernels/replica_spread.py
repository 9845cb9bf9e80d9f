"""Spreading routed choices over an expert's replicas (redundant experts), counting them on the way.

`spread_ids(logical_ids, spread, spread_count)` maps each routed choice of `logical_ids` [T, K]
to one physical slot. Tokens are cut into `S` source shares in order (share s holds tokens
[s * base + min(s, extra), ...) of divmod(T, S) = (base, extra), as the ranks that sent them), and
the choices of a share that pick an expert go to its candidates `spread[s, e, :spread_count[s, e]]`
in turn, in (token, k) order: the n-th such choice to candidate n % count. Every candidate takes
an equal share of the batch's choices, within one (turns are counted per expert, not by token
index: by index, an expert's few tokens of a decode batch could all land on one replica). With `counts` (int32, one layer's row of slots)
each physical choice is also added there, but for the tokens where `real` (bool, >= T) is False
(a graph bucket's padding): the recorder of EPLB costs no launch of its own.

The Triton kernel is one launch without host sync (CUDA graphs hold it); a choice's turn is the
number of earlier choices with its (share, expert), counted by comparing against every earlier
choice, so it runs where the choices are few (decode and small prefill chunks, up to
`KERNEL_MAX_CHOICES`); larger batches take the torch path (a stable sort). The torch path is the
reference and the CPU path.
"""

from __future__ import annotations

import torch

from safeserve.kernels.common import HAS_TRITON, tl, triton, use_kernels
from safeserve.kernels.expert_count import count_experts

# Up to this many choices (tokens x top-k) a batch's spread runs as the kernel: its work grows with
# the square of the choices (2,048 tokens of top-8 compare 134 M pairs: tens of microseconds on an
# H200), where the torch path is about ten launches whatever the size.
KERNEL_MAX_CHOICES = 16384
_BLOCK = 128


def source_shares(n: int, sources: int, device: torch.device | str) -> torch.Tensor:
    """[n] the source share of each token: `sources` runs in order, the first n % sources one
    token longer."""
    t = torch.arange(n, device=device)
    if sources == 1:
        return torch.zeros_like(t)
    base, extra = divmod(n, sources)
    cut = extra * (base + 1)
    return torch.where(t < cut, t // (base + 1), extra + (t - cut) // max(base, 1))


def _ordinal(key: torch.Tensor, num_keys: int) -> torch.Tensor:
    """For each entry of `key` ([N] ints in [0, num_keys)), how many earlier entries have its
    value (0 for the first of a value)."""
    n = key.shape[0]
    order = torch.sort(key, stable=True).indices
    position = torch.empty_like(order)
    position[order] = torch.arange(n, device=key.device)
    count = torch.zeros(num_keys, dtype=torch.int64, device=key.device)
    count.index_add_(0, key, torch.ones_like(key))
    first = count.cumsum(0) - count
    return position - first[key]


def spread_ids_torch(
    logical_ids: torch.Tensor,
    spread: torch.Tensor,
    spread_count: torch.Tensor,
    counts: torch.Tensor | None = None,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    n, k = logical_ids.shape[0], logical_ids.shape[1]
    sources, experts = spread.shape[0], spread.shape[1]
    source = source_shares(n, sources, logical_ids.device)[:, None].expand_as(logical_ids)
    key = (source * experts + logical_ids).reshape(-1)  # (share, expert) of each choice
    turn = _ordinal(key, sources * experts).view(n, k)
    turn = turn % spread_count[source, logical_ids]
    ids = spread[source, logical_ids, turn]
    if counts is not None:
        count_experts(ids, counts, real)
    return ids


if HAS_TRITON:

    @triton.jit
    def _source_of(t, n, S: tl.constexpr):
        if S == 1:
            return t * 0
        base = n // S
        extra = n % S
        cut = extra * (base + 1)
        return tl.where(t < cut, t // (base + 1), extra + (t - cut) // tl.maximum(base, 1))

    @triton.jit(do_not_specialize=["n", "num_choices"])
    def _spread_kernel(ids_ptr, spread_ptr, count_ptr, out_ptr, counts_ptr, real_ptr, n,
                       num_choices, num_experts, max_candidates, K: tl.constexpr, S: tl.constexpr,
                       HAS_COUNTS: tl.constexpr, HAS_REAL: tl.constexpr,
                       BLOCK: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        i = pid * BLOCK + tl.arange(0, BLOCK)
        inside = i < num_choices
        logical = tl.load(ids_ptr + i, mask=inside, other=0)
        t = i // K
        key = _source_of(t, n, S) * num_experts + logical
        turn = tl.zeros([BLOCK], dtype=tl.int32)
        # every earlier choice, a block at a time (the blocks up to this program's own)
        for j0 in range(0, (pid + 1) * BLOCK, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            j_in = j < num_choices
            lj = tl.load(ids_ptr + j, mask=j_in, other=0)
            kj = _source_of(j // K, n, S) * num_experts + lj
            same = (kj[None, :] == key[:, None]) & (j[None, :] < i[:, None]) & j_in[None, :]
            turn += tl.sum(same.to(tl.int32), axis=1)
        count = tl.load(count_ptr + key, mask=inside, other=1)
        turn = turn % count
        phys = tl.load(spread_ptr + key * max_candidates + turn, mask=inside, other=0)
        tl.store(out_ptr + i, phys, mask=inside)
        if HAS_COUNTS:
            counted = inside & (phys >= 0)
            if HAS_REAL:
                counted = counted & (tl.load(real_ptr + t, mask=inside, other=0) != 0)
            tl.atomic_add(counts_ptr + tl.where(counted, phys, 0).to(tl.int32),
                          tl.full([BLOCK], 1, tl.int32), mask=counted, sem="relaxed")  # fmt: skip


def spread_ids(
    logical_ids: torch.Tensor,
    spread: torch.Tensor,
    spread_count: torch.Tensor,
    counts: torch.Tensor | None = None,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, K] physical ids of `logical_ids` [T, K] spread over `spread` [S, E, M] candidates
    (`spread_count` [S, E] of them valid); adds them to `counts` where given (module doc)."""
    n, k = logical_ids.shape[0], logical_ids.shape[1]
    num_choices = n * k
    if not (
        use_kernels(logical_ids)
        and num_choices <= KERNEL_MAX_CHOICES
        and logical_ids.is_contiguous()
        and spread.is_contiguous()
        and spread_count.is_contiguous()
        and (counts is None or (counts.dtype == torch.int32 and counts.is_contiguous()))
    ):
        return spread_ids_torch(logical_ids, spread, spread_count, counts, real)
    out = torch.empty_like(logical_ids)
    if num_choices == 0:
        return out
    flags = real.view(torch.uint8) if real is not None else logical_ids
    grid = (triton.cdiv(num_choices, _BLOCK),)
    _spread_kernel[grid](
        logical_ids,
        spread,
        spread_count,
        out,
        counts if counts is not None else out,
        flags,
        n,
        num_choices,
        spread.shape[1],
        spread.shape[2],
        K=k,
        S=spread.shape[0],
        HAS_COUNTS=counts is not None,
        HAS_REAL=real is not None,
        BLOCK=_BLOCK,
    )
    return out
