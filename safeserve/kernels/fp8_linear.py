"""Block-FP8 linear (W8A8, Triton): `fp8_linear_w8a8(x, w, scale_inv, bias)` computes what
`fp8_reference.fp8_linear(..., quantize_input=True)` does, for a weight `[out, in]` stored as
float8_e4m3fn with one float32 `scale_inv` per 128 x 128 tile: activations quantized per token
and 128 columns (`fp8_quant.token_group_quant`), then one GEMM whose K loop runs in 128-wide
steps, each step's FP8 dot scaled by the rows' activation scales and the weight tile's scale,
bias and the cast in the epilogue.

Tiles: BLOCK_K is the scale block's 128 columns and BLOCK_N divides its 128 rows (one weight
scale per program and K step); BLOCK_M by row count. Untuned defaults, not a table. Only
`block == (128, 128)` takes the kernel (other blocks run the torch reference).

Decode-sized calls (up to `SKINNY_MAX_ROWS` rows) take `_fp8_skinny_kernel` instead, the FP8
form of `linear.skinny_linear`: one program per (column tile, K slice of one or two 128-column
blocks: `skinny_kb_per`), so a weight of a few MB spreads over hundreds of programs instead of a
few dozen that each loop over K. Each program reads its first weight tile before its
dependent-launch wait, quantizes its rows' columns itself (the values `token_group_quant` gives:
no launch of its own), stores its scaled float32 product, and the last program of a column tile
to arrive sums the K slices in order (the tiled kernel's order), adds the bias and stores.
"""

from __future__ import annotations

import torch

from safeserve.kernels.common import (
    HAS_TRITON,
    next_power_of_2,
    pdl_supported,
    shared_memory_per_program,
    tl,
    triton,
    use_kernels,
)
from safeserve.kernels.fp8_quant import GROUP, token_group_quant
from safeserve.kernels.fp8_reference import MIN_AMAX, fp8_linear

# Rows up to which a call takes the split-K kernel (kernels/bench_fp8_linear.py on an H200: at 32
# and 64 rows the tiled kernel was faster, 16-17 against 22-64 us for q_proj and o_proj).
SKINNY_MAX_ROWS = 16

