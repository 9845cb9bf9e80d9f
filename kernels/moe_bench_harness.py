"""The fused-MoE benchmark's measurement helpers, shared with kernels/tune_fused_moe.py and
kernels/sweep_fused_moe.py (through kernels/bench_fused_moe.py): expert weights and routings
drawn on the device, per-call device time of CUDA-graph replays, the runner's float32
reference, and the card's HBM read and bf16 matmul rates."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke runs (TRITON_INTERPRET=1)


def make_weights(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE, dtype=dtype, generator=gen)
    w2 = torch.randn(num_experts, hidden, inter, device=DEVICE, dtype=dtype, generator=gen)
    return w13.mul_(hidden**-0.5), w2.mul_(inter**-0.5)


def make_routings(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    top_k: int,
    dtype: torch.dtype,
    count: int,
    seed: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`count` independent (x, weights float32, ids int32) draws, softmax-top-k of random logits."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 7919 * num_tokens)
    out = []
    for _ in range(count):
        x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=dtype, generator=gen)
        logits = torch.randn(num_tokens, num_experts, device=DEVICE, generator=gen)
        w, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        out.append((x, w.contiguous(), ids.to(torch.int32).contiguous()))
    return out


def graph_times_us(fns: list[Callable[[], Any]], reps: int, batch: int = 32) -> list[float]:
    """Per-call device time (µs) of each fn captured as its own CUDA graph, replayed round-robin.

    Before each batch the GPU sleeps so the host can queue the whole batch ahead: every timed
    replay then starts as soon as the previous one ends (no host launch gap inside the events).
    """
    if DEVICE == "cpu":  # smoke run of the harness: host wall clock, no graphs
        out = []
        for _ in range(reps):
            for fn in fns:
                t = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t) * 1e6)
        return out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    total = reps * len(graphs)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(total)
    ]
    for lo in range(0, total, batch):
        torch.cuda._sleep(3_000_000)  # ~1.5 ms head start for the host
        for j in range(lo, min(lo + batch, total)):
            start, end = events[j]
            start.record()
            graphs[j % len(graphs)].replay()
            end.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 for s, e in events]
    del graphs
    return times


_FP32_WEIGHTS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """The runner's torch path in float32 (upcast weights cached per weight tensor)."""
    from safeserve.kernels.moe_reference import grouped_experts_torch

    key = w13.data_ptr()
    if key not in _FP32_WEIGHTS:
        _FP32_WEIGHTS.clear()
        _FP32_WEIGHTS[key] = (w13.float(), w2.float())
    w13f, w2f = _FP32_WEIGHTS[key]
    return grouped_experts_torch(x.float(), w13f, w2f, ids, weights.float())


def measure_ceilings() -> dict[str, float]:
    """HBM read rate (a 4 GiB bf16 sum) and bf16 matmul rate (8192^3), medians of 10."""
    out: dict[str, float] = {}
    x = torch.randn(2 * 1024**3, device=DEVICE, dtype=torch.bfloat16)
    t = _event_median_ms(lambda: x.sum(dtype=torch.float32), 10)
    out["hbm_read_TBps"] = x.numel() * 2 / t / 1e9
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    t = _event_median_ms(lambda: a @ b, 10)
    out["bf16_matmul_TFLOPs"] = 2 * 8192**3 / t / 1e9
    return out


def _event_median_ms(fn: Callable[[], Any], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)
