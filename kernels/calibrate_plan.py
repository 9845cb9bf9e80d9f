"""Calibrate `safeserve plan` for a GPU from `safeserve bench` runs, and check its predictions.

    python kernels/calibrate_plan.py --gpu h200 --fit BENCH.json [--log SERVE.log] \
        [--check OTHER.json ...] [--write] [--json OUT.json]

Run it in the repository root (the runs name their models by paths relative to it).

`--fit`: a bench run on one GPU at several batch sizes (1, 2, 4, ..., 64). The fit: a decode
step's time = its reads / (efficiency x the run's read ceiling) + layers x layer_us, least squares
on the relative error over the run's points. `runtime_bytes` (device memory a rank uses beyond its
weights before the KV cache is sized) comes from a KV-sizing log line of the same model on the
same GPU ("free F of T bytes") and the weights the bench run reports. Give a `safeserve serve`
log (`--log`): a bench process does other work first and sizes a few dozen blocks differently,
and the plan predicts what serve allocates.
`--write` puts the result into `safeserve/plan/gpus.toml` as `[<gpu>.calibration]` (for a GPU
planned from another's, in place of its `calibrated_from`).
`--check`: for each run (the fitted one too), the planner's predictions with the same flags
against the measurement: TPOT, KV blocks, experts per layer (uniform routing).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from safeserve.config import ServerArgs
from safeserve.plan.arithmetic import fit_calibration
from safeserve.plan.cli import ITEMSIZE, SIZING_FLAGS, read_config
from safeserve.plan.gpus import Calibration, load_gpu
from safeserve.plan.model import ModelFacts
from safeserve.plan.planner import Candidate, Workload, predict, size_rank

GPUS_TOML = Path(__file__).resolve().parent.parent / "safeserve" / "plan" / "gpus.toml"
FREE = re.compile(r"free (\d+) of (\d+) bytes")


def fit(run: dict, log: str | None, name: str) -> Calibration:
    cfg = read_config(run["args"]["model"])
    points = [(p["step_bytes"], p["tpot_ms"] / 1e3) for p in run["points"]]
    ceiling = run["read_ceiling_gbs"]
    eff, layer_us = fit_calibration(points, cfg.num_hidden_layers, ceiling)
    info = run["model_bytes"]
    runtime = 0
    if log is not None:
        m = FREE.search(Path(log).read_text())
        if m is None:
            raise SystemExit(f"{log}: no KV-sizing line ('free F of T bytes')")
        free, total = int(m.group(1)), int(m.group(2))
        runtime = total - info["weights_bytes"] - free
    source = (
        f"{Path(name).name}: safeserve bench {run['args']['model']} on {run['device']}, "
        f"concurrency {','.join(str(p['concurrency']) for p in run['points'])}"
    )
    if log is not None:
        source += f"; runtime_bytes from {Path(log).name}"
    return Calibration(round(ceiling, 1), round(eff, 4), round(layer_us, 2), runtime, source)


def write_calibration(
    gpu: str, cal: Calibration, memory_bytes: int | None, path: Path = GPUS_TOML
) -> None:
    """Puts `cal` into `path` as `[<gpu>.calibration]`: replacing the GPU's calibration, or, for
    a GPU planned from another's (`calibrated_from`), adding one in place of that line."""
    text = path.read_text()
    block = (
        f"[{gpu}.calibration]\n"
        f"read_ceiling_gbs = {cal.read_ceiling_gbs}\n"
        f"efficiency = {cal.efficiency}\n"
        f"layer_us = {cal.layer_us}\n"
        f"runtime_bytes = {cal.runtime_bytes}\n"
        f"source = {json.dumps(cal.source)}\n"
    )
    pattern = re.compile(rf"\[{re.escape(gpu)}\.calibration\]\n(?:[^\[\n][^\n]*\n)*")
    borrowed = re.compile(
        rf"(\[{re.escape(gpu)}\]\n(?:[^\[\n][^\n]*\n)*?)calibrated_from = [^\n]*\n"
    )
    if pattern.search(text):
        text = pattern.sub(lambda m: block, text, count=1)
    elif borrowed.search(text):
        text = borrowed.sub(lambda m: m.group(1) + "\n" + block, text, count=1)
    else:
        raise SystemExit(
            f"{path}: no [{gpu}] table (with a calibration or calibrated_from) to write into; "
            "add the GPU's table first"
        )
    if memory_bytes:
        section = re.compile(
            rf"(\[{re.escape(gpu)}\]\n(?:[^\[\n][^\n]*\n)*?)memory_bytes = \d[\d_]*"
        )
        text = section.sub(rf"\g<1>memory_bytes = {memory_bytes}", text, count=1)
    path.write_text(text)


