"""Micro-benchmark of the block-FP8 linear (`safeserve.kernels.fp8_linear`, W8A8) at decode and
prefill row counts on one GPU, timed as CUDA-graph replays (several weights of each shape in
rotation, so that L2 carries no weight between replays), against the bf16 linear on the same
shape (`kernels.linear`: the skinny split-K kernel up to 8 rows, the library GEMM above) and the
FP8 floor (weight + scale bytes over the HBM read ceiling). Each FP8 row count is timed on the
path the launcher picks and, for comparison, on the tiled kernel (`default_config`) and the
split-K kernel with other K slices.

Default shapes: Qwen3-30B-A3B's q, k (= v) and o_proj.

    python3 kernels/bench_fp8_linear.py [--rows 1,8,64] [--json out.json]
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

from moe_bench_harness import DEVICE, graph_times_us  # noqa: E402

from safeserve.kernels import fp8_linear as fl  # noqa: E402
from safeserve.kernels.common import shared_memory_per_program  # noqa: E402
from safeserve.kernels.fp8_reference import block_quantize, fp8_linear  # noqa: E402
from safeserve.kernels.linear import linear  # noqa: E402

HBM_READ_BW = 4.24e12  # bytes/s, measured H200 read ceiling (kernels/RESULTS.md)
SHAPES = {"q_proj": (4096, 2048), "k_proj": (512, 2048), "o_proj": (2048, 4096)}
ROTATIONS = 8


def _fp8_call(x: torch.Tensor, n: int, variant: Any):  # type: ignore[no-untyped-def]
    """(w, scale_inv) -> x @ w.T on one path: None the launcher's pick, a dict the tiled
    kernel with that config, ("skinny", kb) the split-K kernel with kb K blocks a program."""
    if isinstance(variant, tuple):

        def skinny(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            o = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
            fl._skinny(x, w, s, None, o, None, variant[1])
            return o

        return skinny
    return lambda w, s: fl.fp8_linear_w8a8(x, w, s, None, config=variant)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,4,8,16,32,64,128,512")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json")
    ns = p.parse_args(argv)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    out: list[dict[str, Any]] = []
    for name, (n, k) in SHAPES.items():
        bf = [
            torch.randn(n, k, device=DEVICE, generator=gen).bfloat16() * 0.02
            for _ in range(ROTATIONS)
        ]
        q = [block_quantize(w) for w in bf]
        floor_us = (n * k + 4 * len(q[0][1].flatten())) / HBM_READ_BW * 1e6
        for m in [int(r) for r in ns.rows.split(",")]:
            x = torch.randn(m, k, device=DEVICE, generator=gen).bfloat16()
            variants: dict[str, Any] = {"launcher": None}
            tiled = fl.default_config(m, shared_memory_per_program(x.device))
            variants["tiled"] = tiled
            if m <= fl.SKINNY_MAX_ROWS:
                for kb in (1, 2, 4):
                    variants[f"split_kb{kb}"] = ("skinny", kb)
            row: dict[str, Any] = {"shape": name, "n": n, "k": k, "rows": m, "floor_us": floor_us}
            want = fp8_linear(x.float(), q[0][0], q[0][1], quantize_input=True)
            for label, v in variants.items():
                call = _fp8_call(x, n, v)
                got = call(*q[0]).float()
                err = float((got - want).norm() / want.norm())
                us = statistics.median(
                    graph_times_us([(lambda w=w, s=s, c=call: c(w, s)) for w, s in q], ns.reps)
                )
                row[f"{label}_us"] = us
                row[f"{label}_err"] = err
            row["bf16_us"] = statistics.median(
                graph_times_us([(lambda w=w, x=x: linear(x, w)) for w in bf], ns.reps)
            )
            out.append(row)
            cols = " ".join(f"{lb} {row[f'{lb}_us']:6.1f}" for lb in variants)
            print(
                f"{name:7s} rows {m:4d}: floor {floor_us:5.1f} us | fp8 {cols} | bf16 "
                f"{row['bf16_us']:6.1f} | launcher/floor {row['launcher_us'] / floor_us:.2f} "
                f"err {row['launcher_err']:.1e}",
                flush=True,
            )
    if ns.json:
        meta = {
            "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv),
        }
        Path(ns.json).write_text(json.dumps({"meta": meta, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
