"""Time a hand-picked list of `fused_moe` configs at given token counts, exactly as
kernels/bench_fused_moe.py times the shipped configs, and write a config table with each swept
token count's entry replaced by the fastest candidate that matches the torch reference.

    python3 kernels/sweep_fused_moe.py --tokens 1 --candidates kernels/configs/sweep_t1.json \
        [--base table.json] --out $OUT/best.json --json $OUT/sweep.json

Candidates: a JSON list of whole configs (as in the config tables). --base defaults to the
shipped table of this device; the current entry of each token count is always a candidate too.
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

from safeserve.kernels import moe_config as mc  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--candidates", required=True)
    ap.add_argument("--base", default=None, help="config table (default: the shipped one)")
    ap.add_argument("--rotations", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    e, h, i, k = 128, 2048, 768, 8
    w13, w2 = make_weights(e, h, i, torch.bfloat16)
    path = (
        Path(ns.base)
        if ns.base
        else mc.CONFIG_DIR / mc.config_file_name(e, h, i, torch.cuda.get_device_name())
    )
    table = json.loads(path.read_text())
    cands = json.loads(Path(ns.candidates).read_text())
    rows = []
    for t in [int(x) for x in ns.tokens.split(",")]:
        current = mc.nearest_config({int(kk): v for kk, v in table["configs"].items()}, t)
        results = []
        for cfg in [current, *cands]:
            cfg = {kk: v for kk, v in cfg.items() if kk != "tuned_us"}
            try:
                row = bench_one(t, w13, w2, k, cfg, ns.rotations, ns.reps)
            except Exception as exc:  # noqa: BLE001 - a candidate that does not compile
                print(f"T={t:3d} {_short(cfg):60s} failed: {type(exc).__name__}", flush=True)
                continue
            ok = row["rel_err"] <= 1e-2
            results.append(row)
            rows.append(row)
            print(
                f"T={t:3d} {_short(cfg):60s} {json.dumps(cfg.get('gemm2', {}).get('split', 1))} "
                f"{row['median_us']:7.1f} us (p10 {row['p10_us']:.1f}) share "
                f"{row['floor_share'] * 100:5.1f} % err {row['rel_err']:.1e}"
                + ("" if ok else " WRONG"),
                flush=True,
            )
        best = min((r for r in results if r["rel_err"] <= 1e-2), key=lambda r: r["median_us"])
        table["configs"][str(t)] = {**best["config"], "tuned_us": round(best["median_us"], 2)}
        print(f"T={t}: best {_short(best['config'])} {best['median_us']:.1f} us", flush=True)
    Path(ns.out).write_text(json.dumps(table, indent=1))
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
