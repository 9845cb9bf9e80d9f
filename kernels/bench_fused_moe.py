"""Micro-benchmark of `safeserve.kernels.fused_moe` on one GPU, timed as CUDA-graph replays.

Default shapes: one Qwen3-30B-A3B MoE layer (E=128, top-8, H=2048, I=768, bf16). For each token
count it captures one graph per routing (several routings, so that consecutive replays read
different experts and L2 cannot carry weights between calls), replays them round-robin, times
every replay with CUDA events and reports the median. The floor is the bytes of the experts the
routing actually selects divided by the HBM read ceiling (4.24 TB/s, measured: kernels/RESULTS.md).

    python3 kernels/bench_fused_moe.py [--tokens 1,8,64] [--configs table.json] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_bench_harness import (  # noqa: E402
    DEVICE,
    graph_times_us,
    make_routings,
    make_weights,
    measure_ceilings,
    reference,
)

from safeserve.kernels import fused_moe as fm  # noqa: E402
from safeserve.kernels import moe_align as ma  # noqa: E402
from safeserve.kernels import moe_config as mc  # noqa: E402

HBM_READ_BW = 4.24e12  # bytes/s, measured H200 read ceiling (kernels/RESULTS.md)
DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def expert_bytes(hidden: int, inter: int, elem: int) -> int:
    return 3 * hidden * inter * elem


def bench_one(
    num_tokens: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    config: mc.Config | None,
    rotations: int,
    reps: int,
    breakdown: bool = False,
    paired_matmul: bool = False,
) -> dict[str, Any]:
    """One token count: median of round-robin graph replays, floor share, error vs float32.

    paired_matmul adds an 8192^3 bf16 matmul graph to the same round robin, so the matrix rate
    the layer is compared with is measured under the same load, clocks and temperature (a short
    burst of matmuls alone, as in `measure_ceilings`, runs at boost clocks that a sustained
    tensor-core load does not keep).
    """
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    routings = make_routings(num_tokens, num_experts, hidden, top_k, w13.dtype, rotations)
    cfg = config or mc.get_config(num_tokens, num_experts, hidden, inter, top_k)
    fns = [(lambda r=r: fm.fused_moe(r[0], w13, w2, r[1], r[2], config=cfg)) for r in routings]
    mm_times: list[float] = []
    if paired_matmul:
        a, b, c = (torch.randn(8192, 8192, device=DEVICE, dtype=w13.dtype) for _ in range(3))
        fns.append(lambda: torch.mm(a, b, out=c))
        every = graph_times_us(fns, reps)
        n = len(fns)
        mm_times = every[n - 1 :: n]
        times = [t for j, t in enumerate(every) if j % n != n - 1]
        del a, b, c
    else:
        times = graph_times_us(fns, reps)
    distinct = [int(torch.unique(r[2]).numel()) for r in routings]
    floor_us = [
        d * expert_bytes(hidden, inter, w13.element_size()) / HBM_READ_BW * 1e6 for d in distinct
    ]
    med = statistics.median(times)
    x, w, ids = routings[0]
    out = fm.fused_moe(x, w13, w2, w, ids, config=cfg).float()
    ref = reference(x, w13, w2, w, ids)
    rel_err = ((out - ref).norm() / ref.norm()).item()
    flops = 2 * num_tokens * top_k * 3 * hidden * inter
    row: dict[str, Any] = {
        "tokens": num_tokens,
        "experts_read": statistics.mean(distinct),
        "floor_us": statistics.mean(floor_us),
        "median_us": med,
        "p10_us": sorted(times)[len(times) // 10],
        "p90_us": sorted(times)[len(times) * 9 // 10],
        "floor_share": statistics.mean(floor_us) / med,
        "TFLOPs": flops / med / 1e6,
        "samples": len(times),
        "rel_err": rel_err,
        "config": cfg,
    }
    if mm_times:
        row["matmul_TFLOPs_paired"] = 2 * 8192**3 / statistics.median(mm_times) / 1e6
        row["matrix_share_paired"] = row["TFLOPs"] / row["matmul_TFLOPs_paired"]
    if cfg["mode"] == "sorted":
        bm = cfg["BLOCK_M"]
        align = [(lambda r=r: ma.moe_align(r[2], num_experts, bm)) for r in routings]
        row["align_us"] = statistics.median(graph_times_us(align, max(4, reps // 4)))
    if breakdown:
        row["stages_us"] = stage_times_us(routings, w13, w2, cfg, max(4, reps // 2))
    return row


def stage_times_us(routings, w13, w2, cfg: mc.Config, reps: int) -> dict[str, float]:
    """Median time of each launch of a call alone (each its own graph, inputs prepared)."""
    calls = []
    for x, w, ids in routings:
        call = fm.MoeLaunch(x, w13, w2, w, ids, cfg)
        call.align()
        call.gate_up()
        call.down()
        calls.append(call)
    stages = {"gate_up": lambda c: c.gate_up()}
    if calls[0].pair_mode:
        stages["down"] = lambda c: c.down()
    else:
        stages["down"] = lambda c: c.down_sorted()
        stages["sum_topk"] = lambda c: c.sum_topk()
    return {
        name: statistics.median(graph_times_us([lambda c=c, fn=fn: fn(c) for c in calls], reps))
        for name, fn in stages.items()
    }


if fm.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _stream_read_kernel(
        w_ptr, ids_ptr, out_ptr, per_expert, stride_e, CHUNK: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Sum one CHUNK of one selected expert's weights (a pure-read roofline)."""
        slot = tl.program_id(0)
        part = tl.program_id(1)
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        base = w_ptr + expert * stride_e + part * CHUNK
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, CHUNK, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            acc += tl.load(base + offs, mask=part * CHUNK + offs < per_expert, other=0.0).to(
                tl.float32
            )
        tl.store(out_ptr + slot * tl.num_programs(1) + part, tl.sum(acc, axis=0))


