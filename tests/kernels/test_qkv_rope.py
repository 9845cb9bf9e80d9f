"""`qkv_norm_rope_store`: q|k|v with the q/k norm, RoPE and KV store in one launch, against
F.linear + the torch q/k norm/RoPE reference (float64) and against the two launches it replaces.
GPU tests skip without CUDA; the interpreter tests need Triton and ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from counters import assert_counters_zero
from seeds import seeded

from safeserve.kernels import linear as lin
from safeserve.kernels import norm_rope as nr
from safeserve.kernels import qkv_rope as qr

HAS_CUDA = torch.cuda.is_available() and lin.HAS_TRITON
INTERPRET = lin.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and Triton")
interp = pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")


# rows, query heads, kv heads, head_dim, K, bias
QKV_CASES = [
    (1, 4, 2, 32, 96, False),  # one token; K in two 64-deep slices, the last ragged
    (5, 2, 1, 64, 200, True),  # GQA 2:1, a bias, K not a multiple of the tile
    (8, 8, 8, 16, 48, False),  # the most rows the fused path takes, 1:1 heads, one K slice
]


def _rope(positions: torch.Tensor, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2).double() / d))
    emb = positions.double()[:, None] * inv.to(positions.device)[None, :]
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _check_qkv(rows, hq, hkv, d, k, bias, device, dtype, tol, seed=0):  # type: ignore[no-untyped-def]
    """The fused call against F.linear + the torch q/k norm/RoPE reference in float64: q, the
    cache rows at the slots (v exact to its rounding), slot -1 and every other slot untouched,
    counters back to zero, and a second call bit-identical. Returns (x, w, b, args) for more."""
    gen = seeded(seed)
    n = (hq + 2 * hkv) * d
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    qw = (1 + 0.3 * torch.randn(d, generator=gen)).to(device, dtype)
    kw = (1 + 0.3 * torch.randn(d, generator=gen)).to(device, dtype)
    cos, sin = _rope(torch.randint(0, 40960, (rows,), generator=gen).to(device), d, dtype)
    num_slots = 3 * rows + 5
    slots = torch.randperm(num_slots, generator=gen)[:rows].to(device)
    if rows > 1:
        slots[rows // 2] = -1  # a padding row of a graph batch: writes nothing
    caches = [torch.full((num_slots, hkv, d), float("nan"), dtype=dtype, device=device)]
    caches.append(caches[0].clone())
    args = (qw, kw, cos, sin, 1e-6, hq, hkv, caches[0], caches[1], slots)
    q = qr.qkv_norm_rope_store(x, w, b, *args)
    qkv = F.linear(x.double(), w.double(), None if b is None else b.double())
    q_ref, kr, vr = nr.qk_norm_rope_torch(
        qkv, qw.double(), kw.double(), cos.double(), sin.double(), 1e-6, hq, hkv
    )
    assert q.shape == (rows, hq, d) and q.dtype == dtype and not q.isnan().any()
    assert ((q.double() - q_ref).norm() / q_ref.norm()).item() <= tol
    ok = slots >= 0
    for cache, want in ((caches[0], kr), (caches[1], vr)):
        written = cache[slots[ok]].double()
        assert not written.isnan().any()
        assert ((written - want[ok]).norm() / want[ok].norm()).item() <= tol
        untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
        untouched[slots[ok]] = False
        assert cache[untouched].isnan().all()
    assert_counters_zero()
    again = [torch.full_like(c, float("nan")) for c in caches]
    q2 = qr.qkv_norm_rope_store(x, w, b, qw, kw, cos, sin, 1e-6, hq, hkv, *again, slots)
    assert torch.equal(q, q2)  # the fixed-order sum: bit-identical every call
    for a, c in zip(again, caches, strict=True):
        assert torch.equal(a[slots[ok]], c[slots[ok]])
    return x, w, b, args


@interp
@pytest.mark.parametrize("case", QKV_CASES, ids=lambda c: f"M{c[0]}-H{c[1]}x{c[2]}-D{c[3]}")
def test_interpreter_qkv_norm_rope_store(case) -> None:
    _check_qkv(*case, "cpu", torch.float32, 1e-5)


def test_falls_back_to_two_steps() -> None:
    """Off the fused path (CPU without the interpreter, more rows than `SKINNY_MAX_ROWS`, an
    odd head_dim) the call is `qk_norm_rope_store(linear(...))` itself."""
    gen = seeded(3)
    for rows, d in ((lin.SKINNY_MAX_ROWS + 1, 16), (2, 24)):
        hq, hkv, k = 2, 1, 32
        x = torch.randn(rows, k, generator=gen)
        w = torch.randn((hq + 2 * hkv) * d, k, generator=gen)
        qw, kw = torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5
        cos, sin = _rope(torch.arange(rows), d, torch.float32)
        slots = torch.arange(rows)
        caches = [torch.zeros(rows, hkv, d) for _ in range(4)]
        q = qr.qkv_norm_rope_store(
            x, w, None, qw, kw, cos, sin, 1e-6, hq, hkv, caches[0], caches[1], slots
        )
        want = nr.qk_norm_rope_store(
            lin.linear(x, w), qw, kw, cos, sin, 1e-6, hq, hkv, caches[2], caches[3], slots
        )
        assert torch.equal(q, want)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", QKV_CASES, ids=lambda c: f"M{c[0]}-H{c[1]}x{c[2]}-D{c[3]}")
def test_gpu_qkv_norm_rope_store(case, dtype) -> None:
    seed = int(torch.randint(0, 2**31 - 1, (1,)))  # fresh inputs every run
    _check_qkv(*case, "cuda", dtype, 1e-5 if dtype == torch.float32 else 1e-2, seed)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_qkv_norm_rope_store_model_shape_in_a_graph(rows) -> None:
    """Qwen3-30B-A3B's attention (32 q / 4 kv heads of 128, hidden 2,048) in bf16, captured once
    and replayed on new inputs, against the two launches it replaces. The q|k|v sums are the
    same (the same K tiles summed in the same order), so v is bit-identical; q and k go through
    the same norm/RoPE code, but the norm's sum of squares is reduced over a [rows, 64] tile
    here and a [1, 64] one there, whose float32 sums may differ in the last bit: a value may
    then round to the neighbouring bf16, rarely (an H200 run: 1 of 2.0 million q/k values over
    40 random 8-row cases, 0.9 % apart; none at 1 row)."""
    hq, hkv, d, k = 32, 4, 128, 2048
    dev, dt = "cuda", torch.bfloat16
    w = torch.randn((hq + 2 * hkv) * d, k, device=dev, dtype=dt) / k**0.5
    qw = (1 + 0.3 * torch.randn(d, device=dev)).to(dt)
    kw = (1 + 0.3 * torch.randn(d, device=dev)).to(dt)
    x = torch.randn(rows, k, device=dev, dtype=dt)
    cos, sin = _rope(torch.randint(0, 40960, (rows,), device=dev), d, dt)
    slots = torch.randperm(4 * rows, device=dev)[:rows]
    kc, vc = (torch.zeros(4 * rows, hkv, d, device=dev, dtype=dt) for _ in range(2))
    args = (qw, kw, cos, sin, 1e-6, hq, hkv, kc, vc, slots)
    qr.qkv_norm_rope_store(x, w, None, *args)  # compile, counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = qr.qkv_norm_rope_store(x, w, None, *args)
    for _ in range(3):
        x.copy_(torch.randn(rows, k, device=dev, dtype=dt))
        new_cos, new_sin = _rope(torch.randint(0, 40960, (rows,), device=dev), d, dt)
        cos.copy_(new_cos)
        sin.copy_(new_sin)
        slots.copy_(torch.randperm(4 * rows, device=dev)[:rows])
        graph.replay()
        torch.cuda.synchronize()
        kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
        kc2[slots], vc2[slots] = kc[slots], vc[slots]
        kw_, vw_ = torch.zeros_like(kc), torch.zeros_like(vc)
        want = nr.qk_norm_rope_store(
            lin.skinny_linear(x, w), qw, kw, cos, sin, 1e-6, hq, hkv, kw_, vw_, slots
        )
        assert torch.equal(vc2, vw_)
        for got, ref in ((q, want), (kc2, kw_)):
            # one bf16 step of a normed value (|n| ~ 1), carried through the rounded RoPE sum
            diff = (got.float() - ref.float()).abs().max().item()
            assert diff <= 2**-6 * ref.float().abs().max().item(), diff
            assert (got != ref).float().mean().item() < 0.01
        assert_counters_zero()