def check(run: dict, gpu_name: str, cal: Calibration | None) -> dict:
    """The planner's predictions for the bench run's model, flags and batch sizes."""
    args = run["args"]
    gpu = load_gpu(gpu_name)
    if cal is not None:  # predict with the fit just made (before it is written)
        gpu = type(gpu)(**{**gpu.__dict__, "calibration": cal})
    mem = run["model_bytes"].get("device_memory_bytes")
    if mem:
        gpu = type(gpu)(**{**gpu.__dict__, "memory_bytes": mem})
    cfg = read_config(args["model"])
    facts = ModelFacts(cfg, ITEMSIZE[args["dtype"]])
    sargs = ServerArgs(dtype=args["dtype"], **{k: args[k] for k in SIZING_FLAGS})
    work = Workload([p["concurrency"] for p in run["points"]], run["input_len"], run["output_len"])
    cand = Candidate(1, False, 1)
    rb = facts.rank_bytes(cand.layout())
    sizing = size_rank(facts, cand, gpu, sargs, work, rb)
    # the bench reads each step's KV at its own read ceiling: predict against that run's
    assert gpu.calibration is not None
    run_cal = Calibration(
        run["read_ceiling_gbs"],
        gpu.calibration.efficiency,
        gpu.calibration.layer_us,
        gpu.calibration.runtime_bytes,
        gpu.calibration.source,
    )
    gpu = type(gpu)(**{**gpu.__dict__, "calibration": run_cal})
    points = predict(facts, cand, gpu, work, rb, sizing, 8)
    rows = []
    for got, want in zip(points, run["points"], strict=True):
        rows.append(
            {
                "concurrency": want["concurrency"],
                "tpot_ms_measured": want["tpot_ms"],
                "tpot_ms_predicted": got.tpot_ms,
                "tpot_error": got.tpot_ms / want["tpot_ms"] - 1,
                "experts_per_layer_measured": want["experts_per_layer"],
                "experts_per_layer_predicted": got.experts_per_layer,
                "experts_error": got.experts_per_layer / want["experts_per_layer"] - 1,
                "step_bytes_measured": want["step_bytes"],
                "step_bytes_predicted": got.read_bytes,
            }
        )
    return {
        "model": args["model"],
        "kv_blocks_measured": run["model_bytes"]["num_kv_blocks"],
        "kv_blocks_predicted": sizing.kv_blocks,
        "weights_bytes_measured": run["model_bytes"].get("weights_bytes"),
        "weights_bytes_predicted": sizing.weights_bytes,
        "dispatch_budget_measured": run["model_bytes"].get("dispatch_budget_tokens"),
        "dispatch_budget_predicted": sizing.dispatch_budget,
        "points": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--fit", default=None, help="bench JSON to fit the calibration from")
    ap.add_argument(
        "--log",
        default=None,
        help="a log with the KV-sizing line of a rank loading that model on that GPU: a "
        "`safeserve serve` log, so that the plan sizes what serve allocates (a bench's sizes "
        "a few blocks differently)",
    )
    ap.add_argument("--check", nargs="*", default=[], help="bench JSON files to predict")
    ap.add_argument("--write", action="store_true", help="write the fit into gpus.toml")
    ap.add_argument("--json", default=None, help="write the fit and the checks here")
    ns = ap.parse_args(argv)
    cal = None
    out: dict = {"gpu": ns.gpu}
    if ns.fit:
        run = json.loads(Path(ns.fit).read_text())
        cal = fit(run, ns.log, ns.fit)
        out["calibration"] = cal.__dict__
        print(f"fit: {cal}")
        if ns.write:
            write_calibration(ns.gpu, cal, run["model_bytes"].get("device_memory_bytes"))
            print(f"wrote [{ns.gpu}.calibration] into {GPUS_TOML}")
    out["checks"] = []
    for path in ([ns.fit] if ns.fit else []) + ns.check:
        result = check(json.loads(Path(path).read_text()), ns.gpu, cal)
        result["file"] = Path(path).name
        out["checks"].append(result)
        print(
            f"\n{result['file']} ({result['model']}): KV blocks {result['kv_blocks_predicted']} "
            f"predicted, {result['kv_blocks_measured']} measured; weights "
            f"{result['weights_bytes_predicted']} / {result['weights_bytes_measured']}"
        )
        print("conc  TPOT meas  TPOT pred   err   experts meas  pred   err")
        for r in result["points"]:
            print(
                f"{r['concurrency']:>4}  {r['tpot_ms_measured']:9.2f}  {r['tpot_ms_predicted']:9.2f}"
                f"  {r['tpot_error']:+5.1%}  {r['experts_per_layer_measured']:12.1f}"
                f"  {r['experts_per_layer_predicted']:5.1f}  {r['experts_error']:+5.1%}"
            )
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
