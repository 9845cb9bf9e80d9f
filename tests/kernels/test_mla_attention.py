"""Multi-head latent attention over the paged latent cache: the torch references against the
engine's torch path (`attend`, one SDPA per sequence) on CPU; the Triton kernels (decode with
split-K and its combine, prefill) against the references on a GPU, or in Triton's interpreter
with TRITON_INTERPRET=1 (float32 and float16 there: Triton 3.6's interpreter mis-computes bf16
tl.dot; bf16 on the GPU)."""

from __future__ import annotations

import os

import pytest
import torch
from seeds import seeded

from safeserve.kernels import mla_attention as mla
from safeserve.kernels.common import HAS_TRITON
from safeserve.kernels.paged_prefill import prefill_info
from safeserve.layers.paged_attention import AttentionMetadata, attend

HAS_CUDA = torch.cuda.is_available() and HAS_TRITON
INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"

_kernel_runs = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs a CUDA device (or TRITON_INTERPRET=1)"
)


def needs_kernel(test):  # type: ignore[no-untyped-def]
    """Runs the kernel on a GPU, or under Triton's interpreter on CPU; marked `kernel` so that
    GPU runs filtered by marker (-m "gpu or kernel") take it too."""
    return pytest.mark.kernel(_kernel_runs(test))


# float32 everywhere; float16 in the interpreter too; bf16 on the GPU only
KERNEL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _skip_dtype(dtype: torch.dtype) -> None:
    if not HAS_CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter mis-computes bf16 tl.dot (checked on the GPU)")


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def _tables(ctxs: list[int], bs: int, gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Scattered, shuffled block tables (every sequence its own blocks), padded with 0 to one
    width; and the number of blocks of the cache (a few more than the tables use)."""
    widths = [max(1, (c + bs - 1) // bs) for c in ctxs]
    num_blocks = sum(widths) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for w in widths:
        tables.append(perm[i : i + w])
        i += w
    return tables, num_blocks


def _padded(tables: list[list[int]], device: str) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).to(device)


def _decode_problem(ctxs, heads, dk, bs, dtype, device, seed):  # type: ignore[no-untyped-def]
    """Random q [B, H, Dk], a random cache (every slot filled), tables, context lengths."""
    gen = seeded(seed)
    tables, num_blocks = _tables(ctxs, bs, gen)
    cache = torch.randn(num_blocks * bs, 1, dk, generator=gen).to(device, dtype)
    q = torch.randn(len(ctxs), heads, dk, generator=gen).to(device, dtype)
    ctx = torch.tensor(ctxs, dtype=torch.int32, device=device)
    return q, cache, _padded(tables, device), ctx, tables


def _prefill_problem(q_lens, ctxs, heads, dk, bs, dtype, device, seed):  # type: ignore[no-untyped-def]
    gen = seeded(seed)
    tables, num_blocks = _tables(ctxs, bs, gen)
    cache = torch.randn(num_blocks * bs, 1, dk, generator=gen).to(device, dtype)
    q = torch.randn(sum(q_lens), heads, dk, generator=gen).to(device, dtype)
    starts = [sum(q_lens[:s]) for s in range(len(q_lens))]
    info = prefill_info(starts, q_lens, ctxs).to(device)
    return q, cache, _padded(tables, device), info, tables


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _decode_twice(q, cache, bt, ctx, bs, scale, dv, config=None):  # type: ignore[no-untyped-def]
    """The kernel into a NaN-filled `out`, twice: the second answer is bit-identical to the
    first (the combine's order is fixed) and nothing is left NaN."""
    outs = []
    for _ in range(2):
        out = torch.full((q.shape[0], q.shape[1], dv), float("nan"), dtype=q.dtype, device=q.device)
        mla.mla_decode(q, cache, bt, ctx, bs, scale, dv, out=out, config=config)
        outs.append(out)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])
    return outs[0]


# ---------------------------------------------------------------------------------------------
# The references against the engine's torch path (CPU).
# ---------------------------------------------------------------------------------------------


