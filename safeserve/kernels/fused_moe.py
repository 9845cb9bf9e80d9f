"""Fused mixture-of-experts kernels (Triton), with torch reference paths.

`fused_moe` computes, for every token, the routing-weighted sum over its valid top-k slots of
`down(silu(gate(x)) * up(x))`, where gate/up rows live stacked in `w13` and down in `w2`.

Two launch plans, picked per token count by the tuned config (`"mode"`):

* ``sorted`` (the general plan): an align kernel sorts the (token, slot) pairs by expert and pads
  each expert's segment to ``BLOCK_M`` rows; a grouped GEMM runs gate and up for one tile of
  rows of one expert, applies SiLU-and-mul and the routing weight in its epilogue and writes the
  intermediate; a second grouped GEMM runs down and writes one row per pair; a last kernel sums
  the ``k`` rows of each token (skipping slots with id -1).
* ``pair`` (decode, a handful of tokens): no sort at all. Each (token, slot) pair is its own
  row tile for gate/up, and the down kernel loops over the ``k`` slots of one token inside one
  program, so the top-k sum happens in registers. Two launches in all. ``"split": n`` in
  ``gemm2`` shares a token's slots among n programs (n times as many programs stream a decode
  step's down weights); each writes a float32 partial and the last one of a tile sums them in a
  fixed order. Optional ``"pdl": true`` launches the down kernel as a programmatic dependent of
  gate/up and has it prefetch its weights into L2 first; measured slower on an H200
  (kernels/RESULTS.md), so no shipped config uses it.

``"interleave": true`` in ``gemm1`` (both plans) loads gate and up columns alternately into one
B tile, so one dot of twice the width computes both (one accumulator, wider tensor-core
instructions); the epilogue splits it.

Every grid depends only on the shapes (never on the routing), so a whole call can be captured in
a CUDA graph. Tile configs are data: ``configs/E{E}_H{H}_I{I}_{device}.json`` maps a token
count to a config, looked up by the nearest token count; `default_config` covers the rest.

Triton is optional: without it (or on CPU tensors, unless ``TRITON_INTERPRET=1``) every entry
point runs its torch reference.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

try:  # Triton is an optional dependency: CI and CPU-only installs run the torch references.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is missing
    triton = None
    tl = None

HAS_TRITON = triton is not None

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

Config = dict[str, Any]

# Shared memory the pipelined tiles may take: H100/H200 allow 227 KiB per program, and Triton
# keeps up to num_stages tiles of A and B there (num_stages - 1 on the mma.sync path).
_SMEM_BUDGET = 220 * 1024


# ---------------------------------------------------------------------------------------------
# Pure-python helpers (no Triton needed): sizes, configs, torch references.
# ---------------------------------------------------------------------------------------------


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def max_padded_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the number of BLOCK_M row tiles after padding each expert's segment.

    Only experts that received a pair get padded, and at most min(E, pairs) of them exist, so the
    bound (which sizes every grid and buffer) depends on shapes alone: CUDA-graph safe.
    """
    if num_pairs <= 0:
        return 0
    nonempty = min(num_experts, num_pairs)
    return (num_pairs + nonempty * (block_m - 1)) // block_m


def moe_align_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for the align kernels (identical outputs).

    Returns ``sorted_ids`` [max_blocks*block_m] (pair index t*k+s, or the sentinel
    num_pairs on padding rows), ``block_expert`` [max_blocks] (expert of each row tile, -1 past
    the used tiles) and ``num_post_padded`` [1] (rows in use). Pairs keep their order within an
    expert (stable); slots with id -1 are dropped.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    device = flat.device
    num_pairs = flat.numel()
    max_blocks = max_padded_blocks(num_pairs, num_experts, block_m)
    valid = flat >= 0
    counts = torch.bincount(flat[valid], minlength=num_experts)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    cum_end = torch.cumsum(padded, 0)
    starts = cum_end - padded
    total = padded.sum()
    sorted_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    keys = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(keys, stable=True)[: int(valid.sum())]
    experts = flat[order]
    seg_first = torch.cumsum(counts, 0) - counts  # first sorted index of each expert
    rank = torch.arange(order.numel(), device=device) - seg_first[experts]
    sorted_ids[starts[experts] + rank] = order.to(torch.int32)
    rows = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(cum_end, rows, right=True)
    block_expert = torch.where(rows < total, block_expert, torch.full_like(block_expert, -1))
    return sorted_ids, block_expert.to(torch.int32), total.reshape(1).to(torch.int32)


