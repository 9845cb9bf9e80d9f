"""The MLA cache-entry store and latent-query kernels against their torch references, in both
RoPE layouts, with padding slots (-1), int32 and int64 slots, strided inputs (views of the fused
projection outputs and of a transposed GEMM output) and token counts on both sides of the
blocked variant: on a GPU (bf16 within 1e-2, float32 within 1e-5), or in Triton's interpreter
with TRITON_INTERPRET=1 (float32 and float16)."""

from __future__ import annotations

import os

import pytest
import torch
from seeds import seeded

from safeserve.kernels import mla_prepare as mp
from safeserve.kernels.common import HAS_TRITON

HAS_CUDA = torch.cuda.is_available() and HAS_TRITON
INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"

_kernel_runs = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs a CUDA device (or TRITON_INTERPRET=1)"
)


def needs_kernel(test):  # type: ignore[no-untyped-def]
    return pytest.mark.kernel(_kernel_runs(test))


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def _cos_sin(t: int, rope: int, dtype: torch.dtype, gen: torch.Generator):  # type: ignore[no-untyped-def]
    """Rotate-half layout (each frequency twice), YaRN-like scaled."""
    inv = 1.0 / (1e4 ** (torch.arange(0, rope, 2).float() / rope))
    pos = torch.randint(0, 4096, (t,), generator=gen).float()
    ang = pos[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return (emb.cos() * 1.2).to(DEVICE, dtype), (emb.sin() * 1.2).to(DEVICE, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 131])
def test_interpreter_latent_store_matches_reference(
    dtype: torch.dtype, interleave: bool, tokens: int
) -> None:
    lat, rope, q_a = 40, 16, 24
    gen = seeded(tokens)
    # kv as a view of the fused q_a | kv_a output: rows strided by q_a + lat + rope
    fused = torch.randn(tokens, q_a + lat + rope, generator=gen).to(DEVICE, dtype)
    kv = fused[:, q_a:]
    weight = (1 + 0.3 * torch.randn(lat, generator=gen)).to(DEVICE, dtype)
    cos, sin = _cos_sin(tokens, rope, dtype, gen)
    num_slots = 2 * tokens + 4
    perm = torch.randperm(num_slots, generator=gen)[:tokens]
    slots = torch.where(torch.rand(tokens, generator=gen) < 0.25, -1, perm).to(DEVICE)
    slots[0] = perm[0].to(DEVICE)  # at least one row written
    base = torch.randn(num_slots, 1, lat + rope, generator=gen).to(DEVICE, dtype)
    for s in (slots, slots.to(torch.int32)):
        got = base.clone()
        mp.store_latent_entry(kv, weight, 1e-6, cos, sin, interleave, got, s)
        want = base.clone()
        entry = mp.latent_entry_torch(kv, weight, 1e-6, cos, sin, interleave)
        mp.store_rows(entry, want, s)
        written = s[s >= 0].long()
        untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
        untouched[written] = False
        assert torch.equal(got[untouched], base[untouched])  # padding rows wrote nothing
        assert not got.isnan().any()
        assert _rel(got[written], want[written]) <= _tol(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("tokens,heads", [(1, 3), (7, 16), (70, 20)])
def test_interpreter_latent_query_matches_reference(
    dtype: torch.dtype, interleave: bool, tokens: int, heads: int
) -> None:
    lat, nope, rope = 48, 12, 16
    gen = seeded(tokens * heads)
    # q_latent as the transposed bmm output [heads, T, lat] -> [T, heads, lat]
    q_latent = torch.randn(heads, tokens, lat, generator=gen).to(DEVICE, dtype).transpose(0, 1)
    # q_pe as a view of the q projection [T, heads, nope + rope]
    q = torch.randn(tokens, heads, nope + rope, generator=gen).to(DEVICE, dtype)
    q_pe = q[..., nope:]
    cos, sin = _cos_sin(tokens, rope, dtype, gen)
    got = mp.latent_query(q_latent, q_pe, cos, sin, interleave)
    want = mp.latent_query_torch(q_latent, q_pe, cos, sin, interleave)
    assert got.shape == (tokens, heads, lat + rope) and got.is_contiguous()
    assert torch.equal(got[..., :lat], want[..., :lat])  # the absorbed query is copied as is
    assert not got.isnan().any()
    assert _rel(got[..., lat:], want[..., lat:]) <= _tol(dtype)


@needs_kernel
def test_interpreter_latent_store_with_no_row_to_write_changes_nothing() -> None:
    gen = seeded(3)
    kv = torch.randn(4, 24, generator=gen).to(DEVICE)
    cache = torch.randn(9, 1, 24, generator=gen).to(DEVICE)
    cos, sin = _cos_sin(4, 8, torch.float32, gen)
    before = cache.clone()
    slots = torch.full((4,), -1, dtype=torch.int32, device=DEVICE)
    mp.store_latent_entry(kv, torch.ones(16, device=DEVICE), 1e-6, cos, sin, True, cache, slots)
    assert torch.equal(cache, before)


def test_references_without_kernels_match_the_unfused_layer() -> None:
    """The torch references are the layer's CPU path: the entry is the normed latent and the
    rotated rope key; in the interleaved layout the pairs come out de-interleaved."""
    gen = seeded(0)
    kv = torch.randn(3, 10, generator=gen)
    weight = torch.randn(6, generator=gen)
    cos, sin = _cos_sin(3, 4, torch.float32, gen)
    cos, sin = cos.cpu(), sin.cpu()
    entry = mp.latent_entry_torch(kv, weight, 1e-6, cos, sin, True)
    h = kv[:, :6]
    normed = weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(entry[:, :6], normed)
    x = kv[:, 6:]
    c, s = cos[:, :2], sin[:, :2]
    rotated = torch.cat([x[:, 0::2] * c - x[:, 1::2] * s, x[:, 1::2] * c + x[:, 0::2] * s], -1)
    torch.testing.assert_close(entry[:, 6:], rotated)
