"""RMSNorm (+ residual) and q/k norm + RoPE + KV store: the Triton kernels against their torch
references on a GPU (fresh random inputs, several shapes incl. one token and counts that fit no
tile); on CPU, the references against the unfused math the model used before."""

from __future__ import annotations

import os

import pytest
import torch
from seeds import seeded

from safeserve.kernels import norm_rope as nr
from safeserve.kernels import topk_softmax as tk

HAS_CUDA = torch.cuda.is_available() and nr.HAS_TRITON
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _rope(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    inv = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float()[:, None] * inv.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def test_references_match_unfused_math() -> None:
    """CPU: the references compute what the model computed op by op (float32, exact)."""
    gen = seeded(0)
    x, r = torch.randn(5, 24, generator=gen), torch.randn(5, 24, generator=gen)
    w = torch.randn(24, generator=gen)
    s = x + r
    want = w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
    out, summed = nr.rms_norm(x, w, 1e-6, r)
    torch.testing.assert_close(summed, s, rtol=0, atol=0)
    torch.testing.assert_close(out, want)
    # q/k: per-head norm, then x*cos + rotate_half(x)*sin.
    t, hq, hkv, d = 3, 4, 2, 8
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    qw, kw = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    cos, sin = _rope(torch.tensor([0, 5, 99]), d, torch.float32)
    q, k, v = nr.qk_norm_rope_torch(qkv, qw, kw, cos, sin, 1e-6, hq, hkv)
    q0 = qkv[:, : hq * d].reshape(t, hq, d)
    q0 = qw * (q0 * torch.rsqrt(q0.pow(2).mean(-1, keepdim=True) + 1e-6))
    rot = torch.cat((-q0[..., d // 2 :], q0[..., : d // 2]), dim=-1)
    torch.testing.assert_close(q, q0 * cos[:, None] + rot * sin[:, None])
    torch.testing.assert_close(v, qkv[:, (hq + hkv) * d :].reshape(t, hkv, d), rtol=0, atol=0)
    assert k.shape == (t, hkv, d)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 2048), (7, 2048), (61, 80), (130, 4096), (3, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel(dtype: torch.dtype, rows: int, hidden: int, with_residual: bool) -> None:
    gen = seeded(rows * hidden + with_residual, device="cuda")
    x = torch.randn(rows, hidden, generator=gen, device="cuda").to(dtype)
    res = torch.randn(rows, hidden, generator=gen, device="cuda").to(dtype) * 4
    w = (1 + 0.3 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
    r = res if with_residual else None
    out, summed = nr.rms_norm(x, w, 1e-6, r)
    ref, ref_sum = nr.rms_norm_torch(x, w, 1e-6, r)
    assert not out.isnan().any() and out.dtype == dtype and out.shape == x.shape
    assert _rel(out, ref) <= TOL[dtype]
    # The residual sum is one rounded add, as in torch.
    torch.testing.assert_close(summed, ref_sum, rtol=0, atol=0)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "tokens,hq,hkv,d",
    [
        (1, 32, 4, 128),
        (5, 32, 4, 128),
        (67, 8, 8, 64),
        (3, 16, 2, 80),
        (300, 32, 4, 128),
        (nr.QK_BLOCK_MIN_TOKENS + 1, 16, 2, 80),
    ],  # fmt: skip
)
def test_qk_norm_rope_store_kernel(dtype: torch.dtype, tokens: int, hq: int, hkv: int, d: int):  # type: ignore[no-untyped-def]
    gen = seeded(tokens * 1000 + d, device="cuda")
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen, device="cuda").to(dtype)
    qw = (1 + 0.3 * torch.randn(d, generator=gen, device="cuda")).to(dtype)
    kw = (1 + 0.3 * torch.randn(d, generator=gen, device="cuda")).to(dtype)
    positions = torch.randint(0, 40960, (tokens,), generator=gen, device="cuda")
    cos, sin = _rope(positions, d, dtype)
    num_slots = 3 * tokens + 5
    slots = torch.randperm(num_slots, generator=gen, device="cuda")[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1  # a padding row: writes nothing
    caches = [torch.full((num_slots, hkv, d), float("nan"), dtype=dtype, device="cuda")]
    caches = [caches[0], caches[0].clone(), caches[0].clone(), caches[0].clone()]
    q = nr.qk_norm_rope_store(qkv, qw, kw, cos, sin, 1e-6, hq, hkv, caches[0], caches[1], slots)
    qr, kr, vr = nr.qk_norm_rope_torch(qkv, qw, kw, cos, sin, 1e-6, hq, hkv)
    assert not q.isnan().any()
    assert _rel(q, qr) <= TOL[dtype]
    ok = slots >= 0
    for cache, want in ((caches[0], kr), (caches[1], vr)):
        written = cache[slots[ok]]
        assert not written.isnan().any()
        assert _rel(written, want[ok]) <= TOL[dtype]
        untouched = torch.ones(num_slots, dtype=torch.bool, device="cuda")
        untouched[slots[ok]] = False
        assert cache[untouched].isnan().all()
    torch.testing.assert_close(caches[1][slots[ok]], vr[ok], rtol=0, atol=0)  # v: a copy


INTERPRET = nr.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("tokens", [3, nr.QK_BLOCK_MIN_TOKENS + 5])
def test_interpreter_qk_norm_rope_store_per_token_and_per_block(tokens: int) -> None:
    """CPU, Triton's interpreter, float32: a program per token (3 tokens) and per 16-token
    block (133: the last block partial) against the torch reference; the slots of the padding
    row and the slots no token maps to are left alone."""
    gen = seeded(tokens)
    hq, hkv, d = 4, 2, 16
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen)
    qw, kw = 1 + 0.3 * torch.randn(d, generator=gen), 1 + 0.3 * torch.randn(d, generator=gen)
    cos, sin = _rope(torch.randint(0, 4096, (tokens,), generator=gen), d, torch.float32)
    num_slots = 2 * tokens + 3
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    slots[tokens // 2] = -1
    kc = torch.full((num_slots, hkv, d), float("nan"))
    vc = kc.clone()
    q = nr.qk_norm_rope_store(qkv, qw, kw, cos, sin, 1e-6, hq, hkv, kc, vc, slots)
    qr, kr, vr = nr.qk_norm_rope_torch(qkv, qw, kw, cos, sin, 1e-6, hq, hkv)
    torch.testing.assert_close(q, qr, rtol=1e-5, atol=1e-5)
    ok = slots >= 0
    torch.testing.assert_close(kc[slots[ok]], kr[ok], rtol=1e-5, atol=1e-5)
    assert torch.equal(vc[slots[ok]], vr[ok])
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots[ok]] = False
    assert kc[untouched].isnan().all() and vc[untouched].isnan().all()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 13, 64])
def test_topk_softmax_maps_ids_and_casts_weights(tokens: int) -> None:
    gen = seeded(tokens, device="cuda")
    logits = torch.randn(tokens, 128, generator=gen, device="cuda")
    expert_map = torch.randperm(128, generator=gen, device="cuda")
    w, ids = tk.fused_topk_softmax(logits, 8, True, torch.bfloat16, expert_map)
    rw, rids = tk.topk_softmax_torch(logits, 8, True)
    assert ids.dtype == torch.int64 and w.dtype == torch.bfloat16
    want = expert_map[rids.long()]
    assert torch.equal(ids.sort(dim=1).values, want.sort(dim=1).values)
    torch.testing.assert_close(
        w.float().sort(dim=1).values, rw.sort(dim=1).values, atol=4e-3, rtol=0
    )
