"""The fused MoE (`safeserve.kernels.fused_moe`): its CPU fallback; the Triton kernels on a GPU
(or, on CPU, in Triton's interpreter when TRITON_INTERPRET=1) against the torch reference. The
align, top-k and tile-config tests are in test_moe_align, test_topk_softmax and test_moe_config."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from counters import assert_counters_zero
from seeds import seeded

from safeserve.kernels import fused_moe as fm
from safeserve.kernels import moe_config as mc
from safeserve.kernels import topk_softmax as tk
from safeserve.kernels.moe_reference import grouped_experts_torch

HAS_CUDA = torch.cuda.is_available() and fm.HAS_TRITON
INTERPRET = fm.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and Triton")
interp = pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")


def _routing(
    num_tokens: int, num_experts: int, top_k: int, drop: float, gen: torch.Generator, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if drop > 0:
        ids[torch.rand(num_tokens, top_k, generator=gen) < drop] = -1
    return weights.to(device), ids.to(device)


def _problem(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    drop: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    gen = seeded(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    w13, w2 = _weights(num_experts, hidden, inter, dtype, device)
    weights, ids = _routing(num_tokens, num_experts, top_k, drop, gen, device)
    return x, w13, w2, weights, ids


# Expert weights are drawn once per shape and session (fresh every run, from this seed): the
# 128-expert ones take seconds to draw, and every plan is checked on the same ones. Inputs and
# routing stay per test.
WEIGHT_SEED = int(torch.randint(0, 2**31 - 1, (1,)))


@functools.lru_cache(maxsize=2)
def _weights(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = seeded(WEIGHT_SEED + 7919 * num_experts + 31 * hidden + inter)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """The runner's torch path on float32 upcasts of the same inputs."""
    return grouped_experts_torch(x.float(), w13.float(), w2.float(), ids, weights.float())


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# CPU: pure python (no Triton needed)
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRET or torch.cuda.is_available(), reason="checks the CPU fallback")
def test_cpu_fallback_matches_reference() -> None:
    x, w13, w2, weights, ids = _problem(5, 6, 32, 16, 2, torch.float32, "cpu", seed=1, drop=0.2)
    out = fm.fused_moe(x, w13, w2, weights, ids)
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < 1e-5
    w, i = tk.fused_topk_softmax(torch.randn(7, 10), 3, True)
    assert w.dtype == torch.float32 and i.dtype == torch.int32 and i.shape == (7, 3)


# ---------------------------------------------------------------------------------------------
# Triton interpreter on CPU (TRITON_INTERPRET=1): small shapes, float32/float16
# ---------------------------------------------------------------------------------------------


def _forced(mode: str, block_m: int) -> mc.Config:
    """mode: "pair", "chunk" or "sorted", then "+i" for the interleaved gate/up tile, "+sN" for
    the down projection's slots shared by N programs (pair plan) and "+e" for evict-first weight
    loads. The chunk plan: 16-row tiles of intermediate rows, down tiles 16 columns wide, and
    "+cN" for slices of N rows."""
    name, *opts = mode.split("+")
    split = next((int(o[1:]) for o in opts if o.startswith("s")), 1)
    chunk_slice = next((int(o[1:]) for o in opts if o.startswith("c")), 16)
    evict = "e" in opts  # weight loads evict-first
    return {
        "mode": name,
        "BLOCK_M": block_m,
        "gemm1": {
            **mc.kcfg(16, 32, 2, 4, 2),
            "interleave": "i" in opts,
            "evict_first": evict,
            "slice": chunk_slice,
        },
        "gemm2": {**mc.kcfg(16, 32, 2, 4, 2), "split": split, "evict_first": evict},
    }


