"""Decode-size sweep of the pair plan's down projection: dot tile (shipped) vs the fp32-FMA
`gemv` variant at several tiles, timed exactly as kernels/bench_fused_moe.py times the shipped
configs. Writes the shipped table with each swept token count's entry replaced by the fastest
candidate (checked against the torch reference), for SAFESERVE_FUSED_MOE_CONFIG / shipping.

    python3 kernels/sweep_down_gemv.py --tokens 1,2,4 --out $OUT/best.json --json $OUT/sweep.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fused_moe import _short, bench_one, make_weights  # noqa: E402

from safeserve.kernels import fused_moe as fm  # noqa: E402

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the gemv down kernel
GEMV_TILES = [(4, 256, 2, 4), (8, 256, 4, 4), (8, 128, 2, 5), (4, 128, 1, 6), (16, 256, 4, 4)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--rotations", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    e, h, i, k = 128, 2048, 768, 8
    w13, w2 = make_weights(e, h, i, torch.bfloat16)
    path = fm.CONFIG_DIR / fm.config_file_name(e, h, i, torch.cuda.get_device_name())
    shipped = json.loads(path.read_text())
    rows = []
    for t in [int(x) for x in ns.tokens.split(",")]:
        base = fm.get_config(t, e, h, i, k)
        cands = [base]
        for bn, bk, nw, st in GEMV_TILES:
            g2 = {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": nw, "num_stages": st}
            cands.append({**base, "mode": "pair", "gemm2": {**g2, "gemv": True}})
        results = []
        for cfg in cands:
            row = bench_one(t, w13, w2, k, cfg, ns.rotations, ns.reps)
            ok = row["rel_err"] <= 1e-2
            results.append(row)
            rows.append(row)
            gemv = "gemv" if cfg["gemm2"].get("gemv") else "dot "
            print(
                f"T={t:3d} {gemv} {_short(cfg):55s} {row['median_us']:7.1f} us "
                f"share {row['floor_share'] * 100:5.1f} % err {row['rel_err']:.1e}"
                + ("" if ok else " WRONG"),
                flush=True,
            )
        good = [r for r in results if r["rel_err"] <= 1e-2]
        best = min(good, key=lambda r: r["median_us"])
        key = str(t)
        if key in shipped["configs"]:
            cfg = {kk: v for kk, v in best["config"].items() if kk != "pdl"}
            shipped["configs"][key] = {**cfg, "tuned_us": round(best["median_us"], 2)}
        print(f"T={t}: best {_short(best['config'])} {best['median_us']:.1f} us", flush=True)
    Path(ns.out).write_text(json.dumps(shipped, indent=1))
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
