"""Linear layers of decode-sized batches (`skinny_linear`): out = x @ w.T (+ bias), split over K.

A decode step of a few sequences multiplies a handful of rows by each dense weight (q|k|v: 5,120 x
2,048; o_proj: 2,048 x 4,096 for Qwen3-30B-A3B), so the GEMM only streams the weight, and a
library GEMM of this size spends about as long starting and draining as streaming (H200: 8.0 us
for q|k|v, 8.7 us for o_proj, against floors of 5.1 and 4.0 us). Here each program owns one
[BLOCK_N columns, BLOCK_K] tile of the weight (K cut into SPLIT_K slices of one tile) and reads it
*before* it waits for the launch before it (a dependent launch, `safeserve.kernels.common`): the
weight streams in while the previous kernel finishes, and only the few rows of x wait. Each
program writes a float32 partial; the last program of a column tile to arrive (a counter per
tile, as `router_topk` does) sums the SPLIT_K partials in a fixed order, adds the bias and stores
the tile, so results do not depend on arrival order. One launch, no host synchronisation
(CUDA-graph safe). On an H200 in a graph of 48 such calls: q|k|v 7.4 us, o_proj 6.5 us at one row;
the decode step at concurrency 1 3.15 ms against 3.42 with the library GEMM (kernels/RESULTS.md).

Entry point: `linear(x, w, bias)` runs the kernel for up to `SKINNY_MAX_ROWS` rows on the kernel
path and `F.linear` otherwise (and on CPU: the model's CPU path and the test oracle). With
--enable-deterministic-inference `linear` and `gemm` run `invariant_linear` for every row count:
the same kernel over 16-row blocks with the weight's K slices fixed, so a row's result does not
depend on the batch. Up to 8 rows
it was faster in the engine; at 16 it was not. `safeserve.kernels.qkv_rope` builds the attention
block's q|k|v launch on the same program body (`_skinny_partial`, `_arrive`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from safeserve.kernels.common import (
    HAS_TRITON,
    batch_invariant,
    next_power_of_2,
    pdl_supported,
    pdl_wait,
    tl,
    triton,
    use_kernels,
    zeroed_counters,
)

# Rows up to which `linear` takes the kernel (the kernel itself pads to one 16-row dot tile).
SKINNY_MAX_ROWS = 8
_BLOCK_M = 16
# Bytes of weight one program holds (its whole tile, loaded before the wait): 64 KiB was the
# best tile for both q|k|v and o_proj in the H200 sweep (kernels/bench_linear.py --sweep).
_TILE_BYTES = 64 << 10


def skinny_plan(n: int, k: int, sms: int = 132, elt: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K) for an [n, k] weight of `elt`-byte elements: one tile per
    program (SPLIT_K = K / BLOCK_K), K tiles of 512 from K = 4,096 up (else 256, or K itself
    when smaller); 128 columns where that still gives two programs per SM, else 64; narrower
    where the tile would pass `_TILE_BYTES`. H200 sweep: q|k|v (128, 256, 8), o_proj (64, 512, 8)."""
    block_k = max(16, min(next_power_of_2(k), 512 if k >= 4096 else 256))
    split = -(-k // block_k)
    block_n = 128 if -(-n // 128) * split >= 2 * sms else 64
    return max(16, min(block_n, _TILE_BYTES // (block_k * elt))), block_k, split


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`; in batch-invariant mode `invariant_linear` (a library GEMM's tiles and split
    follow the batch size)."""
    return invariant_linear(x, w, bias) if batch_invariant() else F.linear(x, w, bias)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias [N]) in x's dtype (float32 accumulation)."""
    if batch_invariant():
        return invariant_linear(x, w, bias)
    if (
        not use_kernels(x)
        or x.dim() != 2
        or not 0 < x.shape[0] <= SKINNY_MAX_ROWS
        or w.stride(1) != 1
    ):
        return F.linear(x, w, bias)
    return skinny_linear(x, w, bias)


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    plan: tuple[int, int, int] | None = None,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """The kernel, for up to 16 rows; `plan` = (BLOCK_N, BLOCK_K, SPLIT_K) overrides
    `skinny_plan` (benchmarks, tests). A plan whose K slice spans several BLOCK_K tiles loops
    over them after the wait instead of reading its weight first."""
    if x.shape[0] > _BLOCK_M:
        raise ValueError(f"skinny_linear takes at most {_BLOCK_M} rows, got {x.shape[0]}")
    return _launch(x, w, bias, plan, num_warps, num_stages)


# --enable-deterministic-inference: rows in blocks of this many (one tile shape for every batch);
# up to INVARIANT_SPLIT_ROWS rows the K slices of a block run on programs of their own (split-K:
# decode batches), above that, or where a launch's partials would pass _INVARIANT_PART_BYTES (an
# LM head's), each program sums its tile's slices itself.
INVARIANT_BLOCK_M = 16
INVARIANT_SPLIT_ROWS = 64
_INVARIANT_PART_BYTES = 64 << 20


def invariant_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias) for any M with each row's result independent of the batch
    (--enable-deterministic-inference): rows in blocks of `INVARIANT_BLOCK_M`, and K cut into
    the slices of the weight's plan (`skinny_plan`) whatever M is, each slice's product summed
    in slice order. Up to `INVARIANT_SPLIT_ROWS` rows the slices run on programs of their own
    (split-K, the last one sums them); above (or where the partials would pass
    `_INVARIANT_PART_BYTES`), each program runs every slice of its tile in turn and sums them
    the same way, with no partials in memory: the same bits either way. The CPU path is
    `F.linear`."""
    if not use_kernels(x) or x.dim() != 2 or w.stride(1) != 1:
        return F.linear(x, w, bias)
    n, k = w.shape
    plan = skinny_plan(n, k, _sm_count(x.device), min(x.element_size(), w.element_size()))
    m = x.shape[0]
    rows = -(-m // INVARIANT_BLOCK_M) * INVARIANT_BLOCK_M
    partials = rows * plan[2] * n * 4  # the launch's, with the slices split over programs
    return _launch(
        x, w, bias, plan, 4, 4, block_m=INVARIANT_BLOCK_M,
        in_program=m > INVARIANT_SPLIT_ROWS or partials > _INVARIANT_PART_BYTES,
    )  # fmt: skip


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    plan: tuple[int, int, int] | None,
    num_warps: int,
    num_stages: int,
    block_m: int = _BLOCK_M,
    in_program: bool = False,
) -> torch.Tensor:
    """One launch: row blocks of `block_m` on the grid's second axis; the K slices on programs
    of their own, or with `in_program` summed inside each program (no partials, no counters)."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"weight {tuple(w.shape)} does not take {k} input features")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, block_k, split = plan or skinny_plan(
        n, k, _sm_count(x.device), min(x.element_size(), w.element_size())
    )
    tiles = triton.cdiv(n, block_n)
    row_blocks = triton.cdiv(m, block_m)
    # K per program: a multiple of BLOCK_K, so only the last slice can be ragged.
    k_per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per)
    if split > 1 and not in_program:
        part = torch.empty(row_blocks * block_m, split, n, dtype=torch.float32, device=x.device)
        sync = zeroed_counters(x.device, tiles * row_blocks, "skinny_linear")
    else:
        part = sync = out  # not read
    pdl = pdl_supported(x.device)
    _skinny_linear_kernel[(tiles * (1 if in_program else split), row_blocks)](
        x,
        w,
        bias if bias is not None else out,
        out,
        part,
        sync,
        m,
        n,
        k,
        k_per,
        x.stride(0),
        w.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        IN_PROGRAM=in_program and split > 1,
        ONE_TILE=k_per <= block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    return out


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # Triton's interpreter: an H100/H200's count, so plans match theirs
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


if HAS_TRITON:

    @triton.jit
    def _skinny_partial(
        x_ptr,
        w_ptr,
        m,
        N,
        K,
        k_per,
        stride_xm,
        stride_wn,
        nb,
        kb,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ONE_TILE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """x[:, K slice kb] @ w[column tile nb, K slice kb].T in float32 [BLOCK_M, BLOCK_N];
        the program's dependent-launch wait happens in here."""
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < m
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        offs_k = tl.arange(0, BLOCK_K)
        k0 = kb * k_per
        k_end = tl.minimum(K, k0 + k_per)
        a_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :]
        b_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k0 + offs_k)[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if ONE_TILE:
            # The program's whole weight slice is one tile: it is read before the wait (a
            # weight, never written while serving), so it streams in while the launch before
            # this one finishes; only x waits.
            k_ok = k0 + offs_k < k_end
            b = tl.load(b_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            pdl_wait(USE_PDL)
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        else:
            pdl_wait(USE_PDL)
            for kk in range(k0, k_end, BLOCK_K):
                k_ok = kk + offs_k < k_end
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
        return acc

    @triton.jit
    def _arrive(acc, p_rows, o_mask, kb, N, counter, SPLIT_K: tl.constexpr):
        """Store this program's partial at p_rows + kb * N and count it in; True for the
        program that arrives last (it then reads the partials, see `_skinny_linear_kernel`)."""
        tl.store(p_rows + kb * N, acc, mask=o_mask)
        tl.debug_barrier()  # every thread's partial is issued before the release
        last = tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1
        tl.debug_barrier()
        return last

    @triton.jit
    def _merge(
        p_rows, o_ptrs, o_mask, b_ptr, cols, col_ok, N, counter,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):  # fmt: skip
        """The last program's part of the split-K merge: the SPLIT_K partials at p_rows +
        j * N summed in slice order (deterministic), the bias, the store; the tile's counter
        back to 0."""
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(SPLIT_K):
            total += tl.load(p_rows + j * N, mask=o_mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptrs, total.to(o_ptrs.dtype.element_ty), mask=o_mask)
        tl.atomic_xchg(counter, 0)

    @triton.jit(do_not_specialize=["m"])
    def _skinny_linear_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        part_ptr,
        sync_ptr,
        m,
        N,
        K,
        k_per,
        stride_xm,
        stride_wn,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        IN_PROGRAM: tl.constexpr,
        ONE_TILE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        # IN_PROGRAM: one program per column tile runs its SPLIT_K slices itself
        nb = pid if IN_PROGRAM else pid // SPLIT_K
        kb = 0 if IN_PROGRAM else pid % SPLIT_K
        # row block mb of the launch (one unless `invariant_linear` runs more than 16 rows): its
        # rows, outputs, partials and counters are the ones of a launch of its own
        mb = tl.program_id(1)
        x_ptr += mb * BLOCK_M * stride_xm
        out_ptr += mb * BLOCK_M * N
        part_ptr += mb * BLOCK_M * SPLIT_K * N
        sync_ptr += mb * tl.cdiv(N, BLOCK_N)
        m = tl.minimum(m - mb * BLOCK_M, BLOCK_M)
        if IN_PROGRAM:
            # The slices' products summed in slice order, as the split-K merge below sums them.
            # The select keeps the compiler from folding `acc + dot(a, b, 0)` into `dot(a, b,
            # acc)` (the tensor core would then add acc inside the product: other roundings).
            live = (tl.arange(0, BLOCK_M) < m)[:, None]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(SPLIT_K):
                part = _skinny_partial(
                    x_ptr, w_ptr, m, N, K, k_per, stride_xm, stride_wn, nb, j,
                    BLOCK_M, BLOCK_N, BLOCK_K, ONE_TILE, DOT_PRECISION, USE_PDL and j == 0,
                )  # fmt: skip
                acc += tl.where(live, part, 0.0)
        else:
            acc = _skinny_partial(
                x_ptr, w_ptr, m, N, K, k_per, stride_xm, stride_wn, nb, kb,
                BLOCK_M, BLOCK_N, BLOCK_K, ONE_TILE, DOT_PRECISION, USE_PDL,
            )  # fmt: skip
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < m
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        o_mask = row_ok[:, None] & col_ok[None, :]
        if SPLIT_K == 1 or IN_PROGRAM:
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            p_rows = part_ptr + rows[:, None].to(tl.int64) * (SPLIT_K * N) + cols[None, :]
            if _arrive(acc, p_rows, o_mask, kb, N, sync_ptr + nb, SPLIT_K):
                _merge(p_rows, o_ptrs, o_mask, b_ptr, cols, col_ok, N, sync_ptr + nb,
                       HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)  # fmt: skip

else:  # pragma: no cover - exercised where Triton is missing
    _skinny_linear_kernel = None