def test_mla_decode_reference_matches_engine_torch_path() -> None:
    """The decode oracle computes what the model's attention computes over a latent cache:
    `attend` with (cache, cache[..., :v_dim]) as one KV head shared by every query head."""
    bs, dk, dv, scale = 4, 40, 32, 0.3
    ctxs = [1, 7, 12, 5]
    q, cache, bt, ctx, tables = _decode_problem(ctxs, 8, dk, bs, torch.float32, "cpu", 0)
    ref = mla.mla_decode_torch(q, cache, bt, ctx, bs, scale, dv)
    meta = AttentionMetadata.build([1] * len(ctxs), ctxs, tables, bs, "cpu", use_kernels=False)
    assert not meta.is_decode_kernel and len(meta.seqs) == len(ctxs)
    out = attend(q, (cache, cache[..., :dv]), meta, scale)
    assert out.shape == (len(ctxs), 8, dv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_mla_prefill_reference_matches_engine_torch_path() -> None:
    """The prefill oracle against `attend`'s per-sequence SDPA: a first chunk, a later chunk
    over earlier context, a one-token chunk, all in one step."""
    bs, dk, dv, scale = 4, 72, 64, 0.2
    q_lens, ctxs = [6, 3, 1], [6, 20, 9]
    q, cache, bt, info, tables = _prefill_problem(q_lens, ctxs, 4, dk, bs, torch.float32, "cpu", 1)
    out = torch.zeros(q.shape[0], q.shape[1], dv)
    ref = mla.mla_prefill_torch(q, cache, bt, info, bs, scale, dv, out)
    meta = AttentionMetadata.build(q_lens, ctxs, tables, bs, "cpu", use_kernels=False)
    assert meta.prefill is None and len(meta.seqs) == 3
    torch.testing.assert_close(
        attend(q, (cache, cache[..., :dv]), meta, scale), ref, atol=1e-5, rtol=1e-5
    )


@pytest.mark.skipif(INTERPRET, reason="the interpreter takes the kernel path")
def test_entry_points_run_the_references_where_kernels_do_not_apply() -> None:
    """CPU tensors without the interpreter: the torch references, `out` filled in place."""
    q, cache, bt, ctx, _ = _decode_problem([3, 0, 9], 2, 40, 4, torch.float32, "cpu", 2)
    out = torch.full((3, 2, 32), float("nan"))
    got = mla.mla_decode(q, cache, bt, ctx, 4, 0.5, 32, out=out)
    assert got is out
    torch.testing.assert_close(out, mla.mla_decode_torch(q, cache, bt, ctx, 4, 0.5, 32))
    assert out[1].abs().sum() == 0
    q, cache, bt, info, _ = _prefill_problem([2, 3], [2, 5], 2, 40, 4, torch.float32, "cpu", 3)
    out = torch.zeros(5, 2, 32)
    mla.mla_prefill(q, cache, bt, info, 3, 4, 0.5, 32, out)
    ref = mla.mla_prefill_torch(q, cache, bt, info, 4, 0.5, 32, torch.zeros(5, 2, 32))
    torch.testing.assert_close(out, ref)


def test_mla_splits_and_configs_follow_shapes_and_fit_shared_memory(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cfg = mla.DECODE_CONFIG
    assert mla.decode_splits(1, 1, 4096, cfg) == 4096 // cfg["min_split"]  # table-bound
    assert mla.decode_splits(1, 1, 10, cfg) == 1
    assert mla.decode_splits(64, 1, 4096, cfg) == -(-cfg["target_programs"] // 64)
    assert mla.decode_splits(1024, 8, 4096, cfg) == 1  # the batch fills the GPU alone
    assert mla.decode_config(torch.device("cpu"), torch.bfloat16, 576, 512) == cfg
    with pytest.raises(ValueError):
        mla.decode_config(torch.device("cpu"), torch.bfloat16, 64, 72)
    # a part with 99 KiB a program: float32 latent tiles of 576 shrink to fit
    monkeypatch.setattr(mla, "shared_memory_per_program", lambda device: 99 * 1024)
    for fit in (
        mla.decode_config(torch.device("cpu"), torch.float32, 576, 512),
        mla.prefill_config(torch.device("cpu"), torch.float32, 576, 512),
    ):
        rows = fit.get("rows", fit.get("block_h"))
        need = (fit["num_stages"] * fit["block_n"] * 576 + rows * 576 + rows * fit["block_n"]) * 4
        assert need <= 99 * 1024 - mla._SHARED_SLACK
    assert mla.DECODE_CONFIG == cfg  # the defaults are copied, never changed


# ---------------------------------------------------------------------------------------------
# Decode kernel.
# ---------------------------------------------------------------------------------------------

DECODE_CASES = [
    # context lengths, heads, Dk, Dv, block size
    ([1], 16, 72, 64, 16),
    ([15], 1, 40, 32, 16),  # block_size - 1
    ([700], 16, 72, 64, 16),  # a long context: split-K over 3 programs, then the combine
    ([15, 0, 53], 16, 40, 32, 16),  # a padding row (context 0: zeros) between two others
    ([1, 15, 16, 0, 33, 700, 2, 64, 65, 0, 31, 100, 7, 257, 3, 48, 9], 16, 72, 64, 16),
    ([5, 300, 0], 1, 72, 64, 16),  # one head: a row tile of 16 with 15 masked
    ([700, 1, 0], 16, 576, 512, 16),  # DeepSeek-V3 / Moonlight's entry
    ([3, 130], 20, 576, 512, 64),  # two head blocks, the second ragged
    ([9, 70], 3, 50, 40, 1),  # latent not a power of two, one token per block
]


@needs_kernel
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_mla_decode_kernel_matches_reference(case: int, dtype: torch.dtype) -> None:
    _skip_dtype(dtype)
    ctxs, heads, dk, dv, bs = DECODE_CASES[case]
    q, cache, bt, ctx, _ = _decode_problem(ctxs, heads, dk, bs, dtype, DEVICE, seed=case + 20)
    scale = dk**-0.5
    ref = mla.mla_decode_torch(q.double(), cache.double(), bt, ctx, bs, scale, dv)
    out = _decode_twice(q, cache, bt, ctx, bs, scale, dv)
    assert out.shape == (len(ctxs), heads, dv) and out.dtype == dtype
    assert _rel_err(out, ref) <= _tol(dtype)
    for b, c in enumerate(ctxs):
        if c == 0:
            assert out[b].abs().sum() == 0
        else:  # each row on its own too (a short row's error is not hidden by a long one's)
            assert _rel_err(out[b], ref[b]) <= 2 * _tol(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_kernel_wide_table_and_strided_rows(dtype: torch.dtype) -> None:
    """A table far wider than the contexts (a CUDA graph's, sized for max_model_len): the grid
    has many splits, most past every context; then the first columns of a wider buffer (rows
    strided, garbage past them): the same answer."""
    _skip_dtype(dtype)
    ctxs, bs, dk, dv = [3, 0, 600, 40], 16, 72, 64
    q, cache, bt, ctx, _ = _decode_problem(ctxs, 16, dk, bs, dtype, DEVICE, seed=5)
    wide = torch.zeros(len(ctxs), 256, dtype=torch.int32, device=DEVICE)
    wide[:, : bt.shape[1]] = bt
    assert mla.decode_splits(len(ctxs), 1, 256 * bs, mla.DECODE_CONFIG) > 3
    ref = mla.mla_decode_torch(q.double(), cache.double(), bt, ctx, bs, 0.125, dv)
    out = _decode_twice(q, cache, wide, ctx, bs, 0.125, dv)
    assert _rel_err(out, ref) <= _tol(dtype)
    big = torch.full((len(ctxs), 256 + 37), 10**6, dtype=torch.int32, device=DEVICE)
    big[:, :256] = wide
    view = big[:, : bt.shape[1]]
    assert view.stride(0) == 256 + 37
    torch.testing.assert_close(_decode_twice(q, cache, view, ctx, bs, 0.125, dv), out)


@needs_kernel
@pytest.mark.parametrize("dv", [32, 512])
def test_mla_decode_kernel_combines_many_splits(dv: int) -> None:
    """Splits of 16 tokens (a config the shipped one never takes): 44 splits of a context of
    700, more than one combine pass holds (32 splits of 32 entries a pass, 16 of 512), each
    pass raising or keeping the running max; the row of context 16 is one split."""
    cfg = {**mla.DECODE_CONFIG, "block_n": 16, "min_split": 16, "target_programs": 4096}
    q, cache, bt, ctx, _ = _decode_problem([700, 16, 17], 16, dv + 8, 16, torch.float32, DEVICE, 9)
    assert mla.decode_splits(3, 1, bt.shape[1] * 16, cfg) == 44
    ref = mla.mla_decode_torch(q.double(), cache.double(), bt, ctx, 16, 0.3, dv)
    out = _decode_twice(q, cache, bt, ctx, 16, 0.3, dv, config=cfg)
    assert _rel_err(out, ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("ctxs", [[20, 3, 0, 90], [700], [4000, 3, 0, 700]])
@pytest.mark.parametrize("width", [None, 512])
def test_mla_decode_kernel_in_cuda_graph(ctxs: list[int], width: int | None) -> None:
    """Captured once, replayed on new contexts and contents: the reference's answers, a second
    replay bit-identical, padding rows zeros. width: a table of that many blocks (a graph
    bucket's), so contexts spread over many more splits."""
    dk, dv, bs = 576, 512, 16
    q, cache, bt, ctx, _ = _decode_problem(ctxs, 16, dk, bs, torch.bfloat16, "cuda", seed=8)
    if width is not None:
        wide = torch.zeros(len(ctxs), width, dtype=torch.int32, device="cuda")
        wide[:, : bt.shape[1]] = bt
        bt = wide
    most = bt.shape[1] * bs
    out = torch.empty(len(ctxs), 16, dv, dtype=torch.bfloat16, device="cuda")
    mla.mla_decode(q, cache, bt, ctx, bs, 0.1, dv, out=out)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla.mla_decode(q, cache, bt, ctx, bs, 0.1, dv, out=out)
    for seed in range(4):
        gen = seeded(100 + seed)
        q.copy_(torch.randn(q.shape, generator=gen))
        cache.copy_(torch.randn(cache.shape, generator=gen))
        new = torch.randint(0, most + 1, (len(ctxs),), generator=gen).to(torch.int32)
        if len(ctxs) > 2:
            new[2] = 0
        ctx.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        first = out.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
        ref = mla.mla_decode_torch(q.double(), cache.double(), bt, ctx, bs, 0.1, dv)
        assert not out.isnan().any()
        assert _rel_err(out, ref) <= 1e-2
        if len(ctxs) > 2:
            assert out[2].abs().sum() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_decode_kernel_long_contexts_on_gpu(batch: int, dtype: torch.dtype) -> None:
    """The benchmark's shapes (16 heads of 576 / 512) at 4,096 tokens of context and beyond."""
    gen = seeded(batch)
    ctxs = torch.randint(1, 6000, (batch,), generator=gen).tolist()
    ctxs[0] = 4096
    q, cache, bt, ctx, _ = _decode_problem(ctxs, 16, 576, 64, dtype, "cuda", seed=batch)
    ref = mla.mla_decode_torch(q.double(), cache.double(), bt, ctx, 64, 576**-0.5, 512)
    out = _decode_twice(q, cache, bt, ctx, 64, 576**-0.5, 512)
    assert _rel_err(out, ref) <= _tol(dtype)


# ---------------------------------------------------------------------------------------------
# Prefill kernel.
# ---------------------------------------------------------------------------------------------

PREFILL_CASES = [
    # query lengths, context lengths (>= query: earlier chunks are in the cache), H, Dk, Dv, bs
    ([5], [5], 16, 72, 64, 16),  # a first chunk
    ([33, 1, 5], [33, 70, 40], 16, 40, 32, 16),  # first chunk, 1-token and later chunks
    ([33, 5, 1], [100, 5, 1], 1, 72, 64, 16),  # one head: 64 query tokens a row tile
    ([5, 33], [21, 33], 16, 576, 512, 16),  # DeepSeek-V3 / Moonlight's entry
    ([9, 2], [9, 70], 3, 50, 40, 1),  # latent not a power of two, one token per block
]


@needs_kernel
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_mla_prefill_kernel_matches_reference(case: int, dtype: torch.dtype) -> None:
    _skip_dtype(dtype)
    q_lens, ctxs, heads, dk, dv, bs = PREFILL_CASES[case]
    q, cache, bt, info, _ = _prefill_problem(q_lens, ctxs, heads, dk, bs, dtype, DEVICE, case)
    scale = dk**-0.5
    ref = torch.zeros(q.shape[0], heads, dv, dtype=torch.float64, device=DEVICE)
    mla.mla_prefill_torch(q.double(), cache.double(), bt, info, bs, scale, dv, ref)
    out = torch.full((q.shape[0], heads, dv), float("nan"), dtype=dtype, device=DEVICE)
    mla.mla_prefill(q, cache, bt, info, max(q_lens), bs, scale, dv, out)
    assert not out.isnan().any()  # every query row written
    assert _rel_err(out, ref) <= _tol(dtype)


@needs_kernel
def test_mla_prefill_kernel_leaves_other_rows_alone() -> None:
    """Rows outside the chunks (a mixed step's decode rows) keep what `out` held."""
    q, cache, bt, info, _ = _prefill_problem([4], [10], 4, 40, 4, torch.float32, DEVICE, 7)
    out = torch.full((6, 4, 32), 7.0, device=DEVICE)
    info[0, 1] = 1  # the chunk's rows are 1..4 of a 6-row batch
    q6 = torch.zeros(6, 4, 40, device=DEVICE)
    q6[1:5] = q
    mla.mla_prefill(q6, cache, bt, info, 4, 4, 0.2, 32, out)
    assert (out[0] == 7).all() and (out[5] == 7).all() and not (out[1:5] == 7).all()


PREFILL_TILES = [
    {"rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
    {"rows": 64, "block_n": 32, "num_warps": 8, "num_stages": 2},
    {"rows": 32, "block_n": 16, "num_warps": 4, "num_stages": 1},
    {"rows": 128, "block_n": 32, "num_warps": 8, "num_stages": 2},
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("config", [None, *range(len(PREFILL_TILES))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_prefill_kernel_tile_configs_on_gpu(config: int | None, dtype: torch.dtype) -> None:
    """Long chunks at 16 and 128 heads of 576 / 512 (many context tiles unmasked, chunks ending
    mid-tile): the default tiles (fitted to the device and dtype) and, in bf16, every tile
    shape of PREFILL_TILES (float32 takes the fitted ones only: its query rows alone fill
    shared memory at 128 rows)."""
    if config is not None and dtype == torch.float32:
        pytest.skip("float32 runs the fitted tiles")
    cfg = None if config is None else PREFILL_TILES[config]
    q_lens, ctxs = [300, 1, 131], [1000, 129, 131]
    for heads in (16, 128):
        q, cache, bt, info, _ = _prefill_problem(
            q_lens, ctxs, heads, 576, 64, dtype, "cuda", config or 0
        )
        ref = torch.zeros(q.shape[0], heads, 512, dtype=torch.float64, device="cuda")
        mla.mla_prefill_torch(q.double(), cache.double(), bt, info, 64, 0.07, 512, ref)
        out = torch.full((q.shape[0], heads, 512), float("nan"), dtype=dtype, device="cuda")
        mla.mla_prefill(q, cache, bt, info, 300, 64, 0.07, 512, out, cfg)
        assert not out.isnan().any()
        assert _rel_err(out, ref) <= _tol(dtype)
