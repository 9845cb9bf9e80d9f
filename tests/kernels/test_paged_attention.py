"""Paged-attention decode and KV store: the torch references against the engine's torch path on
CPU; the Triton kernels against the references on a GPU (or in Triton's interpreter with
TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch
from counters import assert_counters_zero
from seeds import seeded

from safeserve.kernels import paged_attention as pa
from safeserve.layers.paged_attention import AttentionMetadata, paged_attention

HAS_CUDA = torch.cuda.is_available() and pa.HAS_TRITON
INTERPRET = pa.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"

_kernel_runs = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs a CUDA device (or TRITON_INTERPRET=1)"
)


def needs_kernel(test):  # type: ignore[no-untyped-def]
    """Runs the kernel on a GPU, or under Triton's interpreter on CPU; marked `kernel` so that
    GPU runs filtered by marker (-m "gpu or kernel") take it too."""
    return pytest.mark.kernel(_kernel_runs(test))


DEVICE = "cuda" if HAS_CUDA else "cpu"


def _problem(
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    """Random q, a random cache (every slot filled) and scattered, shuffled block tables."""
    gen = seeded(seed)
    widths = [max(1, (c + block_size - 1) // block_size) for c in context_lens]
    num_blocks = sum(widths) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    width = max(widths)
    for w in widths:
        tables.append(perm[i : i + w] + [0] * (width - w))
        i += w
    slots = num_blocks * block_size
    k_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    bt = torch.tensor(tables, dtype=torch.int32, device=device)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, bt, ctx


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _decode_twice(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    bt: torch.Tensor,
    ctx: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """The kernel into a NaN-filled `out`, twice: the counters are back to zero after each call
    and the second answer is bit-identical to the first (the merge's order is fixed)."""
    outs = []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        pa.paged_decode(q, kc, vc, bt, ctx, block_size, scale, out=out)
        assert_counters_zero()
        outs.append(out)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])
    return outs[0]