if HAS_TRITON:
    from safeserve.kernels.common import grouped_tile, pdl_wait, round_e4m3, zeroed_counters
    from safeserve.kernels.linear import _arrive, _merge

    @triton.jit(do_not_specialize=["m"])
    def _fp8_skinny_kernel(
        x_ptr,
        w_ptr,
        ws_ptr,
        bias_ptr,
        out_ptr,
        part_ptr,
        sync_ptr,
        m,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_wsn,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        KB_PER: tl.constexpr,
        MIN_SCALE_AMAX: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """One (column tile nb, K slice kb of KB_PER 128-column blocks): x's rows quantized per
        block, the blocks' products with the weight tiles scaled and summed in order, then the
        split-K merge of `linear`."""
        pid = tl.program_id(0)
        nb = pid // SPLIT_K
        kb = pid % SPLIT_K
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < m
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(KB_PER):
            kblock = kb * KB_PER + j
            offs_k = kblock * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            # the first weight tile and its scale before the wait: weights are never written
            # while serving, so they stream in while the launch before this one finishes
            b_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            b = tl.load(b_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            b_s = tl.load(
                ws_ptr + ((nb * BLOCK_N) // BLOCK_K) * stride_wsn + kblock,
                mask=kblock * BLOCK_K < K,
                other=0.0,
            )
            if j == 0:
                pdl_wait(USE_PDL)
            a_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
            x = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            # token_group_quant's values (scale = max|x| / 448, IEEE-rounded divisions)
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_SCALE_AMAX)
            a_s = tl.div_rn(amax, 448.0)
            a = round_e4m3(tl.div_rn(x, a_s[:, None])).to(tl.float8e4nv)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s)
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        o_mask = row_ok[:, None] & col_ok[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            p_rows = part_ptr + rows[:, None].to(tl.int64) * (SPLIT_K * N) + cols[None, :]
            if _arrive(acc, p_rows, o_mask, kb, N, sync_ptr + nb, SPLIT_K):
                # K blocks in order, as the tiled kernel sums them
                _merge(p_rows, o_ptrs, o_mask, bias_ptr, cols, col_ok, N, sync_ptr + nb,
                       HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)  # fmt: skip

    @triton.jit(do_not_specialize=["M"])
    def _fp8_linear_kernel(
        xq_ptr,
        xs_ptr,
        w_ptr,
        ws_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_xsm,
        stride_wn,
        stride_wsn,
        stride_om,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SCALE_N: tl.constexpr,
        GROUP_M: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """out[rows, cols] = (x @ W.T)[rows, cols] (+ bias) for one output tile."""
        pdl_wait(USE_PDL)
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_nw = tl.where(n_ok, offs_n, 0)
        offs_k = tl.arange(0, BLOCK_K)
        rows64 = rows.to(tl.int64)
        a_ptrs = xq_ptr + rows64[:, None] * stride_xm + offs_k[None, :]
        xs_rows = xs_ptr + rows64 * stride_xsm
        b_ptrs = w_ptr + offs_nw[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        bs_ptr = ws_ptr + ((pid_n * BLOCK_N) // SCALE_N) * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = offs_k < K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            a_s = tl.load(xs_rows + kk, mask=row_ok, other=0.0)
            b_s = tl.load(bs_ptr + kk)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_ptr + rows64[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def skinny_block_n(n: int, k: int, sms: int) -> int:
    """Columns per program of the split-K kernel: 128 where that gives two programs per SM,
    else 64, else 32 (more programs for a small weight)."""
    blocks = -(-k // GROUP)
    for block_n in (128, 64):
        if -(-n // block_n) * blocks >= 2 * sms:
            return block_n
    return 32


def skinny_kb_per(rows: int) -> int:
    """128-column K blocks per program: one up to 8 rows, two above (H200: 9-16 rows took
    13.5-14.3 us with two against 15.3-17.9 with one for q_proj and o_proj)."""
    return 1 if rows <= 8 else 2


def _skinny(
    x: torch.Tensor,
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    block_n: int | None = None,
    kb_per: int | None = None,
) -> None:
    from safeserve.kernels.linear import _sm_count

    m, k = x.shape
    n = w.shape[0]
    kb_per = kb_per or skinny_kb_per(m)
    blocks = triton.cdiv(k, GROUP)
    split = triton.cdiv(blocks, kb_per)
    block_n = block_n or skinny_block_n(n, split * GROUP, _sm_count(x.device))
    tiles = triton.cdiv(n, block_n)
    if split > 1:
        part = torch.empty(m, split, n, dtype=torch.float32, device=x.device)
        sync = zeroed_counters(x.device, tiles, "fp8_skinny_linear")
    else:
        part = sync = out  # not read
    pdl = pdl_supported(x.device)
    _fp8_skinny_kernel[(tiles * split,)](
        x,
        w,
        scale_inv,
        bias if bias is not None else out,
        out,
        part,
        sync,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        scale_inv.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=max(16, next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=GROUP,
        SPLIT_K=split,
        KB_PER=kb_per,
        MIN_SCALE_AMAX=MIN_AMAX,
        USE_PDL=pdl,
        num_warps=4,
        num_stages=1,
        launch_pdl=pdl,
    )


def default_config(rows: int, shared_bytes: int) -> dict[str, int]:
    """Untuned tiles: 16-row tiles up to 64 rows (decode), then 64 and 128; 128 output columns;
    two pipeline stages where shared memory is under 128 KiB."""
    block_m = 16 if rows <= 64 else 64 if rows <= 1024 else 128
    stages = 3 if shared_bytes >= 128 * 1024 else 2
    return {"BLOCK_M": block_m, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 4, "stages": stages}


def fp8_linear_w8a8(
    x: torch.Tensor,
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = (GROUP, GROUP),
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [..., in] @ W.T (+ bias) in x's dtype, W the block-FP8 weight `w` [out, in] with its
    float32 `scale_inv` [ceil(out / 128), ceil(in / 128)], activations quantized per token and
    128 columns (W8A8)."""
    if not use_kernels(x) or tuple(block) != (GROUP, GROUP):
        return fp8_linear(x, w, scale_inv, bias, tuple(block), quantize_input=True)  # type: ignore[arg-type]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    w = w if w.stride(1) == 1 else w.contiguous()
    scale_inv = scale_inv if scale_inv.stride(1) == 1 else scale_inv.contiguous()
    if m <= SKINNY_MAX_ROWS and config is None:
        _skinny(x2 if x2.stride(1) == 1 else x2.contiguous(), w, scale_inv, bias, out)
        return out.reshape(*lead, n)
    xq, xs = token_group_quant(x2)
    cfg = config or default_config(m, shared_memory_per_program(x.device))
    assert GROUP % cfg["BLOCK_N"] == 0, "a tile's columns must lie within one weight scale row"
    pdl = pdl_supported(x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _fp8_linear_kernel[grid](
        xq,
        xs,
        w,
        scale_inv,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        xq.stride(0),
        xs.stride(0),
        w.stride(0),
        scale_inv.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=GROUP,
        SCALE_N=GROUP,
        GROUP_M=cfg["GROUP_M"],
        USE_PDL=pdl,
        num_warps=cfg["num_warps"],
        num_stages=cfg["stages"],
        launch_pdl=pdl,
    )
    return out.reshape(*lead, n)
