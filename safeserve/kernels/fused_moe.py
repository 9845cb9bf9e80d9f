"""Fused mixture-of-experts kernels (Triton), with torch reference paths.

`fused_moe` computes, for every token, the routing-weighted sum over its valid top-k slots of
`down(silu(gate(x)) * up(x))`, where gate/up rows live stacked in `w13` and down in `w2`.

Two launch plans, picked per token count by the tuned config (`"mode"`):

* ``sorted`` (the general plan): an align kernel sorts the (token, slot) pairs by expert and pads
  each expert's segment to ``BLOCK_M`` rows; a grouped GEMM runs gate and up for one tile of
  rows of one expert, applies SiLU-and-mul and the routing weight in its epilogue and writes the
  intermediate; a second grouped GEMM runs down and writes one row per pair; a last kernel sums
  the ``k`` rows of each token (skipping slots with id -1).
* ``chunk`` (decode, one or two tokens): no sort, and gate/up and down in one launch. A program
  takes one (token, slot) pair and one slice of ``gemm1.BLOCK_N`` intermediate rows: it runs
  that slice's gate/up rows, SiLU-and-mul and routing weight, then multiplies the result by the
  same slice's columns of down (``gemm2.BLOCK_N`` output columns per tile) and writes a float32
  partial of the token's row. A second small launch sums each token's partials in a fixed order.
  No program waits for another, so the routed weights stream in one launch instead of two.
* ``pair`` (decode, a handful of tokens): no sort at all. Each (token, slot) pair is its own
  row tile for gate/up, and the down kernel loops over the ``k`` slots of one token inside one
  program, so the top-k sum happens in registers. Two launches in all. ``"split": n`` in
  ``gemm2`` shares a token's slots among n programs (n times as many programs stream a decode
  step's down weights); each writes a float32 partial and the last one of a tile sums them in a
  fixed order. ``"pdl": true`` has the down kernel's programs prefetch their weights into L2
  before they wait for gate/up (measured slower on an H200, kernels/RESULTS.md); ``"wait"`` and
  false do not. ``"evict_first": true`` in a GEMM's config marks its weight loads evict-first in
  the caches.

Where the device has programmatic dependent launch (kernels/common.py, `pdl_supported`), every
launch here is a dependent of the one before it: its programs are resident, waiting, when the
previous kernel ends.

``"interleave": true`` in ``gemm1`` (both plans) loads gate and up columns alternately into one
B tile, so one dot of twice the width computes both (one accumulator, wider tensor-core
instructions); the epilogue splits it.

Every grid depends only on the shapes (never on the routing), so a whole call can be captured in
a CUDA graph. Tile configs are data (`safeserve.kernels.moe_config`); the align kernels are in
`safeserve.kernels.moe_align`, the router's top-k in `safeserve.kernels.topk_softmax`.

The kernels themselves are in `safeserve.kernels.fused_moe_kernels`. Triton is optional:
without it (or on CPU tensors, unless ``TRITON_INTERPRET=1``) every entry point runs its torch
reference.
"""

from __future__ import annotations

import torch

from safeserve.kernels.common import (
    HAS_TRITON,
    batch_invariant,
    next_power_of_2,
    pdl_supported,
    shared_memory_per_program,
    triton,
    use_kernels,
    zeroed_counters,
)
from safeserve.kernels.moe_align import moe_align
from safeserve.kernels.moe_config import (
    PAIR_MODES,
    Config,
    fit_config,
    get_config,
    invariant_config,
    smem_budget,
)
from safeserve.kernels.moe_reference import grouped_experts_torch

if HAS_TRITON:
    from safeserve.kernels.fused_moe_chunk_kernels import _chunk_kernel, _chunk_sum_kernel
    from safeserve.kernels.fused_moe_kernels import (
        _down_pair_kernel,
        _down_sorted_kernel,
        _gate_up_kernel,
        _sum_topk_kernel,
    )


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
    if not use_kernels(hidden_states):
        return grouped_experts_torch(hidden_states, w13, w2, topk_ids, topk_weights)
    call = MoeLaunch(hidden_states, w13, w2, topk_weights, topk_ids, config)
    if call.num_pairs == 0:
        return call.out.zero_()
    call.align()
    call.gate_up()
    call.down()
    return call.out


# The chunk plan's sum: each program adds CHUNK_SUM_BLOCK_R partial rows at a time over
# CHUNK_SUM_BLOCK_N output columns (small tiles: at one token the sum reads ~1.5-3 MB of L2 and
# should be spread over many programs).
CHUNK_SUM_BLOCK_R = 32
CHUNK_SUM_BLOCK_N = 32


def _chunk_slice(gemm1: Config) -> int:
    """Intermediate rows per program in the chunk plan: `"slice"`, at most the tile's BLOCK_N."""
    return min(int(gemm1.get("slice", gemm1["BLOCK_N"])), gemm1["BLOCK_N"])


def _evict(gemm: Config) -> str:
    """`"evict_first": true` in a GEMM's config: its weight loads go first out of the caches."""
    return "evict_first" if gemm.get("evict_first") else ""