def test_decode_reference_matches_engine_torch_path() -> None:
    """The decode oracle computes what the engine's per-sequence SDPA loop computes."""
    block_size, scale = 4, 0.3
    ctxs = [1, 7, 12, 5]
    q, kc, vc, bt, ctx = _problem(ctxs, 8, 2, 16, block_size, torch.float32, "cpu", seed=0)
    ref = pa.paged_decode_torch(q, kc, vc, bt, ctx, block_size, scale)
    tables = [row.tolist() for row in bt]
    meta = AttentionMetadata.build([1] * len(ctxs), ctxs, tables, block_size, "cpu")
    assert not meta.is_decode_kernel  # CPU keeps the torch path
    # paged_attention writes k/v of the last position first: give it what the cache holds.
    last = meta.slot_mapping
    k_new, v_new = kc[last].clone(), vc[last].clone()
    out = paged_attention(q, k_new, v_new, (kc, vc), meta, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_store_reference_skips_negative_slots() -> None:
    kc = torch.zeros(8, 2, 4)
    vc = torch.zeros(8, 2, 4)
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    pa.store_kv_torch(k, v, kc, vc, torch.tensor([5, -1, 2]))
    torch.testing.assert_close(kc[5], k[0])
    torch.testing.assert_close(vc[2], v[2])
    assert kc[[0, 1, 3, 4, 6, 7]].abs().sum() == 0


def test_split_count_fills_the_gpu_and_respects_context() -> None:
    if not pa.HAS_TRITON:
        pytest.skip("needs Triton")
    assert pa.decode_splits(1, 4, 640) == 10  # one sequence: every 64 tokens their own program
    assert pa.decode_splits(64, 4, 640) == 2
    assert pa.decode_splits(256, 4, 640) == 1
    assert pa.decode_splits(1, 4, 10) == 1


DECODE_CASES = [
    # context lengths, Hq, Hkv, D, block size
    ([1], 32, 4, 128, 16),
    ([640], 32, 4, 128, 16),
    ([257], 32, 4, 128, 16),  # one sequence, 5 splits, the last ragged
    ([17, 1, 300, 65, 64], 32, 4, 128, 16),  # 5 splits: 1, 1, 5, 2 and 1 of them used
    ([0, 33, 0, 129], 8, 8, 64, 16),  # context 0 = graph padding rows: zeros; group 1, 3 splits
    ([130, 0, 70], 8, 1, 64, 16),  # group 8 over one kv head, a context 0 among split ones
    ([5, 100, 1000], 16, 2, 128, 32),
    ([9, 70], 6, 2, 80, 1),  # head dim not a power of two, one token per block
]


@needs_kernel
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_kernel_matches_reference(case: int, dtype: torch.dtype) -> None:
    ctxs, hq, hkv, d, bs = DECODE_CASES[case]
    if not HAS_CUDA and max(ctxs) > 300:
        pytest.skip("long contexts are slow in the interpreter")
    if not HAS_CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter mis-computes bf16 tl.dot (checked apart)")
    q, kc, vc, bt, ctx = _problem(ctxs, hq, hkv, d, bs, dtype, DEVICE, seed=case + 11)
    scale = d**-0.5
    ref = pa.paged_decode_torch(q.double(), kc.double(), vc.double(), bt, ctx, bs, scale)
    out = _decode_twice(q, kc, vc, bt, ctx, bs, scale)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert _rel_err(out, ref) <= tol
    for b, c in enumerate(ctxs):
        if c == 0:
            assert out[b].abs().sum() == 0


WIDE_CASES = [
    # context lengths, Hq, Hkv, table width in blocks of 16 (grid splits; each context is cut
    # into splits of cdiv(context, splits) tokens rounded up to 64)
    ([3, 40], 8, 2, 64),  # 16 splits, one used each: no merge
    ([3, 0, 300, 40], 8, 2, 256),  # 64 splits: 1, 0, 5 and 1 used
    ([3, 0, 300, 200], 8, 8, 256),  # group 1, 16 splits: 1, 0, 5 and 4 used
    ([300], 32, 4, 1024),  # one sequence, 128 splits: 5 used
    ([576], 32, 4, 2560),  # a graph bucket's table (40,960 tokens), 128 splits: 9 used
    ([2100, 90], 32, 4, 2560),  # 64 splits: 33 used (merged in groups of 16, 16 and 1), 2
]


@needs_kernel
@pytest.mark.parametrize("case", range(len(WIDE_CASES)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_kernel_wide_table_many_splits(case: int, dtype: torch.dtype) -> None:
    """A table much wider than the contexts (as in a CUDA graph sized for max_model_len): many
    splits, most of them past every context."""
    if not HAS_CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter mis-computes bf16 tl.dot (checked apart)")
    ctxs, hq, hkv, width = WIDE_CASES[case]
    q, kc, vc, bt, ctx = _problem(ctxs, hq, hkv, 64, 16, dtype, DEVICE, seed=5 + case)
    wide = torch.zeros(len(ctxs), width, dtype=torch.int32, device=DEVICE)
    wide[:, : bt.shape[1]] = bt
    ref = pa.paged_decode_torch(q.double(), kc.double(), vc.double(), bt, ctx, 16, 0.125)
    out = _decode_twice(q, kc, vc, wide, ctx, 16, 0.125)
    assert _rel_err(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)
    # the first columns of a wider buffer (rows strided, as the runner's device table hands
    # out its first rows and columns), the columns past them filled with garbage
    big = torch.full((len(ctxs), width + 37), 10**6, dtype=torch.int32, device=DEVICE)
    big[:, :width] = wide
    view = big[:, : bt.shape[1]]
    assert view.stride(0) == width + 37
    torch.testing.assert_close(_decode_twice(q, kc, vc, view, ctx, 16, 0.125), out)


@needs_kernel
@pytest.mark.parametrize(
    "context,used",
    [(1000, 16), (1078, 17), (4200, 66)],
    ids=["two-passes", "two-levels-last-group-of-1", "two-levels-9-groups"],
)
def test_decode_kernel_merges_more_splits_than_one_pass(context: int, used: int) -> None:
    """A group of 8 heads of 128, whose merge reads 8 splits a pass, over 16, 17 and 66 used
    splits (64 tokens each). Up to two passes the last split merges them all; past that the
    merge has two levels (groups of 8 splits, the last one ragged, then the groups), each
    pass raising or keeping the running max. Bit-identical on a second call, counters zero."""
    q, kc, vc, bt, ctx = _problem([context], 8, 1, 128, 16, torch.float32, DEVICE, seed=9)
    assert pa.decode_splits(1, 1, bt.shape[1] * 16) == used
    assert pa._MERGE_TILE // (8 * 128) == 8  # splits a merge pass holds
    ref = pa.paged_decode_torch(q.double(), kc.double(), vc.double(), bt, ctx, 16, 0.25)
    out = _decode_twice(q, kc, vc, bt, ctx, 16, 0.25)
    assert _rel_err(out, ref) <= 1e-5


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kernel_matches_reference(dtype: torch.dtype) -> None:
    gen = seeded(3)
    k = torch.randn(7, 4, 96, generator=gen).to(DEVICE, dtype)
    v = torch.randn(7, 4, 96, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([12, -1, 0, 33, -1, 7, 50], device=DEVICE)
    kc = torch.randn(64, 4, 96, generator=gen).to(DEVICE, dtype)
    vc = torch.randn(64, 4, 96, generator=gen).to(DEVICE, dtype)
    kr, vr = kc.clone(), vc.clone()
    pa.store_kv(k, v, kc, vc, slots)
    pa.store_kv_torch(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("ctxs", [[20, 3, 0, 90], [700], [1000, 3, 0, 700]])
@pytest.mark.parametrize("width", [None, 256])
def test_decode_kernel_in_cuda_graph(ctxs: list[int], width: int | None) -> None:
    """Captured once, replayed on new contexts and contents: same answers as the reference,
    the counters back to zero and a second replay bit-identical. width: a table of that many
    blocks (as a graph bucket has), so contexts span many splits of many more."""
    q, kc, vc, bt, ctx = _problem(ctxs, 32, 4, 128, 16, torch.bfloat16, "cuda", seed=8)
    if width is not None:
        wide = torch.zeros(len(ctxs), width, dtype=torch.int32, device="cuda")
        wide[:, : bt.shape[1]] = bt
        bt = wide
    most = bt.shape[1] * 16
    out = torch.empty_like(q)
    pa.paged_decode(q, kc, vc, bt, ctx, 16, 0.1, out=out)  # compiles, allocates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.paged_decode(q, kc, vc, bt, ctx, 16, 0.1, out=out)
    for seed in range(4):
        gen = seeded(100 + seed)
        q.copy_(torch.randn(q.shape, generator=gen))
        kc.copy_(torch.randn(kc.shape, generator=gen))
        new = torch.randint(0, most + 1, (len(ctxs),), generator=gen).to(torch.int32)
        if len(ctxs) > 2:
            new[2] = 0
        ctx.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        first = out.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert_counters_zero()
        assert torch.equal(out, first)
        ref = pa.paged_decode_torch(q.double(), kc.double(), vc.double(), bt, ctx, 16, 0.1)
        assert not out.isnan().any()
        assert _rel_err(out, ref) <= 1e-2
        if len(ctxs) > 2:
            assert out[2].abs().sum() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mixed_step_decodes_through_the_kernel_and_matches_the_torch_path(
    dtype: torch.dtype,
) -> None:
    """A step mixing prefill chunks and decodes: the decode rows go through the kernel in one
    launch, the chunks through SDPA; the result equals the all-torch path."""
    from safeserve.layers.paged_attention import attend

    block_size, scale, hq, hkv, d = 16, 0.1, 8, 2, 64
    query_lens = [1, 5, 1, 1, 17, 1, 33]
    context_lens = [40, 5, 1, 130, 60, 17, 33]
    gen = seeded(3)
    widths = [(c + block_size - 1) // block_size for c in context_lens]
    perm = torch.randperm(sum(widths) + 2, generator=gen).tolist()
    tables, i = [], 0
    for w in widths:
        tables.append(perm[i : i + w])
        i += w
    slots = (sum(widths) + 2) * block_size
    kc = torch.randn(slots, hkv, d, generator=gen).to("cuda", dtype)
    vc = torch.randn(slots, hkv, d, generator=gen).to("cuda", dtype)
    q = torch.randn(sum(query_lens), hq, d, generator=gen).to("cuda", dtype)
    mixed = AttentionMetadata.build(query_lens, context_lens, tables, block_size, "cuda")
    ref_meta = AttentionMetadata.build(
        query_lens, context_lens, tables, block_size, "cuda", use_kernels=False
    )
    assert mixed.decode is not None and ref_meta.decode is None
    assert mixed.prefill is not None and mixed.prefill.info.shape[0] == 3 and not mixed.seqs
    torch.testing.assert_close(mixed.slot_mapping, ref_meta.slot_mapping)
    out = attend(q, (kc, vc), mixed, scale)
    ref = attend(q, (kc, vc), ref_meta, scale)
    assert not out.isnan().any()
    assert _rel_err(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_decode_rows_do_not_depend_on_the_batch_or_the_table(
    dtype: torch.dtype, batch_invariant_kernels: None
) -> None:
    """Batch-invariant mode: each row's output is the same bits alone, in a batch of 32 (where
    the default split rule cuts a long context into longer splits), in a wider table (as a CUDA
    graph's is) and beside padding rows; and within the reference's tolerance. The contexts
    span one split, several, and more than two merge passes (on a GPU)."""
    if not HAS_CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter mis-computes bf16 tl.dot (checked apart)")
    base = [5, 129, 2100, 300, 1] if HAS_CUDA else [5, 300, 1, 129]
    ctxs = (base * 32)[:32]
    bs, heads, kv_heads, d = 16, 8, 4, 64
    q, kc, vc, bt, ctx = _problem(ctxs, heads, kv_heads, d, bs, dtype, DEVICE, 7)
    scale = d**-0.5
    n = len(base)
    alone = torch.cat(
        [pa.paged_decode(q[i : i + 1], kc, vc, bt[i : i + 1], ctx[i : i + 1], bs, scale)
         for i in range(n)]
    )  # fmt: skip
    ref = pa.paged_decode_torch(q[:n], kc, vc, bt[:n], ctx[:n], bs, scale)
    assert _rel_err(alone, ref) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)
    together = pa.paged_decode(q, kc, vc, bt, ctx, bs, scale)
    assert torch.equal(together[:n], alone)
    wide = torch.cat([bt, torch.zeros(len(ctxs), 40, dtype=bt.dtype, device=DEVICE)], dim=1)
    order = torch.tensor(list(reversed(range(n))), device=DEVICE)
    pad = torch.zeros(2, dtype=ctx.dtype, device=DEVICE)  # graph padding: context 0
    got = pa.paged_decode(
        torch.cat([q[order], q[:2]]), kc, vc, torch.cat([wide[order], wide[:2]]),
        torch.cat([ctx[order], pad]), bs, scale,
    )  # fmt: skip
    assert torch.equal(got[:n], alone[order])
    assert_counters_zero()
