"""Router + top-k at decode sizes: the library GEMM followed by the top-k kernel (two launches)
against `router_topk` (one launch, per --warps), as GPU kernel time per call from a
torch.profiler trace (a graph replay of a few-µs call mostly times the replay itself).

    python3 kernels/bench_router_topk.py [--tokens 1,4,16,64,256] [--warps 1,2,4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safeserve.kernels import router_topk as rt  # noqa: E402
from safeserve.kernels import topk_softmax as tk  # noqa: E402


def kernel_us(fn, reps: int) -> float:
    """Mean GPU kernel time of one call of fn (all its kernels), from a profiler trace."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = sum(
        ev.time_range.elapsed_us()
        for ev in prof.events()
        if str(getattr(ev, "device_type", "")).endswith("CUDA")
    )
    return total / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,4,16,64,256")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    gate = torch.randn(ns.experts, ns.hidden, device=dev, dtype=dt) / ns.hidden**0.5
    emap = torch.randperm(ns.experts, device=dev)
    rows = []
    for t in [int(v) for v in ns.tokens.split(",")]:
        x = torch.randn(t, ns.hidden, device=dev, dtype=dt)
        row = {"tokens": t, "gemm_then_topk_us": kernel_us(
            lambda x=x: tk.fused_topk_softmax(F.linear(x, gate), ns.top_k, True, dt, emap),
            ns.reps,
        )}  # fmt: skip
        want = tk.fused_topk_softmax(F.linear(x, gate), ns.top_k, True, dt, emap)[1]
        for w in [int(v) for v in ns.warps.split(",")]:
            row[f"router_topk_w{w}_us"] = kernel_us(
                lambda x=x, w=w: rt.router_topk(x, gate, ns.top_k, True, dt, emap, num_warps=w),
                ns.reps,
            )
            got = rt.router_topk(x, gate, ns.top_k, True, dt, emap, num_warps=w)[1]
            row[f"ids_agree_w{w}"] = float(
                (got.sort(dim=1).values == want.sort(dim=1).values).float().mean()
            )
        rows.append(row)
        print(
            f"T={t:4d} " + "  ".join(
                f"{k.removesuffix('_us')} {v:6.2f} us" for k, v in row.items() if k.endswith("_us")
            ) + f"  ids agree {min(v for k, v in row.items() if k.startswith('ids')):.3f}",
            flush=True,
        )  # fmt: skip
    if ns.json:
        meta = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
        Path(ns.json).write_text(json.dumps({"meta": meta, "rows": rows, "args": vars(ns)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