@interp
@pytest.mark.parametrize(
    "tokens,experts,hidden,inter,top_k,mode,block_m,drop",
    [
        (1, 8, 64, 32, 2, "pair", 16, 0.0),
        (3, 10, 64, 48, 3, "pair", 16, 0.3),
        (3, 10, 64, 40, 3, "pair+i", 16, 0.3),  # I not a multiple of BLOCK_N
        (3, 10, 64, 40, 3, "pair+s2", 16, 0.3),  # k = 3 slots over 2 programs
        (2, 10, 64, 48, 4, "pair+s4", 16, 0.0),
        (2, 10, 64, 48, 4, "pair+i+s2+e", 16, 0.2),
        (1, 10, 64, 48, 8, "pair+s3", 16, 0.5),
        (1, 8, 64, 32, 2, "chunk", 16, 0.0),
        (3, 10, 40, 40, 3, "chunk+e", 16, 0.3),  # I, H and K not multiples of their tiles
        (2, 10, 64, 48, 8, "chunk", 16, 0.5),
        (2, 10, 64, 40, 3, "chunk+c12", 16, 0.2),  # slices of 12 rows in 16-row tiles
        (5, 10, 64, 48, 3, "sorted", 16, 0.3),
        (40, 7, 48, 40, 2, "sorted", 32, 0.0),
        (40, 7, 48, 40, 2, "sorted+i", 32, 0.0),
        (40, 7, 48, 40, 2, "sorted+e", 32, 0.0),
        (700, 12, 32, 32, 3, "sorted", 16, 0.2),  # > 2048 pairs: the multi-program align
    ],
)
def test_interpreter_fused_moe(tokens, experts, hidden, inter, top_k, mode, block_m, drop) -> None:
    x, w13, w2, weights, ids = _problem(
        tokens, experts, hidden, inter, top_k, torch.float32, "cpu", seed=tokens, drop=drop
    )
    out = fm.fused_moe(x, w13, w2, weights, ids.to(torch.int32), config=_forced(mode, block_m))
    assert _rel_err(out, _reference(x, w13, w2, weights, ids)) < 1e-4


@interp
def test_interpreter_split_down_resets_its_counters() -> None:
    """The split down projection counts arrivals per tile and zeroes the counter when done."""
    x, w13, w2, weights, ids = _problem(2, 6, 32, 32, 3, torch.float32, "cpu", seed=4)
    ref = _reference(x, w13, w2, weights, ids)
    for split in (2, 3, 2):
        out = fm.fused_moe(
            x, w13, w2, weights, ids.to(torch.int32), config=_forced(f"pair+s{split}", 16)
        )
        assert _rel_err(out, ref) < 1e-4
        assert_counters_zero()


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

GPU_CASES = [
    # tokens, experts, hidden, inter, top_k, dtype, drop
    (1, 128, 2048, 768, 8, torch.bfloat16, 0.0),
    (1, 60, 256, 96, 4, torch.bfloat16, 0.5),
    (7, 60, 512, 160, 6, torch.bfloat16, 0.3),  # E not a multiple of any tile
    (33, 37, 320, 200, 2, torch.float16, 0.25),  # K not a multiple of BLOCK_K
    (256, 128, 2048, 768, 8, torch.bfloat16, 0.0),
    (300, 16, 256, 128, 4, torch.float32, 0.1),
    (1000, 72, 1024, 384, 8, torch.bfloat16, 0.4),
    (4096, 128, 2048, 768, 8, torch.bfloat16, 0.0),
]


def _pdl_wait_config(experts: int, top_k: int) -> mc.Config:
    """Pair plan, down kernel a dependent launch that only waits, split over 4 programs, weight
    loads evict-first."""
    config = mc.default_config(1, experts, top_k)
    g1 = {**config["gemm1"], "evict_first": True}
    g2 = {**config["gemm2"], "split": 4, "evict_first": True}
    return {**config, "pdl": "wait", "gemm1": g1, "gemm2": g2}