def read_baseline_us(routings, w13, w2, reps: int) -> dict[str, float]:
    """Best time of a plain Triton read of the routed experts' w13, w2 and both (in sequence):
    what a kernel that only streams these bytes achieves on this card."""
    out: dict[str, float] = {}
    experts = [torch.unique(r[2]).to(torch.int32) for r in routings]
    for chunk in (16384, 65536, 262144):
        for block in (2048, 8192):
            if block > chunk:
                continue

            def read(w: torch.Tensor, e: torch.Tensor, chunk=chunk, block=block) -> None:
                per = w[0].numel()
                parts = triton.cdiv(per, chunk)
                res = torch.empty(e.numel() * parts, device=w.device)
                _stream_read_kernel[(e.numel(), parts)](
                    w, e, res, per, w.stride(0), CHUNK=chunk, BLOCK=block, num_warps=4
                )

            for name, fn in (
                ("w13", lambda e: read(w13, e)),
                ("w2", lambda e: read(w2, e)),
                ("both", lambda e: (read(w13, e), read(w2, e))),
            ):
                t = statistics.median(
                    graph_times_us([lambda e=e, fn=fn: fn(e) for e in experts], reps)
                )
                key = f"read_{name}_us"
                if t < out.get(key, float("inf")):
                    out[key] = t
                    out[f"read_{name}_chunk"] = chunk
    return out


def _short(cfg: mc.Config) -> str:
    g1, g2 = cfg["gemm1"], cfg["gemm2"]

    def k(c: mc.Config) -> str:
        extra = "".join(
            tag
            for tag, on in (
                (" il", c.get("interleave")),
                (f" split{c.get('split')}", int(c.get("split", 1)) > 1),
                (" ef", c.get("evict_first")),
            )
            if on
        )
        return f"{c['BLOCK_N']}x{c['BLOCK_K']}w{c['num_warps']}s{c['num_stages']}{extra}"

    pdl = {True: "+pdl", "wait": "+pdl-wait"}.get(cfg.get("pdl"), "")
    return f"{cfg['mode']}{pdl}/M{cfg['BLOCK_M']} g1 {k(g1)} g2 {k(g2)}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", help="config table JSON (default: the shipped lookup)")
    ap.add_argument("--rotations", type=int, default=8, help="routings replayed round-robin")
    ap.add_argument("--reps", type=int, default=40, help="replays of each routing's graph")
    ap.add_argument("--ceilings", action="store_true", help="also measure HBM and matmul rates")
    ap.add_argument("--breakdown", action="store_true", help="also time each launch alone")
    ap.add_argument(
        "--paired-matmul",
        type=int,
        default=0,
        metavar="TOKENS",
        help="from this token count up, time an 8192^3 matmul in the same replay rotation",
    )
    ap.add_argument(
        "--read-baseline", action="store_true", help="also time a plain read of the same experts"
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    table = mc.load_config_table(args.configs) if args.configs else None
    w13, w2 = make_weights(args.experts, args.hidden, args.inter, dtype)
    meta: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": fm.triton.__version__ if fm.HAS_TRITON else None,
        "date": time.strftime("%Y-%m-%d"),
        "shape": vars(args),
        "hbm_read_ceiling_TBps_assumed": HBM_READ_BW / 1e12,
    }
    if args.ceilings:
        meta["measured"] = measure_ceilings()
        print(f"# measured: {meta['measured']}", flush=True)
    rows = []
    for t in [int(v) for v in args.tokens.split(",")]:
        cfg = mc.nearest_config(table, t) if table else None
        paired = 0 < args.paired_matmul <= t
        row = bench_one(
            t, w13, w2, args.top_k, cfg, args.rotations, args.reps, args.breakdown, paired
        )
        if args.read_baseline:
            routings = make_routings(
                t, args.experts, args.hidden, args.top_k, dtype, args.rotations
            )
            row["read_baseline"] = read_baseline_us(routings, w13, w2, args.reps)
        rows.append(row)
        print(
            f"T={t:5d} experts={row['experts_read']:6.1f} floor={row['floor_us']:7.1f}us "
            f"median={row['median_us']:8.1f}us (p10 {row['p10_us']:.1f}, p90 {row['p90_us']:.1f}) "
            f"share={100 * row['floor_share']:5.1f}% {row['TFLOPs']:6.1f} TFLOP/s "
            f"align={row.get('align_us', 0):5.1f}us err={row['rel_err']:.1e} "
            f"[{_short(row['config'])}]",
            flush=True,
        )
        if "matmul_TFLOPs_paired" in row:
            print(
                f"    paired matmul: {row['matmul_TFLOPs_paired']:.1f} TFLOP/s, this layer "
                f"{100 * row['matrix_share_paired']:.1f} % of it"
            )
        for key in ("stages_us", "read_baseline"):
            if key in row:
                print(f"    {key}: " + json.dumps({k: round(v, 1) for k, v in row[key].items()}))
    print("\n| tokens | experts read | floor µs | median µs | floor share | TFLOP/s | rel err |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['experts_read']:.1f} | {r['floor_us']:.1f} | "
            f"{r['median_us']:.1f} | {100 * r['floor_share']:.1f} % | {r['TFLOPs']:.0f} | "
            f"{r['rel_err']:.1e} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