class MoeLaunch:
    """One `fused_moe` call split into its launches (align, gate/up, down, top-k sum).

    `fused_moe` runs them in order; kernels/bench_fused_moe.py times them one by one. In the
    chunk plan `gate_up` launches the kernel that runs gate/up and down, and `down` the sum of
    the partials.
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
            config = (
                invariant_config(self.num_experts, self.hidden, self.inter, self.top_k)
                if batch_invariant()
                else get_config(
                    self.num_tokens, self.num_experts, self.hidden, self.inter, self.top_k
                )
            )
        budget = smem_budget(shared_memory_per_program(self.device))
        self.cfg = fit_config(config, hidden_states.element_size(), self.top_k, budget)
        self.ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        self.route_w = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
        self.pair_mode = self.cfg["mode"] in PAIR_MODES
        self.chunk_mode = self.cfg["mode"] == "chunk"
        # float32 runs are correctness runs (checked against transformers to 1e-4): no tf32 there.
        self.dot_precision = "ieee" if self.dtype == torch.float32 else "tf32"
        self.pdl = pdl_supported(self.device)  # every launch a programmatic dependent
        self.sorted_ids = self.block_expert = self.npost = self.ids  # unused by the pair plan
        self.num_blocks = self.num_pairs
        self.cache: torch.Tensor | None = None
        self.y: torch.Tensor | None = None

    def align(self) -> None:
        """Sort the pairs by expert (sorted plan) and size the intermediate buffer."""
        if self.chunk_mode:  # float32 partials [slices, pairs, H] instead of an intermediate
            slices = triton.cdiv(self.inter, _chunk_slice(self.cfg["gemm1"]))
            self.cache = torch.empty(
                slices, self.num_pairs, self.hidden, dtype=torch.float32, device=self.device
            )
            return
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
        if self.chunk_mode:
            self._chunk()
            return
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
            USE_PDL=self.pdl,
            INTERLEAVE=bool(g1.get("interleave", False)),
            B_EVICT=_evict(g1),
            num_warps=g1["num_warps"],
            num_stages=g1["num_stages"],
            launch_pdl=self.pdl,
        )

    def down(self) -> None:
        """The down projection, and the top-k sum (in registers for the pair plan)."""
        if self.chunk_mode:
            self._chunk_sum()
        elif self.pair_mode:
            self._down_pair()
        else:
            self.down_sorted()
            self.sum_topk()

    def _chunk(self) -> None:
        g1, g2, part = self.cfg["gemm1"], self.cfg["gemm2"], self.cache
        assert part is not None, "align() first"
        slices, rows = part.shape[0], _chunk_slice(g1)
        _chunk_kernel[(self.num_pairs * slices,)](
            self.x,
            self.w13,
            self.w2,
            self.route_w,
            self.ids,
            part,
            self.num_pairs,
            self.inter,
            self.hidden,
            self.x.stride(0),
            self.w13.stride(0),
            self.w13.stride(1),
            self.w2.stride(0),
            self.w2.stride(1),
            TOP_K=self.top_k,
            BLOCK_M=16,
            BLOCK_I=g1["BLOCK_N"],
            BLOCK_K=g1["BLOCK_K"],
            BLOCK_H=g2["BLOCK_N"],
            SLICE=rows,
            EVEN_K=self.hidden % g1["BLOCK_K"] == 0,
            FULL_SLICES=rows == g1["BLOCK_N"] and self.inter % rows == 0,
            EVEN_H=self.hidden % g2["BLOCK_N"] == 0,
            DOT_PRECISION=self.dot_precision,
            USE_PDL=self.pdl,
            B_EVICT=_evict(g1),
            num_warps=g1["num_warps"],
            num_stages=g1["num_stages"],
            launch_pdl=self.pdl,
        )

    def _chunk_sum(self) -> None:
        part = self.cache
        assert part is not None, "align() first"
        block_n = min(CHUNK_SUM_BLOCK_N, next_power_of_2(self.hidden))
        _chunk_sum_kernel[(self.num_tokens, triton.cdiv(self.hidden, block_n))](
            part,
            self.ids,
            self.out,
            self.num_pairs,
            part.shape[0],
            self.hidden,
            self.out.stride(0),
            TOP_K=self.top_k,
            BLOCK_R=CHUNK_SUM_BLOCK_R,
            BLOCK_N=block_n,
            USE_PDL=self.pdl,
            num_warps=self.cfg["gemm2"]["num_warps"],
            launch_pdl=self.pdl,
        )

    def _down_pair(self) -> None:
        g2, cache, w2, out = self.cfg["gemm2"], self.cache, self.w2, self.out
        assert cache is not None, "align() first"
        split = max(1, min(int(g2.get("split", 1)), self.top_k))
        tiles_n = triton.cdiv(self.hidden, g2["BLOCK_N"])
        if split > 1:
            part = torch.empty(self.num_tokens, split, self.hidden, device=self.device)
            counters = zeroed_counters(self.device, self.num_tokens * tiles_n, "moe_split")
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
            w2.shape[0],
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
            USE_PDL=self.pdl,
            PDL_PREFETCH=self.pdl and self.cfg["pdl_prefetch"],
            K_LINES=next_power_of_2(triton.cdiv(self.inter * w2.element_size(), 128)),
            LINE_ELEMS=128 // w2.element_size(),
            SPLIT=split,
            B_EVICT=_evict(g2),
            num_warps=g2["num_warps"],
            num_stages=g2["num_stages"],
            launch_pdl=self.pdl,
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
            B_EVICT=_evict(g2),
            USE_PDL=self.pdl,
            num_warps=g2["num_warps"],
            num_stages=g2["num_stages"],
            launch_pdl=self.pdl,
        )

    def sum_topk(self) -> None:
        assert self.y is not None, "align() first"
        sum_topk(self.y, self.ids, self.out, self.pdl)


def sum_topk(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, pdl: bool) -> None:
    """out[t] = the sum of y's rows t*k .. t*k+k-1 whose slot id is >= 0 (one row per (token,
    slot) pair; ids [T, k]), accumulated in float32: the sorted plans' last launch."""
    num_tokens, top_k = ids.shape
    hidden = out.shape[1]
    block_n = min(1024, next_power_of_2(hidden))
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        y,
        ids,
        out,
        num_tokens,
        hidden,
        y.stride(0),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_N=block_n,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
