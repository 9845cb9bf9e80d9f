"""Tune `safeserve.kernels.fused_moe` tile configs on one GPU; writes a token-count -> config table.

For every token bucket and every candidate launch plan (``pair`` or ``sorted`` with a given
BLOCK_M) it runs a coordinate search: first the gate/up tile (down tile at a default), then the
down tile (gate/up at the best found). Each candidate is timed end to end as CUDA-graph replays
over several routings (kernels/bench_fused_moe.py), median of all replays. All candidate kernels
are compiled up front in a pool of processes (they share Triton's on-disk cache).

    python3 kernels/tune_fused_moe.py --out table.json [--tokens 1,8,64] [--budget-s 300]

Copy the table to safeserve/kernels/configs/E{E}_H{H}_I{I}_{device}.json to ship it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fused_moe import (  # noqa: E402
    DEFAULT_TOKENS,
    DEVICE,
    graph_times_us,
    make_routings,
    make_weights,
    reference,
)

from safeserve.kernels import fused_moe as fm  # noqa: E402
from safeserve.kernels import moe_config as mc  # noqa: E402
from safeserve.kernels.common import shared_memory_per_program  # noqa: E402

# (mode, BLOCK_M). On Hopper every launch is a programmatic dependent (kernels/common.py), the
# down kernel included, so no "pdl" variant is searched (its L2-prefetch form never won on an H200).
Plan = tuple[str, int]


def _smem_limit() -> int:
    """The shared memory a program's tiles may take on the device being tuned (kernels refit
    configs to it at launch, so a candidate over it would be timed as a smaller one)."""
    return mc.smem_budget(shared_memory_per_program(torch.device(DEVICE)))


def _k(bn: int, bk: int, warps: int, stages: int, group_m: int = 8) -> mc.Config:
    return mc.kcfg(bn, bk, group_m, warps, stages)


def _smem_ok(bm: int, k: mc.Config, n_b: int, elem: int = 2) -> bool:
    return mc.gemm_tiles_bytes(bm, k, n_b, elem) <= _smem_limit()


def gemm_space(plan: Plan, which: str) -> list[mc.Config]:
    """Candidate tiles for one kernel of one plan (pruned by shared memory)."""
    mode, bm = plan
    if mode == "chunk":  # gemm1: slices of intermediate rows (always interleaved); gemm2: down
        if which == "gemm1":
            return [
                {**_k(bi, bk, w, s, 1), "interleave": True}
                for bi in (32, 64)
                for bk in (128, 256)
                for w in (4, 8)
                for s in (3, 4, 5)
                if mc.fit_config(
                    _chunk(_k(bi, bk, w, s, 1), _k(128, 128, 4, 1)), 2, 8, _smem_limit()
                )["gemm1"]["num_stages"]
                == s
            ]
        return [_k(bn, 128, w, 1, 1) for bn in (64, 128, 256) for w in (2, 4)]
    if bm == 16:
        bns = (16, 32, 64, 128)
        stages = (3, 4, 5, 6, 8) if mode.startswith("pair") else (3, 4, 5)
        space = [_k(bn, bk, 4, s) for bn in bns for bk in (128, 256) for s in stages]
    elif bm == 32:
        bns = (32, 64, 128) if which == "gemm1" else (64, 128)
        space = [_k(bn, bk, 4, s) for bn in bns for bk in (64, 128) for s in (3, 4, 5)]
    elif bm == 64:
        bns = (64, 128) if which == "gemm1" else (64, 128, 256)
        space = [_k(bn, bk, w, s) for bn in bns for bk in (64, 128) for w in (4, 8) for s in (3, 4)]
    else:
        if which == "gemm1":
            space = [_k(bn, 64, 8, s) for bn in (64, 128) for s in (3, 4, 5)]
            space += [_k(64, 128, 8, s) for s in (3, 4)]
        else:
            space = [_k(bn, bk, 8, s) for bn in (128, 256) for bk in (64, 128) for s in (3, 4)]
            space += [_k(128, bk, 4, s) for bk in (64, 128) for s in (3, 4, 5)]
    if which == "gemm1":  # gate and up as two dots, or as one interleaved dot of twice the width
        space += [{**k, "interleave": True} for k in space]
    elif mode.startswith("pair"):  # the decode down projection: also other warp counts
        space += [
            _k(bn, bk, w, s)
            for bn in (16, 32)
            for bk in (128, 256)
            for w in (2, 8)
            for s in (4, 6, 8)
        ]
        # its k slots shared by several programs (float32 partials, summed by the last)
        space += [
            {**_k(bn, bk, w, st), "split": sp}
            for bn in (16, 32, 64)
            for bk in (128, 256)
            for w in (2, 4)
            for st in (3, 5)
            for sp in (2, 4, 8)
        ]
    n_b = 2 if which == "gemm1" else 1
    return [k for k in space if _smem_ok(bm, k, n_b)]


def _chunk(g1: mc.Config, g2: mc.Config) -> mc.Config:
    return full(("chunk", 16), {**g1, "interleave": True}, g2)


def default_kernel(plan: Plan, which: str) -> mc.Config:
    mode, bm = plan
    if mode == "chunk":
        return (
            {**_k(64, 128, 4, 4, 1), "interleave": True}
            if which == "gemm1"
            else _k(128, 128, 4, 1, 1)
        )
    if bm == 16:
        pair = mode.startswith("pair")
        return _k(32 if pair else 64, 256 if pair else 128, 4, 4)
    if bm == 32:
        return _k(64, 128, 4, 4)
    if bm == 64:
        return _k(128, 64, 4, 4) if which == "gemm2" else _k(64, 64, 4, 4)
    return _k(128, 64, 8, 3)


def plans_for(num_tokens: int, top_k: int, num_experts: int) -> list[Plan]:
    per_expert = num_tokens * top_k / num_experts
    plans: list[Plan] = []
    if num_tokens <= 16:
        plans.append(("pair", 16))
    if num_tokens <= 8:
        plans.append(("chunk", 16))
    if per_expert <= 24:
        plans.append(("sorted", 16))
    if 4 <= per_expert <= 80:
        plans.append(("sorted", 32))
    if 24 <= per_expert:
        plans.append(("sorted", 64))
    if 48 <= per_expert:
        plans.append(("sorted", 128))
    return plans


def full(plan: Plan, g1: mc.Config, g2: mc.Config) -> mc.Config:
    return {"mode": plan[0], "BLOCK_M": plan[1], "gemm1": g1, "gemm2": g2}


def candidates(plan: Plan) -> list[mc.Config]:
    d1, d2 = default_kernel(plan, "gemm1"), default_kernel(plan, "gemm2")
    out = [full(plan, g, d2) for g in gemm_space(plan, "gemm1")]
    out += [full(plan, d1, g) for g in gemm_space(plan, "gemm2")]
    return out


# ---- parallel compilation -------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _worker_init(shape: tuple[int, int, int, int]) -> None:
    e, h, i, k = shape
    _WORKER["w13"] = torch.empty(e, 2 * i, h, device=DEVICE, dtype=torch.bfloat16).normal_()
    _WORKER["w2"] = torch.empty(e, h, i, device=DEVICE, dtype=torch.bfloat16).normal_()
    _WORKER["routing"] = make_routings(4, e, h, k, torch.bfloat16, 1)[0]


def _worker_compile(cfg: mc.Config) -> str | None:
    x, w, ids = _WORKER["routing"]
    try:
        fm.fused_moe(x, _WORKER["w13"], _WORKER["w2"], w, ids, config=cfg)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - any failure just drops the candidate
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def compile_all(cfgs: list[mc.Config], shape: tuple[int, int, int, int], workers: int) -> set[str]:
    """Compile every candidate in a process pool; returns the keys of those that failed."""
    failed: set[str] = set()
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(workers, ctx, initializer=_worker_init, initargs=(shape,)) as pool:
        for cfg, err in zip(cfgs, pool.map(_worker_compile, cfgs, chunksize=1), strict=True):
            if err:
                failed.add(json.dumps(cfg, sort_keys=True))
                print(f"  compile failed: {cfg}: {err}", flush=True)
    return failed


# ---- timing ---------------------------------------------------------------------------------


def time_config(cfg: mc.Config, routings, w13, w2, reps: int) -> float:
    fns = [(lambda r=r: fm.fused_moe(r[0], w13, w2, r[1], r[2], config=cfg)) for r in routings]
    return statistics.median(graph_times_us(fns, reps))


def tune_tokens(
    num_tokens: int, w13, w2, top_k: int, rotations: int, reps: int, failed: set[str]
) -> tuple[mc.Config, float, list[dict[str, Any]]]:
    num_experts, _, hidden = w13.shape
    routings = make_routings(num_tokens, num_experts, hidden, top_k, w13.dtype, rotations)
    log: list[dict[str, Any]] = []

    def timed(cfg: mc.Config) -> float:
        if json.dumps(cfg, sort_keys=True) in failed:
            return float("inf")
        try:
            us = time_config(cfg, routings, w13, w2, reps)
        except Exception as exc:  # noqa: BLE001
            print(f"  T={num_tokens} failed {cfg}: {type(exc).__name__}", flush=True)
            failed.add(json.dumps(cfg, sort_keys=True))
            return float("inf")
        log.append({"config": cfg, "us": us})
        return us

    best_cfg, best_us = None, float("inf")
    for plan in plans_for(num_tokens, top_k, num_experts):
        d2 = default_kernel(plan, "gemm2")
        g1_best, g1_us = None, float("inf")
        for g1 in gemm_space(plan, "gemm1"):
            us = timed(full(plan, g1, d2))
            if us < g1_us:
                g1_best, g1_us = g1, us
        if g1_best is None:
            continue
        g2_best, g2_us = d2, g1_us
        for g2 in gemm_space(plan, "gemm2"):
            if g2 == d2:
                continue
            us = timed(full(plan, g1_best, g2))
            if us < g2_us:
                g2_best, g2_us = g2, us
        print(f"  T={num_tokens} plan={plan}: {g2_us:.1f} us", flush=True)
        if g2_us < best_us:
            best_cfg, best_us = full(plan, g1_best, g2_best), g2_us
    assert best_cfg is not None
    return best_cfg, best_us, log


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rotations", type=int, default=4)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--workers", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--budget-s", type=float, default=600, help="stop tuning new buckets after")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    t0 = time.time()
    tokens = [int(v) for v in args.tokens.split(",")]
    shape = (args.experts, args.hidden, args.inter, args.top_k)
    plans = sorted({p for t in tokens for p in plans_for(t, args.top_k, args.experts)})
    cfgs = list(itertools.chain.from_iterable(candidates(p) for p in plans))
    cfgs += [mc.default_config(t, args.experts, args.top_k) for t in tokens]
    uniq = list({json.dumps(c, sort_keys=True): c for c in cfgs}.values())
    print(f"compiling {len(uniq)} configs on {args.workers} workers", flush=True)
    failed = compile_all(uniq, shape, args.workers)
    print(f"compiled in {time.time() - t0:.0f}s, {len(failed)} failed", flush=True)

    w13, w2 = make_weights(args.experts, args.hidden, args.inter, torch.bfloat16)
    table: dict[str, Any] = {}
    for t in tokens:
        if time.time() - t0 > args.budget_s:
            print(f"budget spent: T={t} keeps the default config", flush=True)
            table[str(t)] = mc.default_config(t, args.experts, args.top_k)
            continue
        cfg, us, _ = tune_tokens(t, w13, w2, args.top_k, args.rotations, args.reps, failed)
        x, w, ids = make_routings(t, args.experts, args.hidden, args.top_k, w13.dtype, 1, 99)[0]
        ref = reference(x, w13, w2, w, ids)
        out = fm.fused_moe(x, w13, w2, w, ids, config=cfg).float()
        err = ((out - ref).norm() / ref.norm()).item()
        if not err <= 1e-2:
            print(f"T={t}: best config WRONG (rel err {err:.1e}); keeping the default", flush=True)
            cfg = mc.default_config(t, args.experts, args.top_k)
        table[str(t)] = {**cfg, "tuned_us": round(us, 2)}
        print(f"T={t}: best {us:.1f} us err {err:.1e} {cfg}", flush=True)
    meta = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        # devices of the same compute capability without a table of their own use this one
        "capability": "{}.{}".format(*torch.cuda.get_device_capability())
        if DEVICE == "cuda"
        else None,
        "torch": torch.__version__,
        "triton": fm.triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "shape": {"E": args.experts, "H": args.hidden, "I": args.inter, "top_k": args.top_k},
        "dtype": "bfloat16",
        "method": "CUDA-graph replay, median over routings x reps (kernels/tune_fused_moe.py)",
        "tuning_seconds": round(time.time() - t0),
    }
    Path(args.out).write_text(json.dumps({"meta": meta, "configs": table}, indent=1))
    print(f"wrote {args.out} in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