def _chunk_config(block_i: int, block_h: int = 256, chunk_slice: int | None = None) -> mc.Config:
    """The chunk plan: tiles of block_i intermediate rows (slices of chunk_slice of them), down
    tiles block_h columns wide."""
    return {
        "mode": "chunk",
        "BLOCK_M": 16,
        "gemm1": {
            **mc.kcfg(block_i, 128, 1, 4, 4),
            "interleave": True,
            "slice": chunk_slice or block_i,
        },
        "gemm2": mc.kcfg(block_h, 128, 1, 4, 1),
    }


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-H{c[2]}-I{c[3]}")
@pytest.mark.parametrize(
    "mode",
    [
        "auto",
        "pair",
        "pair_pdl",
        "pair_i",
        "pair_split3",
        "pair_split8",
        "pair_pdl_wait",
        "chunk16",
        "chunk32",
        "chunk64/48",
        "sorted16",
        "sorted64",
        "sorted64_i",
        "sorted128_i",
    ],
)
def test_gpu_fused_moe_matches_reference(case, mode: str) -> None:
    tokens, experts, hidden, inter, top_k, dtype, drop = case
    if mode.startswith(("pair", "chunk")) and tokens > 300:
        pytest.skip("the pair and chunk plans are for a few tokens")
    seed = int(torch.randint(0, 2**31 - 1, (1,)))  # fresh inputs every run
    x, w13, w2, weights, ids = _problem(
        tokens, experts, hidden, inter, top_k, dtype, "cuda", seed, drop
    )
    if mode == "auto":
        config = None
    elif mode.startswith("pair_split"):
        config = mc.default_config(1, experts, top_k)
        split = int(mode.removeprefix("pair_split"))
        config = {**config, "gemm2": {**config["gemm2"], "split": split}}
    elif mode == "pair_pdl_wait":
        config = _pdl_wait_config(experts, top_k)
    elif mode.startswith("chunk"):
        block_i, _, chunk_slice = mode.removeprefix("chunk").partition("/")
        config = _chunk_config(int(block_i), chunk_slice=int(chunk_slice or block_i))
    elif mode.startswith("pair"):
        config = {**mc.default_config(1, experts, top_k), "pdl": mode == "pair_pdl"}
    else:
        bm = int(mode.removeprefix("sorted").removesuffix("_i"))
        config = mc.default_config(max(1, bm * experts // top_k), experts, top_k)
        config = {**config, "mode": "sorted", "BLOCK_M": bm}
    if mode.endswith("_i"):  # gate and up as one interleaved dot
        config = {**config, "gemm1": {**config["gemm1"], "interleave": True}}
    ref = _reference(x, w13, w2, weights, ids)
    for ids_dtype, w_dtype in ((torch.int32, torch.float32), (torch.int64, dtype)):
        out = fm.fused_moe(x, w13, w2, weights.to(w_dtype), ids.to(ids_dtype), config=config)
        torch.cuda.synchronize()
        assert out.shape == x.shape and out.dtype == dtype
        assert not torch.isnan(out).any()
        err = _rel_err(out, ref)
        assert err <= 1e-2, f"rel err {err:.2e} (seed {seed}, weight seed {WEIGHT_SEED})"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shared_kib", [163, 99], ids=["A100", "L40S"])
@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 300, 1100])
def test_gpu_fused_moe_with_tiles_fitted_to_smaller_devices(
    monkeypatch, shared_kib, tokens
) -> None:  # type: ignore[no-untyped-def]
    """On a device with less shared memory than an H200 (an A100: 163 KiB; an L40S or RTX 4090:
    99 KiB) the launcher shrinks the tiles; the shipped H200 entry and the heuristic config, so
    shrunk, still give the reference's output (run here on the H200, which fits both)."""
    if any(n in torch.cuda.get_device_name() for n in ("H100", "H200")):  # the tuned budget
        real = fm.shared_memory_per_program(torch.device("cuda"))
        assert real == 227 * 1024 and mc.smem_budget(real) == mc.SMEM_BUDGET
    monkeypatch.setattr(fm, "shared_memory_per_program", lambda device: shared_kib * 1024)
    experts, hidden, inter, top_k, dtype = 128, 2048, 768, 8, torch.bfloat16
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    x, w13, w2, weights, ids = _problem(tokens, experts, hidden, inter, top_k, dtype, "cuda", seed)
    table = mc.load_config_table(
        str(mc.CONFIG_DIR / mc.config_file_name(experts, hidden, inter, "NVIDIA H200"))
    )
    ref = _reference(x, w13, w2, weights, ids)
    shrunk = 0
    for config in (mc.nearest_config(table, tokens), mc.default_config(tokens, experts, top_k)):
        launch = fm.MoeLaunch(x, w13, w2, weights, ids, config)
        shrunk += launch.cfg["gemm1"] != config["gemm1"] or launch.cfg["gemm2"] != config["gemm2"]
        out = fm.fused_moe(x, w13, w2, weights, ids, config=config)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()
        err = _rel_err(out, ref)
        assert err <= 1e-2, f"rel err {err:.2e} (seed {seed}, weight seed {WEIGHT_SEED})"
    if shared_kib == 99:
        assert shrunk, "at 99 KiB at least one of the two configs must have been shrunk"


