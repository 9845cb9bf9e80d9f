"""The replica-spread kernel (`safeserve.kernels.replica_spread`) against its torch reference,
and both against the rule written out by hand: on a GPU, or on CPU in Triton's interpreter
(TRITON_INTERPRET=1); the torch path alone otherwise."""

from __future__ import annotations

import os

import pytest
import torch
from seeds import seeded

from safeserve.kernels import replica_spread as rs

HAS_CUDA = torch.cuda.is_available() and rs.HAS_TRITON
INTERPRET = rs.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"


def _case(rows: int, k: int, experts: int, sources: int, seed: int):  # type: ignore[no-untyped-def]
    """Routed choices (distinct per token, a few experts favoured), candidates of 1-3 replicas
    per (share, expert) among `experts + 7` slots, and a padding mask longer than the rows."""
    gen = seeded(seed)
    weights = torch.ones(experts)
    weights[: max(1, experts // 4)] = 8.0  # skewed, as trained routers are
    ids = torch.stack([torch.multinomial(weights, k, generator=gen) for _ in range(rows)])
    slots = experts + 7
    count = torch.randint(1, 4, (sources, experts), generator=gen)
    spread = torch.randint(0, slots, (sources, experts, 3), generator=gen)
    real = torch.rand(rows + 5, generator=gen) > 0.25
    return ids, spread, count, real, slots


def _by_hand(ids, spread, count) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The rule, one choice at a time: contiguous shares, the n-th choice of (share, expert)
    to candidate n % count."""
    n, k = ids.shape
    sources = spread.shape[0]
    base, extra = divmod(n, sources)
    share, start = [], 0
    for s in range(sources):
        size = base + (1 if s < extra else 0)
        share += [s] * size
        start += size
    seen: dict[tuple[int, int], int] = {}
    out = torch.empty_like(ids)
    for t in range(n):
        for j in range(k):
            key = (share[t], int(ids[t, j]))
            turn = seen.get(key, 0)
            seen[key] = turn + 1
            out[t, j] = spread[key[0], key[1], turn % int(count[key])]
    return out


def _counted(ids: torch.Tensor, slots: int, real: torch.Tensor | None) -> torch.Tensor:
    out = torch.zeros(slots, dtype=torch.int64)
    for t, row in enumerate(ids.tolist()):
        if real is None or bool(real[t]):
            for e in row:
                out[e] += 1
    return out


@pytest.mark.parametrize(
    ("rows", "k", "experts", "sources"),
    [(1, 2, 4, 1), (13, 3, 10, 1), (13, 3, 10, 4), (3, 2, 6, 4)],
)
def test_torch_path_follows_the_rule_and_counts_real_rows(
    rows: int, k: int, experts: int, sources: int
) -> None:
    ids, spread, count, real, slots = _case(rows, k, experts, sources, rows * 7 + sources)
    counts = torch.zeros(slots, dtype=torch.int64)
    got = rs.spread_ids_torch(ids, spread, count, counts, real)
    assert torch.equal(got, _by_hand(ids, spread, count))
    assert torch.equal(counts, _counted(got, slots, real))


@pytest.mark.kernel
@pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs Triton on a GPU or interpreted")
@pytest.mark.parametrize(
    ("rows", "k", "experts", "sources"),
    # one token; a decode batch over blocks of 128 choices; shares that do not divide the rows;
    # fewer rows than shares; the kernel's largest batch
    [(1, 8, 128, 1), (64, 8, 128, 1), (37, 6, 64, 4), (3, 2, 6, 4), (2048, 8, 128, 2)],
)
def test_interpreter_or_gpu_kernel_equals_the_reference(
    rows: int, k: int, experts: int, sources: int
) -> None:
    if INTERPRET and not HAS_CUDA and rows * k > 1024:
        pytest.skip("the interpreter takes minutes over 1,024 choices")
    device = "cuda" if HAS_CUDA else "cpu"
    ids, spread, count, real, slots = _case(rows, k, experts, sources, rows + k)
    want = _by_hand(ids, spread, count) if rows * k <= 1024 else None
    ids, spread, count, real = (x.to(device) for x in (ids, spread, count, real))
    ref = rs.spread_ids_torch(ids, spread, count)
    if want is not None:
        assert torch.equal(ref.cpu(), want)
    for mask in (None, real):
        counts = torch.full((slots,), 5, dtype=torch.int32, device=device)  # adds to what is there
        got = rs.spread_ids(ids, spread, count, counts, mask)
        assert torch.equal(got, ref)
        assert torch.equal(
            counts.cpu().long() - 5,
            _counted(ref.cpu(), slots, None if mask is None else mask.cpu()),
        )
    assert torch.equal(rs.spread_ids(ids, spread, count), ref)  # no counts: the same ids