def topk_softmax_torch(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `fused_topk_softmax`: float32 weights, int32 ids."""
    from safeserve.moe.topk import softmax_topk

    weights, ids = softmax_topk(router_logits, top_k, renormalize, torch.float32)
    return weights, ids.to(torch.int32)


def default_config(num_tokens: int, num_experts: int, top_k: int) -> Config:
    """Heuristic config for shapes nobody tuned: by mean rows per expert."""
    pairs = max(1, num_tokens * top_k)
    per_expert = pairs / max(1, num_experts)
    if num_tokens <= 4:
        return {
            "mode": "pair",
            "BLOCK_M": 16,
            "gemm1": _kcfg(32, 256, 1, 4, 4),
            "gemm2": _kcfg(32, 256, 1, 4, 4),
        }
    if per_expert <= 16:
        bm, g1, g2 = 16, _kcfg(64, 128, 1, 4, 4), _kcfg(64, 128, 1, 4, 4)
    elif per_expert <= 48:
        bm, g1, g2 = 32, _kcfg(64, 128, 8, 4, 4), _kcfg(64, 128, 8, 4, 4)
    elif per_expert <= 160:
        bm, g1, g2 = 64, _kcfg(64, 64, 8, 4, 4), _kcfg(128, 64, 8, 4, 4)
    else:
        bm, g1, g2 = 128, _kcfg(128, 64, 8, 8, 3), _kcfg(128, 64, 8, 8, 3)
    return {"mode": "sorted", "BLOCK_M": bm, "gemm1": g1, "gemm2": g2}


def _kcfg(block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int) -> Config:
    return {
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "GROUP_M": group_m,
        "num_warps": num_warps,
        "num_stages": num_stages,
    }


def config_file_name(num_experts: int, hidden: int, inter: int, device_name: str) -> str:
    """Name of the tuned-config file for one layer shape on one device."""
    dev = "".join(c if c.isalnum() else "_" for c in device_name)
    return f"E{num_experts}_H{hidden}_I{inter}_{dev}.json"


@functools.lru_cache(maxsize=64)
def load_config_table(path: str) -> dict[int, Config] | None:
    """Token count -> config, from one JSON file (None when the file does not exist)."""
    p = Path(path)
    if not p.is_file():
        return None
    data = json.loads(p.read_text())
    table = data.get("configs", data)
    return {int(k): v for k, v in table.items()}


def nearest_config(table: dict[int, Config], num_tokens: int) -> Config:
    """The entry whose token count is nearest (ties go to the smaller count)."""
    best = min(table, key=lambda k: (abs(k - num_tokens), k))
    return table[best]


def get_config(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    device_name: str | None = None,
    config_dir: Path | str | None = None,
) -> Config:
    """Tuned config for this shape/device, nearest by token count; else `default_config`."""
    if device_name is None:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    directory = Path(config_dir) if config_dir is not None else CONFIG_DIR
    env_file = os.environ.get("SAFESERVE_FUSED_MOE_CONFIG")
    path = (
        Path(env_file)
        if env_file
        else directory / config_file_name(num_experts, hidden, inter, device_name)
    )
    table = load_config_table(str(path))
    if not table:
        return default_config(num_tokens, num_experts, top_k)
    return nearest_config(table, num_tokens)


# Plans with one row per (token, slot) pair and no sort; valid for top_k <= 64.
_PAIR_MODES = ("pair",)


def fit_config(cfg: Config, elem_size: int, top_k: int) -> Config:
    """Shrink a config so its pipelined tiles fit in shared memory for this element size.

    Configs are tuned for 2-byte types; float32 inputs double every tile. The pair plan is only
    valid for top_k <= 64 (the down kernel holds the k ids of a token in registers).
    """
    out = {**cfg, "gemm1": dict(cfg["gemm1"]), "gemm2": dict(cfg["gemm2"])}
    if out["mode"] in _PAIR_MODES and top_k > 64:
        out["mode"] = "sorted"
    bm = 16 if out["mode"] in _PAIR_MODES else int(out["BLOCK_M"])
    out["BLOCK_M"] = bm
    out["pdl"] = bool(cfg.get("pdl", False)) and out["mode"] == "pair" and _pdl_supported()
    for name, n_b in (("gemm1", 2), ("gemm2", 1)):
        k = out[name]
        while True:
            per_stage = (bm * k["BLOCK_K"] + n_b * k["BLOCK_K"] * k["BLOCK_N"]) * elem_size
            if per_stage * k["num_stages"] <= _SMEM_BUDGET:
                break
            if k["num_stages"] > 2:
                k["num_stages"] -= 1
            elif k["BLOCK_K"] > 32:
                k["BLOCK_K"] //= 2
            else:
                break
    return out


@functools.lru_cache(maxsize=1)
def _pdl_supported() -> bool:
    """Programmatic dependent launch: Hopper or newer, and not under the interpreter."""
    if not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _use_triton(t: torch.Tensor) -> bool:
    if not HAS_TRITON:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------
# Triton kernels.
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _expert_layout(counts, BLOCK_M: tl.constexpr):
        """Per expert: first padded row, end of its real rows, end of its padded rows; total."""
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        cum_end = tl.cumsum(padded, axis=0)
        starts = cum_end - padded
        return starts, cum_end, tl.sum(padded, axis=0)

    @triton.jit
    def _fill_block_experts(
        block_expert_ptr, cum_end, total, max_blocks, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr
    ):
        """Expert of each row tile: the number of experts whose padded segment ends at or before it."""
        for b0 in range(0, max_blocks, BLOCK_R):
            b = b0 + tl.arange(0, BLOCK_R)
            row = b * BLOCK_M
            e = tl.sum((cum_end[None, :] <= row[:, None]).to(tl.int32), axis=1)
            e = tl.where(row < total, e, -1)
            tl.store(block_expert_ptr + b, e, mask=b < max_blocks)

    @triton.jit
    def _fill_sentinel(sorted_ptr, r_lo, r_hi, num_pairs, BLOCK: tl.constexpr):
        for r0 in range(r_lo, r_hi, BLOCK):
            r = r0 + tl.arange(0, BLOCK)
            tl.store(sorted_ptr + r, tl.zeros([BLOCK], dtype=tl.int32) + num_pairs, mask=r < r_hi)

    @triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
    def _align_single_kernel(
        ids_ptr,
        sorted_ptr,
        block_expert_ptr,
        npost_ptr,
        scratch_ptr,
        num_pairs,
        max_blocks,
        BLOCK_M: tl.constexpr,
        E_PAD: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        """Whole align in one program (small batches).

        scratch: [E_PAD] counts, [E_PAD] segment starts, [num_pairs] rank of each pair within its
        expert (from the atomic counter; the order within an expert does not matter).
        """
        e = tl.arange(0, E_PAD)
        counts_ptr = scratch_ptr
        starts_ptr = scratch_ptr + E_PAD
        rank_ptr = scratch_ptr + 2 * E_PAD
        tl.store(counts_ptr + e, tl.zeros([E_PAD], dtype=tl.int32))
        _fill_sentinel(sorted_ptr, 0, max_blocks * BLOCK_M, num_pairs, 1024)
        tl.debug_barrier()
        for lo in range(0, num_pairs, CHUNK):
            offs = lo + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
            ok = ids >= 0
            rank = tl.atomic_add(counts_ptr + ids, 1, mask=ok, sem="relaxed")
            tl.store(rank_ptr + offs, rank, mask=ok)
        tl.debug_barrier()
        counts = tl.load(counts_ptr + e, cache_modifier=".cg")
        starts, cum_end, total = _expert_layout(counts, BLOCK_M)
        tl.store(npost_ptr, total)
        tl.store(starts_ptr + e, starts)
        _fill_block_experts(block_expert_ptr, cum_end, total, max_blocks, BLOCK_M, BLOCK_R)
        tl.debug_barrier()
        for lo in range(0, num_pairs, CHUNK):
            offs = lo + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
            ok = ids >= 0
            rank = tl.load(rank_ptr + offs, mask=ok, other=0, cache_modifier=".cg")
            start = tl.load(starts_ptr + ids, mask=ok, other=0, cache_modifier=".cg")
            tl.store(sorted_ptr + start + rank, offs.to(tl.int32), mask=ok)

    @triton.jit(do_not_specialize=["num_pairs", "rows_per_prog", "num_rows"])
    def _align_count_kernel(
        ids_ptr,
        scratch_ptr,
        sorted_ptr,
        num_pairs,
        rows_per_prog,
        num_rows,
        E_PAD: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """Rank of each pair within its expert (atomic counter, zeroed before) + sentinel rows."""
        c = tl.program_id(0)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        ok = ids >= 0
        rank = tl.atomic_add(scratch_ptr + ids, 1, mask=ok, sem="relaxed")
        tl.store(scratch_ptr + 2 * E_PAD + offs, rank, mask=ok)
        r_lo = c * rows_per_prog
        _fill_sentinel(
            sorted_ptr, r_lo, tl.minimum(r_lo + rows_per_prog, num_rows), num_pairs, 1024
        )

    @triton.jit(do_not_specialize=["max_blocks"])
    def _align_plan_kernel(
        scratch_ptr,
        block_expert_ptr,
        npost_ptr,
        max_blocks,
        BLOCK_M: tl.constexpr,
        E_PAD: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        e = tl.arange(0, E_PAD)
        counts = tl.load(scratch_ptr + e)
        starts, cum_end, total = _expert_layout(counts, BLOCK_M)
        tl.store(npost_ptr, total)
        tl.store(scratch_ptr + E_PAD + e, starts)
        _fill_block_experts(block_expert_ptr, cum_end, total, max_blocks, BLOCK_M, BLOCK_R)

    @triton.jit(do_not_specialize=["num_pairs"])
    def _align_scatter_kernel(
        ids_ptr, scratch_ptr, sorted_ptr, num_pairs, E_PAD: tl.constexpr, CHUNK: tl.constexpr
    ):
        c = tl.program_id(0)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        ok = ids >= 0
        rank = tl.load(scratch_ptr + 2 * E_PAD + offs, mask=ok, other=0)
        start = tl.load(scratch_ptr + E_PAD + ids, mask=ok, other=0)
        tl.store(sorted_ptr + start + rank, offs.to(tl.int32), mask=ok)

    @triton.jit
    def _mainloop(
        a_ptrs,
        b_ptrs,
        row_ok,
        acc,
        K,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """acc += A[rows, :K] @ B[:K, cols] for tiles whose K runs along unit strides of both."""
        offs_k = tl.arange(0, BLOCK_K)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        return acc

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
    def _gate_up_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        topk_w_ptr,
        ids_ptr,
        sorted_ptr,
        block_expert_ptr,
        npost_ptr,
        num_pairs,
        num_blocks_m,
        N,
        K,
        stride_xt,
        stride_we,
        stride_wn,
        stride_om,
        TOP_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        PAIR_MODE: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
        INTERLEAVE: tl.constexpr,
    ):
        """out[row, n] = w_pair * silu(x @ gate[e].T) * (x @ up[e].T) for one row tile of one expert.

        N is the intermediate size I; w rows [0, N) are gate, [N, 2N) are up. With INTERLEAVE
        the B tile holds gate and up columns alternately, so one dot of width 2*BLOCK_N does both
        (wider tensor-core instructions, one accumulator) and the epilogue splits it.
        """
        if USE_PDL:
            # let the down kernel start now: it prefetches its weights while this one streams
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        if PAIR_MODE:
            # The pair index varies fastest: programs that share an expert tile run together.
            pid_m = pid % num_blocks_m
            pid_n = pid // num_blocks_m
        else:
            group = GROUP_M * num_pid_n
            first_m = (pid // group) * GROUP_M
            group_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
            pid_m = first_m + (pid % group) % group_m
            pid_n = (pid % group) // group_m
        offs_r = tl.arange(0, BLOCK_M)
        if PAIR_MODE:
            expert = tl.load(ids_ptr + pid_m).to(tl.int32)
            if expert < 0:
                return
            pair = pid_m + offs_r * 0
            row_ok = offs_r == 0
            out_rows = pair
        else:
            if pid_m * BLOCK_M >= tl.load(npost_ptr):
                return
            expert = tl.load(block_expert_ptr + pid_m)
            out_rows = pid_m * BLOCK_M + offs_r
            pair = tl.load(sorted_ptr + out_rows)
            row_ok = pair < num_pairs
        w_e = w_ptr + expert.to(tl.int64) * stride_we
        token = (pair // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_nw = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
        if INTERLEAVE:
            # column 2j is gate row n_j, column 2j+1 is up row n_j (= row N + n_j of w13)
            offs_c = tl.arange(0, 2 * BLOCK_N)
            w_rows = (pid_n * BLOCK_N + offs_c // 2) % N + (offs_c % 2) * N
            b_ptrs = w_e + w_rows[None, :] * stride_wn + offs_k[:, None]
            acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
            acc = _mainloop(a_ptrs, b_ptrs, row_ok, acc, K, BLOCK_K, EVEN_K, DOT_PRECISION)
            acc_g, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        else:
            g_ptrs = w_e + offs_nw[None, :] * stride_wn + offs_k[:, None]
            u_ptrs = g_ptrs + N * stride_wn
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kk in range(0, tl.cdiv(K, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                    bg = tl.load(g_ptrs)
                    bu = tl.load(u_ptrs)
                else:
                    k_ok = offs_k < K - kk * BLOCK_K
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    bg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
                    bu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
                acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
                g_ptrs += BLOCK_K
                u_ptrs += BLOCK_K
        route_w = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u * route_w[:, None]
        o_ptrs = out_ptr + out_rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(
            o_ptrs, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N)
        )

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
    def _down_sorted_kernel(
        a_ptr,
        w_ptr,
        y_ptr,
        sorted_ptr,
        block_expert_ptr,
        npost_ptr,
        num_pairs,
        num_blocks_m,
        N,
        K,
        stride_am,
        stride_we,
        stride_wn,
        stride_ym,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """y[pair, n] = a[row] @ down[e].T for one row tile of one expert (N = hidden, K = I)."""
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_pid_n
        first_m = (pid // group) * GROUP_M
        group_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % group_m
        pid_n = (pid % group) // group_m
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows)
        row_ok = pair < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_nw = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        b_ptrs = (
            w_ptr + expert.to(tl.int64) * stride_we + offs_nw[None, :] * stride_wn + offs_k[:, None]
        )
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc = _mainloop(a_ptrs, b_ptrs, row_ok, acc, K, BLOCK_K, EVEN_K, DOT_PRECISION)
        y_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(
            y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N)
        )

    @triton.jit
    def _prefetch_l2(ptrs):
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [ptrs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit(do_not_specialize=["num_tokens"])
    def _down_pair_kernel(
        a_ptr,
        w_ptr,
        out_ptr,
        ids_ptr,
        part_ptr,
        sync_ptr,
        num_tokens,
        N,
        K,
        stride_am,
        stride_we,
        stride_wn,
        stride_ot,
        TOP_K: tl.constexpr,
        K_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
        K_LINES: tl.constexpr,
        LINE_ELEMS: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """out[t, n] = sum over valid slots s of a[t*k+s] @ down[e_s].T (a is pre-weighted).

        With SPLIT > 1 the k slots of a token are shared by SPLIT programs (more programs stream
        a decode step's weights): each stores its float32 partial in part [T, SPLIT, N] and bumps
        the tile's counter in sync; the last to arrive sums the partials in a fixed order (the
        result does not depend on arrival order), writes out and zeroes the counter again.

        With USE_PDL this kernel is launched while the gate/up kernel still runs: it first asks
        L2 for its weight slices (they do not depend on that kernel), then waits for it.
        """
        pid = tl.program_id(0)
        group = pid % SPLIT
        pid_t = (pid // SPLIT) % num_tokens
        pid_n = pid // (SPLIT * num_tokens)
        slots = tl.arange(0, K_PAD)
        slot_ids = tl.load(ids_ptr + pid_t * TOP_K + slots, mask=slots < TOP_K, other=-1).to(
            tl.int32
        )
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if USE_PDL:
            # one L2 prefetch per 128-byte line of each valid slot's [BLOCK_N, K] weight slice
            line_k = tl.minimum(tl.arange(0, K_LINES) * LINE_ELEMS, K - 1)
            for j in tl.static_range(TOP_K):
                e = tl.sum(tl.where(slots == j, slot_ids, 0), axis=0)
                if e >= 0:
                    pf = w_ptr + e.to(tl.int64) * stride_we + (offs_n % N)[:, None] * stride_wn
                    _prefetch_l2(pf + line_k[None, :])
            tl.extra.cuda.gdc_wait()
        slots_per: tl.constexpr = (TOP_K + SPLIT - 1) // SPLIT
        s_lo = group * slots_per
        offs_r = tl.arange(0, BLOCK_M)
        row0 = offs_r == 0
        offs_nw = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        num_k = tl.cdiv(K, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for it in range(0, slots_per * num_k):
            s = s_lo + it // num_k
            k0 = (it % num_k) * BLOCK_K
            expert = tl.sum(tl.where(slots == s, slot_ids + 1, 0), axis=0) - 1  # -1 past TOP_K
            ok = expert >= 0
            pair = (pid_t * TOP_K + s).to(tl.int64)
            a_ptrs = a_ptr + pair * stride_am + (k0 + offs_k)[None, :] + offs_r[:, None] * 0
            b_ptrs = (
                w_ptr
                + tl.maximum(expert, 0).to(tl.int64) * stride_we
                + offs_nw[None, :] * stride_wn
                + (k0 + offs_k)[:, None]
            )
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row0[:, None] & ok, other=0.0)
                b = tl.load(b_ptrs, mask=ok, other=0.0)
            else:
                k_ok = (k0 + offs_k) < K
                a = tl.load(a_ptrs, mask=row0[:, None] & k_ok[None, :] & ok, other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & ok, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        res = tl.sum(tl.where(row0[:, None], acc, 0.0), axis=0)
        o_ptrs = out_ptr + pid_t.to(tl.int64) * stride_ot + offs_n
        if SPLIT == 1:
            tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=n_ok)
        else:
            parts = part_ptr + (pid_t * SPLIT).to(tl.int64) * N + offs_n
            tl.store(parts + group * N, res, mask=n_ok)
            tl.debug_barrier()  # every thread's partial is issued before the release
            counter = sync_ptr + pid_t * tl.cdiv(N, BLOCK_N) + pid_n
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1:
                tl.debug_barrier()
                total = tl.zeros([BLOCK_N], dtype=tl.float32)
                for j in tl.static_range(SPLIT):
                    total += tl.load(parts + j * N, mask=n_ok, other=0.0, cache_modifier=".cg")
                tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=n_ok)
                tl.atomic_xchg(counter, 0)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _sum_topk_kernel(
        y_ptr,
        ids_ptr,
        out_ptr,
        num_tokens,
        N,
        stride_ym,
        stride_ot,
        TOP_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """out[t] = sum over slots s with id >= 0 of y[t*k+s] (float32 accumulation)."""
        pid_t = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(TOP_K):
            pair = pid_t.to(tl.int64) * TOP_K + s
            ok = tl.load(ids_ptr + pair) >= 0
            v = tl.load(y_ptr + pair * stride_ym + offs_n, mask=n_ok & ok, other=0.0)
            acc += v.to(tl.float32)
        tl.store(
            out_ptr + pid_t.to(tl.int64) * stride_ot + offs_n,
            acc.to(out_ptr.dtype.element_ty),
            mask=n_ok,
        )

    @triton.jit(do_not_specialize=["num_tokens"])
    def _topk_softmax_kernel(
        logits_ptr,
        w_ptr,
        ids_ptr,
        map_ptr,
        num_tokens,
        num_experts,
        stride_lt,
        TOP_K: tl.constexpr,
        K_PAD: tl.constexpr,
        E_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        HAS_MAP: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, E_PAD)
        row_ok = rows < num_tokens
        col_ok = cols < num_experts
        x = tl.load(
            logits_ptr + rows[:, None].to(tl.int64) * stride_lt + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=-float("inf"),
        ).to(tl.float32)
        x_max = tl.max(x, axis=1)
        p = tl.exp(x - x_max[:, None])
        p = tl.where(col_ok[None, :], p, 0.0)
        p = p / tl.sum(p, axis=1)[:, None]
        p = tl.where(col_ok[None, :], p, -2.0)  # never picked before a real expert
        kcols = tl.arange(0, K_PAD)
        top_w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
        top_i = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
        for i in tl.static_range(TOP_K):
            best = tl.argmax(p, axis=1, tie_break_left=True).to(tl.int32)
            val = tl.max(p, axis=1)
            top_w = tl.where(kcols[None, :] == i, val[:, None], top_w)
            top_i = tl.where(kcols[None, :] == i, best[:, None], top_i)
            p = tl.where(cols[None, :] == best[:, None], -1.0, p)
        if RENORMALIZE:
            top_w = top_w / tl.sum(top_w, axis=1)[:, None]
        offs = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
        mask = row_ok[:, None] & (kcols[None, :] < TOP_K)
        if HAS_MAP:  # logical -> physical expert id
            top_i = tl.load(map_ptr + top_i, mask=mask, other=0)
        tl.store(w_ptr + offs, top_w.to(w_ptr.dtype.element_ty), mask=mask)
        tl.store(ids_ptr + offs, top_i.to(ids_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers.
# ---------------------------------------------------------------------------------------------

# Pairs per loop step / program of the align kernels, and pairs up to which one program does it all.
_ALIGN_CHUNK = 1024
_ALIGN_SINGLE_MAX_PAIRS = 2048


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert, padded per expert to block_m.

    Same outputs as `moe_align_torch`, except that the order of the pairs within one expert's
    segment is whatever the atomic counters gave (it does not change any result).
    """
    if not _use_triton(topk_ids):
        return moe_align_torch(topk_ids, num_experts, block_m)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    device = ids.device
    num_pairs = ids.numel()
    max_blocks = max_padded_blocks(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    npost = torch.empty(1, dtype=torch.int32, device=device)
    if num_pairs == 0:
        npost.zero_()
        return sorted_ids, block_expert, npost
    e_pad = next_power_of_2(num_experts)
    block_r = max(16, min(256, 8192 // e_pad))
    if num_pairs <= _ALIGN_SINGLE_MAX_PAIRS:
        scratch = torch.empty(2 * e_pad + num_pairs, dtype=torch.int32, device=device)
        _align_single_kernel[(1,)](
            ids,
            sorted_ids,
            block_expert,
            npost,
            scratch,
            num_pairs,
            max_blocks,
            BLOCK_M=block_m,
            E_PAD=e_pad,
            CHUNK=min(_ALIGN_CHUNK, max(16, next_power_of_2(num_pairs))),
            BLOCK_R=block_r,
            num_warps=8,
        )
        return sorted_ids, block_expert, npost
    scratch = torch.zeros(2 * e_pad + num_pairs, dtype=torch.int32, device=device)
    num_chunks = triton.cdiv(num_pairs, _ALIGN_CHUNK)
    num_rows = max_blocks * block_m
    _align_count_kernel[(num_chunks,)](
        ids,
        scratch,
        sorted_ids,
        num_pairs,
        triton.cdiv(num_rows, num_chunks),
        num_rows,
        E_PAD=e_pad,
        CHUNK=_ALIGN_CHUNK,
        num_warps=4,
    )
    _align_plan_kernel[(1,)](
        scratch,
        block_expert,
        npost,
        max_blocks,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        BLOCK_R=block_r,
        num_warps=8,
    )
    _align_scatter_kernel[(num_chunks,)](
        ids, scratch, sorted_ids, num_pairs, E_PAD=e_pad, CHUNK=_ALIGN_CHUNK, num_warps=4
    )
    return sorted_ids, block_expert, npost


def _check_inputs(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    t, h = hidden_states.shape
    e, two_i, h13 = w13.shape
    if h13 != h or two_i % 2 or w2.shape != (e, h, two_i // 2):
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden_states.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [{t}, k]"
        )


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: Config | None = None,
) -> torch.Tensor:
    """[T, H] = sum over valid slots of w * down(silu(gate(x)) * up(x)).

    hidden_states [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I];
    topk_weights [T, k] (hidden dtype or float32); topk_ids [T, k] local expert ids, -1 = skip.
    No host synchronisation: safe to capture in a CUDA graph. `config` overrides the lookup.
    """
    _check_inputs(hidden_states, w13, w2, topk_weights, topk_ids)
    if not _use_triton(hidden_states):
        from safeserve.moe.runner import grouped_experts_torch

        return grouped_experts_torch(hidden_states, w13, w2, topk_ids, topk_weights)
    call = MoeLaunch(hidden_states, w13, w2, topk_weights, topk_ids, config)
    if call.num_pairs == 0:
        return call.out.zero_()
    call.align()
    call.gate_up()
    call.down()
    return call.out


# Zeroed int32 counters of the split down projection (its last program of a tile sets the tile's
# counter back to zero), one buffer per (device, stream): launches on one stream run one after
# another, so they can share it. Graphs captured on one stream and replayed concurrently on
# several streams would not; the engine replays on one stream per process.
_SPLIT_COUNTERS: dict[tuple[str, int, int], torch.Tensor] = {}


def _split_counters(device: torch.device, words: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index or 0, stream)
    buf = _SPLIT_COUNTERS.get(key)
    if buf is None or buf.numel() < words:
        buf = torch.zeros(max(1024, words), dtype=torch.int32, device=device)
        _SPLIT_COUNTERS[key] = buf
    return buf


class MoeLaunch:
    """One `fused_moe` call split into its launches (align, gate/up, down, top-k sum).

    `fused_moe` runs them in order; kernels/bench_fused_moe.py times them one by one.
    """

    def __init__(
        self,
        hidden_states: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        config: Config | None = None,
    ) -> None:
        # The kernels take unit strides on the last dim as given (so their loads vectorise).
        self.x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
        self.w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
        self.w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
        self.num_tokens, self.hidden = hidden_states.shape
        self.num_experts, two_i, _ = w13.shape
        self.inter = two_i // 2
        self.top_k = topk_ids.shape[1]
        self.num_pairs = self.num_tokens * self.top_k
        self.dtype, self.device = hidden_states.dtype, hidden_states.device
        self.out = torch.empty(self.num_tokens, self.hidden, dtype=self.dtype, device=self.device)
        if config is None:
            config = get_config(
                self.num_tokens, self.num_experts, self.hidden, self.inter, self.top_k
            )
        self.cfg = fit_config(config, hidden_states.element_size(), self.top_k)
        self.ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        self.route_w = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
        self.pair_mode = self.cfg["mode"] in _PAIR_MODES
        # float32 runs are correctness runs (checked against transformers to 1e-4): no tf32 there.
        self.dot_precision = "ieee" if self.dtype == torch.float32 else "tf32"
        self.sorted_ids = self.block_expert = self.npost = self.ids  # unused by the pair plan
        self.num_blocks = self.num_pairs
        self.cache: torch.Tensor | None = None
        self.y: torch.Tensor | None = None

    def align(self) -> None:
        """Sort the pairs by expert (sorted plan) and size the intermediate buffer."""
        if self.pair_mode:
            rows = self.num_pairs
        else:
            self.sorted_ids, self.block_expert, self.npost = moe_align(
                self.ids, self.num_experts, self.cfg["BLOCK_M"]
            )
            self.num_blocks = self.block_expert.numel()
            rows = self.num_blocks * self.cfg["BLOCK_M"]
            self.y = torch.empty(self.num_pairs, self.hidden, dtype=self.dtype, device=self.device)
        self.cache = torch.empty(rows, self.inter, dtype=self.dtype, device=self.device)

    def gate_up(self) -> None:
        g1, cache = self.cfg["gemm1"], self.cache
        assert cache is not None, "align() first"
        grid = (self.num_blocks * triton.cdiv(self.inter, g1["BLOCK_N"]),)
        _gate_up_kernel[grid](
            self.x,
            self.w13,
            cache,
            self.route_w,
            self.ids,
            self.sorted_ids,
            self.block_expert,
            self.npost,
            self.num_pairs,
            self.num_blocks,
            self.inter,
            self.hidden,
            self.x.stride(0),
            self.w13.stride(0),
            self.w13.stride(1),
            cache.stride(0),
            TOP_K=self.top_k,
            BLOCK_M=self.cfg["BLOCK_M"],
            BLOCK_N=g1["BLOCK_N"],
            BLOCK_K=g1["BLOCK_K"],
            GROUP_M=g1.get("GROUP_M", 1),
            PAIR_MODE=self.pair_mode,
            EVEN_K=self.hidden % g1["BLOCK_K"] == 0,
            DOT_PRECISION=self.dot_precision,
            USE_PDL=self.cfg["pdl"],
            INTERLEAVE=bool(g1.get("interleave", False)),
            num_warps=g1["num_warps"],
            num_stages=g1["num_stages"],
        )

    def down(self) -> None:
        """The down projection, and the top-k sum (in registers for the pair plan)."""
        if self.pair_mode:
            self._down_pair()
        else:
            self.down_sorted()
            self.sum_topk()

    def _down_pair(self) -> None:
        g2, cache, w2, out = self.cfg["gemm2"], self.cache, self.w2, self.out
        assert cache is not None, "align() first"
        split = max(1, min(int(g2.get("split", 1)), self.top_k))
        tiles_n = triton.cdiv(self.hidden, g2["BLOCK_N"])
        if split > 1:
            part = torch.empty(self.num_tokens, split, self.hidden, device=self.device)
            counters = _split_counters(self.device, self.num_tokens * tiles_n)
        else:
            part = counters = out  # not read
        _down_pair_kernel[(self.num_tokens * tiles_n * split,)](
            cache,
            w2,
            out,
            self.ids,
            part,
            counters,
            self.num_tokens,
            self.hidden,
            self.inter,
            cache.stride(0),
            w2.stride(0),
            w2.stride(1),
            out.stride(0),
            TOP_K=self.top_k,
            K_PAD=next_power_of_2(self.top_k),
            BLOCK_M=self.cfg["BLOCK_M"],
            BLOCK_N=g2["BLOCK_N"],
            BLOCK_K=g2["BLOCK_K"],
            EVEN_K=self.inter % g2["BLOCK_K"] == 0,
            DOT_PRECISION=self.dot_precision,
            USE_PDL=self.cfg["pdl"],
            K_LINES=next_power_of_2(triton.cdiv(self.inter * w2.element_size(), 128)),
            LINE_ELEMS=128 // w2.element_size(),
            SPLIT=split,
            num_warps=g2["num_warps"],
            num_stages=g2["num_stages"],
            launch_pdl=self.cfg["pdl"],
        )

    def down_sorted(self) -> None:
        g2, cache, w2, y = self.cfg["gemm2"], self.cache, self.w2, self.y
        assert cache is not None and y is not None, "align() first"
        grid = (self.num_blocks * triton.cdiv(self.hidden, g2["BLOCK_N"]),)
        _down_sorted_kernel[grid](
            cache,
            w2,
            y,
            self.sorted_ids,
            self.block_expert,
            self.npost,
            self.num_pairs,
            self.num_blocks,
            self.hidden,
            self.inter,
            cache.stride(0),
            w2.stride(0),
            w2.stride(1),
            y.stride(0),
            BLOCK_M=self.cfg["BLOCK_M"],
            BLOCK_N=g2["BLOCK_N"],
            BLOCK_K=g2["BLOCK_K"],
            GROUP_M=g2.get("GROUP_M", 1),
            EVEN_K=self.inter % g2["BLOCK_K"] == 0,
            DOT_PRECISION=self.dot_precision,
            num_warps=g2["num_warps"],
            num_stages=g2["num_stages"],
        )

    def sum_topk(self) -> None:
        y, out = self.y, self.out
        assert y is not None, "align() first"
        block_n = min(1024, next_power_of_2(self.hidden))
        _sum_topk_kernel[(self.num_tokens, triton.cdiv(self.hidden, block_n))](
            y,
            self.ids,
            out,
            self.num_tokens,
            self.hidden,
            y.stride(0),
            out.stride(0),
            TOP_K=self.top_k,
            BLOCK_N=block_n,
            num_warps=4,
        )


def fused_topk_softmax(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype = torch.float32,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, top k, optional renormalisation, in one kernel.

    Returns (weights [T, k] in `weights_dtype`, ids [T, k]): ids int32, or, with `expert_map`
    ([E] int64, logical -> physical), the mapped ids as int64, mapped inside the same kernel.
    Reference: `topk_softmax_torch`.
    """
    if not _use_triton(router_logits):
        weights, ids = topk_softmax_torch(router_logits, top_k, renormalize)
        if expert_map is not None:
            ids = expert_map[ids.to(torch.int64)]
        return weights.to(weights_dtype), ids
    num_tokens, num_experts = router_logits.shape
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} > {num_experts} experts")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    device = logits.device
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=device)
    ids_dtype = torch.int32 if expert_map is None else expert_map.dtype
    ids = torch.empty(num_tokens, top_k, dtype=ids_dtype, device=device)
    if num_tokens == 0:
        return weights, ids
    e_pad = next_power_of_2(num_experts)
    block_t = max(1, min(16, 2048 // e_pad, next_power_of_2(num_tokens)))
    _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits,
        weights,
        ids,
        expert_map if expert_map is not None else ids,
        num_tokens,
        num_experts,
        logits.stride(0),
        TOP_K=top_k,
        K_PAD=next_power_of_2(top_k),
        E_PAD=e_pad,
        BLOCK_T=block_t,
        RENORMALIZE=renormalize,
        HAS_MAP=expert_map is not None,
        # A decode step's few rows fit one warp: its reductions then need no shared memory.
        num_warps=1 if e_pad * block_t <= 256 else (4 if e_pad * block_t <= 2048 else 8),
    )
    return weights, ids
