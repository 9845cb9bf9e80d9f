"""Dense linears of decode-sized batches: the library GEMM (`F.linear`) against `skinny_linear`
at its default plan and at every candidate plan, on the Qwen3-30B-A3B attention shapes.

Method: one CUDA graph of 48 calls per variant, each call with its own weight (as the 48 layers
of a step: 1 GB of weights, so L2 carries nothing between calls), replayed --reps times; time
per call = replay time / 48 (median). Floor = weight bytes / the read ceiling measured at start.
Every variant's output is checked against `F.linear` in float32.

    python3 kernels/bench_linear.py [--rows 1,4,8,16] [--sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safeserve.kernels import linear as lin  # noqa: E402

SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096)}
LAYERS = 48


def read_ceiling_gbs() -> float:
    """GB/s of a 4 GiB bf16 sum (the engine bench's ceiling method)."""
    buf = torch.ones(2 << 30, dtype=torch.bfloat16, device="cuda")
    buf.sum()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        buf.sum()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    nbytes = buf.numel() * 2
    del buf
    return nbytes / min(times) / 1e9


def per_call_us(fn, xs, ws, reps: int) -> float:
    for x, w in zip(xs, ws, strict=True):  # compile and allocate outside the capture
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w in zip(xs, ws, strict=True):
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(xs))
    return statistics.median(times)


def rel_err(fn, n: int, k: int, rows: int) -> float:
    x = torch.randn(rows, k, device="cuda")
    w = torch.randn(n, k, device="cuda") / k**0.5
    ref = F.linear(x.double(), w.double())
    got = fn(x.bfloat16(), w.bfloat16()).double()
    return ((got - ref).norm() / ref.norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="also time every candidate plan")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    ceiling = read_ceiling_gbs()
    print(f"read ceiling {ceiling:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    candidates = []
    if ns.sweep:
        for bn, bk, split, stages in itertools.product(
            (32, 64, 128), (128, 256), (1, 2, 4, 8, 16), (3, 4)
        ):
            candidates.append((bn, bk, split, stages))
        # one tile per program (its weight read before the dependent launch's wait)
        for bn, bk in itertools.product((16, 32, 64, 128), (128, 256, 512)):
            candidates.append((bn, bk, -bk, 1))
    results = []
    for name, (n, k) in SHAPES.items():
        ws = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(LAYERS)
        ]
        floor_us = n * k * 2 / (ceiling * 1e9) * 1e6
        for rows in [int(r) for r in ns.rows.split(",")]:
            xs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
            row = {"shape": name, "n": n, "k": k, "rows": rows, "floor_us": floor_us}
            row["library_us"] = per_call_us(lambda x, w: F.linear(x, w), xs, ws, ns.reps)
            row["default_plan"] = list(lin.skinny_plan(n, k, lin._sm_count(xs[0].device)))
            row["default_us"] = per_call_us(lin.skinny_linear, xs, ws, ns.reps)
            row["default_rel_err"] = rel_err(lin.skinny_linear, n, k, rows)
            best = None
            for bn, bk, split, stages in candidates if rows in (1, 8) else []:
                if split < 0:  # one tile per program: split = K / tile
                    split = k // -split
                elif split > 1 and k // split < bk:
                    continue

                def fn(x, w, p=(bn, bk, split), s=stages):
                    return lin.skinny_linear(x, w, plan=p, num_stages=s)

                us = per_call_us(fn, xs, ws, ns.reps)
                if best is None or us < best["us"]:
                    best = {"plan": [bn, bk, split], "stages": stages, "us": us}
            if best is not None:
                p, s = tuple(best["plan"]), best["stages"]
                best["rel_err"] = rel_err(
                    lambda x, w, p=p, s=s: lin.skinny_linear(x, w, plan=p, num_stages=s), n, k, rows
                )
                row["best"] = best
            results.append(row)
            line = (
                f"{name:7s} rows {rows:2d}: floor {floor_us:5.2f} us, library "
                f"{row['library_us']:5.2f}, skinny {row['default_us']:5.2f} "
                f"{tuple(row['default_plan'])} (err {row['default_rel_err']:.1e})"
            )
            if best is not None:
                line += f", best {best['us']:5.2f} {tuple(best['plan'])} stages {best['stages']}"
            print(line, flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"ceiling_gbs": ceiling, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