@pytest.mark.gpu
@needs_cuda
def test_gpu_all_slots_dropped_gives_zeros() -> None:
    x, w13, w2, weights, ids = _problem(9, 16, 256, 64, 4, torch.bfloat16, "cuda", 3)
    ids = torch.full_like(ids, -1)
    for config in (None, mc.default_config(1, 16, 4), mc.default_config(4096, 16, 4)):
        out = fm.fused_moe(x, w13, w2, weights, ids, config=config)
        assert torch.count_nonzero(out) == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "tokens,plan",
    [
        (1, "auto"),
        (1, "pair_pdl"),
        (4, "pair_pdl"),
        (1, "pair_split4"),
        (2, "pair_split8"),
        (1, "pair_pdl_wait"),
        (3, "pair_pdl_wait"),
        (1, "chunk16"),
        (2, "chunk32"),
        (1, "chunk64/48"),
        (16, "auto"),
        (4096, "auto"),
    ],
)
def test_gpu_cuda_graph_replay(tokens: int, plan: str) -> None:
    """Captured once, replayed on new routing and inputs: no host sync, shape-only grids."""
    x, w13, w2, weights, ids = _problem(tokens, 128, 2048, 768, 8, torch.bfloat16, "cuda", 5)
    static = [x.clone(), weights.clone(), ids.to(torch.int32)]
    config = None
    if plan == "pair_pdl":
        config = {**mc.default_config(1, 128, 8), "pdl": True}
    elif plan == "pair_pdl_wait":
        config = _pdl_wait_config(128, 8)
    elif plan.startswith("chunk"):
        block_i, _, chunk_slice = plan.removeprefix("chunk").partition("/")
        config = _chunk_config(int(block_i), chunk_slice=int(chunk_slice or block_i))
    elif plan.startswith("pair_split"):
        config = mc.default_config(1, 128, 8)
        split = int(plan.removeprefix("pair_split"))
        config = {**config, "gemm2": {**config["gemm2"], "split": split}}
    fm.fused_moe(x, w13, w2, weights, ids, config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(static[0], w13, w2, static[1], static[2], config=config)
    x2, _, _, weights2, ids2 = _problem(tokens, 128, 2048, 768, 8, torch.bfloat16, "cuda", 6, 0.2)
    static[0].copy_(x2)
    static[1].copy_(weights2)
    static[2].copy_(ids2.to(torch.int32))
    out.fill_(float("nan"))  # poison: every element must be rewritten
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    ref = _reference(x2, w13, w2, weights2, ids2)
    assert _rel_err(out, ref) <= 1e-2
    if plan.startswith("pair_split") or tokens * 8 > 2048:  # counters back to zero: replay again
        assert_counters_zero()
        out.fill_(float("nan"))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, ref) <= 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_invariant_rows_do_not_depend_on_the_batch(batch_invariant_kernels: None) -> None:
    """Batch-invariant mode (one sorted-plan config for every token count): each token's output
    is the same bits alone and among 2 to 300 others, at other positions, and near the
    reference."""
    x, w13, w2, weights, ids = _problem(300, 128, 2048, 768, 8, torch.bfloat16, "cuda", 9)
    alone = torch.cat(
        [fm.fused_moe(x[i : i + 1], w13, w2, weights[i : i + 1], ids[i : i + 1]) for i in range(20)]
    )
    assert _rel_err(alone, _reference(x[:20], w13, w2, weights[:20], ids[:20])) <= 1e-2
    gen = seeded(1)
    for m in (2, 8, 64, 300):
        order = torch.cat([torch.arange(20), 20 + torch.randperm(280, generator=gen)])[:m]
        order = order[torch.randperm(m, generator=gen)].cuda()
        got = fm.fused_moe(x[order], w13, w2, weights[order], ids[order])
        keep = order < 20
        assert torch.equal(got[keep], alone[order[keep]]), m
