"""Block-FP8 fused MoE (W8A8, Triton): `fused_moe_fp8` computes what
`fp8_reference.grouped_experts_fp8(..., quantize_input=True)` does, for experts stored as
float8_e4m3fn with one float32 `scale_inv` per 128 x 128 tile (DeepSeek-V3's and Qwen3-FP8's
format).

Four launches of the sorted plan (the pairs sorted by expert and padded per expert to `BLOCK_M`
rows by `moe_align`, as `fused_moe`'s sorted plan):

1. `fp8_quant.token_group_quant`: activations to FP8 per token and 128 columns.
2. gate/up: one row tile of one expert against 128 intermediate columns of gate and of up; in
   the K loop each 128-wide step's FP8 dot is scaled by the rows' activation scales and the two
   weight tiles' scales; the epilogue applies SiLU-and-mul and quantizes the 128 columns it holds
   (one scale group per row: the tile is the group) to FP8 with their scales.
3. down: the FP8 intermediate against w2 (its scales per 128 x 128 tile), times the pair's
   routing weight, one row per pair.
4. the top-k sum of `fused_moe` (slots with id -1 skipped).

The intermediate's FP8 rounding is `common.round_e4m3` (in float32, so the conversion is
exact, as the activation quantizer's).

Tiles: BLOCK_K is the scale block's 128 columns and gate/up's BLOCK_N its 128 rows; only
`block == (128, 128)` takes the kernels (other blocks run the torch reference). The rest
(BLOCK_M, down's BLOCK_N, GROUP_M, warps, stages) come from a tile table of the layer shape and
device (`fp8_w8a8_128x128_E.._H.._I.._<device>.json` in `configs/`, or the file
`SAFESERVE_FUSED_MOE_FP8_CONFIG` names; `kernels/bench_fused_moe_fp8.py --sweep` writes one),
nearest by token count, else `default_config`. Every grid depends on shapes only (CUDA-graph
safe).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from safeserve.kernels import moe_config as mc
from safeserve.kernels.common import (
    HAS_TRITON,
    pdl_supported,
    shared_memory_per_program,
    tl,
    triton,
    use_kernels,
)
from safeserve.kernels.fp8_quant import GROUP, token_group_quant
from safeserve.kernels.fp8_reference import FP8, MIN_AMAX, grouped_experts_fp8
from safeserve.kernels.fused_moe import sum_topk
from safeserve.kernels.moe_align import moe_align

if HAS_TRITON:
    from safeserve.kernels.common import grouped_tile, pdl_wait, round_e4m3

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
    def _gate_up_fp8_kernel(
        xq_ptr,
        xs_ptr,
        w_ptr,
        ws_ptr,
        hq_ptr,
        hs_ptr,
        sorted_ptr,
        block_expert_ptr,
        npost_ptr,
        num_pairs,
        num_blocks_m,
        N,
        K,
        stride_xt,
        stride_xst,
        stride_we,
        stride_wn,
        stride_wse,
        stride_wsn,
        stride_hm,
        stride_hsm,
        TOP_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        MIN_SCALE_AMAX: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """hq, hs of rows [pid_m tile] x intermediate columns [pid_n tile]: silu(x @ gate.T) *
        (x @ up.T) from FP8 x and FP8 w13, quantized per row over the tile's BLOCK_N (= the
        scale group) columns."""
        pdl_wait(USE_PDL)
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = grouped_tile(pid, num_blocks_m, num_pid_n, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows)
        row_ok = pair < num_pairs
        token = (pair // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_nw = tl.where(n_ok, offs_n, 0)
        offs_k = tl.arange(0, BLOCK_K)
        w_e = w_ptr + expert * stride_we
        g_ptrs = w_e + offs_nw[None, :] * stride_wn + offs_k[:, None]
        u_ptrs = g_ptrs + N * stride_wn
        a_ptrs = xq_ptr + token[:, None] * stride_xt + offs_k[None, :]
        xs_rows = xs_ptr + token * stride_xst
        ws_e = ws_ptr + expert * stride_wse
        gs_ptr = ws_e + pid_n * stride_wsn  # gate's tile row; up's follow gate's cdiv(N, 128)
        us_ptr = ws_e + (num_pid_n + pid_n) * stride_wsn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = offs_k < K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
            a_s = tl.load(xs_rows + kk, mask=row_ok, other=0.0)
            g_s = tl.load(gs_ptr + kk)
            u_s = tl.load(us_ptr + kk)
            acc_g += tl.dot(a, bg) * (a_s[:, None] * g_s)
            acc_u += tl.dot(a, bu) * (a_s[:, None] * u_s)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        h = tl.where(n_ok[None, :], h, 0.0)
        amax = tl.maximum(tl.max(tl.abs(h), axis=1), MIN_SCALE_AMAX)
        scale = tl.div_rn(amax, 448.0)  # IEEE-rounded, as fp8_quant's
        q = round_e4m3(tl.div_rn(h, scale[:, None]))
        h_ptrs = hq_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_n[None, :]
        tl.store(h_ptrs, q.to(hq_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
        tl.store(hs_ptr + rows.to(tl.int64) * stride_hsm + pid_n, scale, mask=row_ok)

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
    def _down_fp8_kernel(
        hq_ptr,
        hs_ptr,
        w_ptr,
        ws_ptr,
        y_ptr,
        topk_w_ptr,
        sorted_ptr,
        block_expert_ptr,
        npost_ptr,
        num_pairs,
        num_blocks_m,
        N,
        K,
        stride_hm,
        stride_hsm,
        stride_we,
        stride_wn,
        stride_wse,
        stride_wsn,
        stride_ym,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SCALE_N: tl.constexpr,
        GROUP_M: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """y[pair, n] = w_pair * (h[row] @ down[e].T) from the FP8 intermediate (N = hidden,
        K = intermediate); BLOCK_N divides SCALE_N (the weight's scale rows)."""
        pdl_wait(USE_PDL)
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = grouped_tile(pid, num_blocks_m, num_pid_n, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows)
        row_ok = pair < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_nw = tl.where(n_ok, offs_n, 0)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = hq_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
        hs_rows = hs_ptr + rows.to(tl.int64) * stride_hsm
        b_ptrs = w_ptr + expert * stride_we + offs_nw[None, :] * stride_wn + offs_k[:, None]
        bs_ptr = ws_ptr + expert * stride_wse + ((pid_n * BLOCK_N) // SCALE_N) * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = offs_k < K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            a_s = tl.load(hs_rows + kk, mask=row_ok, other=0.0)
            b_s = tl.load(bs_ptr + kk)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        route_w = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        y = acc * route_w[:, None]
        y_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def default_config(num_tokens: int, shared_bytes: int) -> dict[str, int]:
    """Untuned tiles: rows per expert tile by token count; two pipeline stages where shared
    memory is under 128 KiB (a stage of gate/up holds BLOCK_M x 128 + 2 x 128 x 128 bytes)."""
    block_m = 16 if num_tokens <= 64 else 32 if num_tokens <= 512 else 64
    stages = 3 if shared_bytes >= 128 * 1024 else 2
    return {"BLOCK_M": block_m, "BLOCK_N2": 128, "GROUP_M": 8, "num_warps": 4, "stages": stages}


# Tile tables: token count -> config, one file per layer shape and device, named with the
# scheme first so the bf16 tables' lookup (moe_config, by E/H/I prefix) never reads one.
FP8_TABLE_PREFIX = "fp8_w8a8_128x128_"
FP8_CONFIG_ENV = "SAFESERVE_FUSED_MOE_FP8_CONFIG"
_FP8_KEYS = {"BLOCK_M", "BLOCK_N2", "GROUP_M", "num_warps", "stages"}


def fp8_config_file_name(num_experts: int, hidden: int, inter: int, device_name: str) -> str:
    return FP8_TABLE_PREFIX + mc.config_file_name(num_experts, hidden, inter, device_name)


def check_fp8_config(cfg: dict[str, int], where: str) -> None:
    """Raise mc.ConfigTableError for an entry the launcher cannot use."""
    if not isinstance(cfg, dict):
        raise mc.ConfigTableError(f"{where}: an entry must be an object")
    keys = set(cfg) - {"tuned_us"}
    if keys != _FP8_KEYS:
        raise mc.ConfigTableError(f"{where}: keys {sorted(keys)}, expected {sorted(_FP8_KEYS)}")
    if cfg["BLOCK_M"] not in (16, 32, 64, 128, 256):
        raise mc.ConfigTableError(f"{where}: BLOCK_M {cfg['BLOCK_M']!r} is not 16..256")
    if cfg["BLOCK_N2"] not in (16, 32, 64, 128):
        raise mc.ConfigTableError(f"{where}: BLOCK_N2 {cfg['BLOCK_N2']!r} must divide 128")
    if cfg["num_warps"] not in (1, 2, 4, 8, 16) or not 1 <= cfg["stages"] <= 8:
        raise mc.ConfigTableError(f"{where}: num_warps or stages out of range")
    if not isinstance(cfg["GROUP_M"], int) or cfg["GROUP_M"] < 1:
        raise mc.ConfigTableError(f"{where}: GROUP_M must be a positive integer")


@functools.lru_cache(maxsize=32)
def load_fp8_table(path: str) -> dict[int, dict[str, int]] | None:
    """Token count -> config from one JSON file (`{"configs": {...}, "meta": {...}}` or the
    bare mapping); None when there is no such file."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
        out = {int(k): v for k, v in data.get("configs", data).items()}
    except (ValueError, AttributeError) as e:
        raise mc.ConfigTableError(f"{path}: not a token-count -> config table ({e})") from e
    if not out:
        raise mc.ConfigTableError(f"{path}: the table is empty")
    for tokens, cfg in out.items():
        check_fp8_config(cfg, f"{path}, {tokens} tokens")
    return out


def get_fp8_config(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    inter: int,
    device: torch.device,
    config_dir: Path | str | None = None,
) -> dict[str, int]:
    """The tuned entry nearest by token count from `SAFESERVE_FUSED_MOE_FP8_CONFIG`'s table or
    the shipped one of this shape and device; else `default_config`."""
    name = mc._cuda_identity(device.index or 0)[0] if device.type == "cuda" else "cpu"
    env = os.environ.get(FP8_CONFIG_ENV)
    directory = Path(config_dir) if config_dir is not None else mc.CONFIG_DIR
    path = env or str(directory / fp8_config_file_name(num_experts, hidden, inter, name))
    table = load_fp8_table(path)
    if env and table is None:
        raise mc.ConfigTableError(f"{FP8_CONFIG_ENV}={env}: no such file")
    if not table:
        return default_config(num_tokens, shared_memory_per_program(device))
    return {k: v for k, v in mc.nearest_config(table, num_tokens).items() if k != "tuned_us"}


def fused_moe_fp8(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block: tuple[int, int] = (GROUP, GROUP),
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """For every token, the routing-weighted sum over its valid top-k slots (ids >= 0) of
    `down(silu(gate(x)) * up(x))` with block-FP8 experts and FP8 activations (W8A8): w13
    [E, 2I, H] (gate rows, then up rows) with scales [E, 2 * ceil(I / 128), ceil(H / 128)],
    w2 [E, H, I] with [E, ceil(H / 128), ceil(I / 128)]. Result in `hidden_states`' dtype."""
    if not use_kernels(hidden_states) or tuple(block) != (GROUP, GROUP):
        return grouped_experts_fp8(
            hidden_states,
            w13,
            w13_scale_inv,
            w2,
            w2_scale_inv,
            topk_ids,
            topk_weights,
            tuple(block),  # type: ignore[arg-type]
            quantize_input=True,
        )
    x = hidden_states
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    device = x.device
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=device)
    if num_tokens == 0:
        return out
    cfg = config or get_fp8_config(num_tokens, num_experts, hidden, inter, device)
    block_m = cfg["BLOCK_M"]
    pdl = pdl_supported(device)
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    w13_scale_inv = w13_scale_inv if w13_scale_inv.stride(2) == 1 else w13_scale_inv.contiguous()
    w2_scale_inv = w2_scale_inv if w2_scale_inv.stride(2) == 1 else w2_scale_inv.contiguous()
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    route_w = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    xq, xs = token_group_quant(x)
    sorted_ids, block_expert, npost = moe_align(ids, num_experts, block_m)
    num_blocks = block_expert.numel()
    rows = num_blocks * block_m
    groups_i = triton.cdiv(inter, GROUP)
    hq = torch.empty(rows, inter, dtype=FP8, device=device)
    hs = torch.empty(rows, groups_i, dtype=torch.float32, device=device)
    _gate_up_fp8_kernel[(num_blocks * groups_i,)](
        xq,
        xs,
        w13,
        w13_scale_inv,
        hq,
        hs,
        sorted_ids,
        block_expert,
        npost,
        num_pairs,
        num_blocks,
        inter,
        hidden,
        xq.stride(0),
        xs.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale_inv.stride(0),
        w13_scale_inv.stride(1),
        hq.stride(0),
        hs.stride(0),
        TOP_K=top_k,
        BLOCK_M=block_m,
        BLOCK_N=GROUP,
        BLOCK_K=GROUP,
        GROUP_M=cfg["GROUP_M"],
        MIN_SCALE_AMAX=MIN_AMAX,
        USE_PDL=pdl,
        num_warps=cfg["num_warps"],
        num_stages=cfg["stages"],
        launch_pdl=pdl,
    )
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=device)
    block_n2 = cfg["BLOCK_N2"]
    _down_fp8_kernel[(num_blocks * triton.cdiv(hidden, block_n2),)](
        hq,
        hs,
        w2,
        w2_scale_inv,
        y,
        route_w,
        sorted_ids,
        block_expert,
        npost,
        num_pairs,
        num_blocks,
        hidden,
        inter,
        hq.stride(0),
        hs.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale_inv.stride(0),
        w2_scale_inv.stride(1),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n2,
        BLOCK_K=GROUP,
        SCALE_N=GROUP,
        GROUP_M=cfg["GROUP_M"],
        USE_PDL=pdl,
        num_warps=cfg["num_warps"],
        num_stages=cfg["stages"],
        launch_pdl=pdl,
    )
    sum_topk(y, ids, out, pdl)
    return out
