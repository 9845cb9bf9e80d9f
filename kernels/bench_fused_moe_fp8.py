"""Micro-benchmark (and tile sweep) of the block-FP8 fused MoE (`safeserve.kernels.fused_moe_fp8`)
on one GPU, against the bf16 `fused_moe` of the same layer in the same run.

Default shape: one Qwen3-30B-A3B MoE layer (E=128, top-8, H=2048, I=768). The experts are drawn
in bf16 and block-quantized (128 x 128) for the FP8 side. For each token count both layers are
timed as CUDA-graph replays over several routings, round-robin (kernels/moe_bench_harness.py);
the floors are the bytes of the experts the routings select (FP8: weights plus their float32
scales; bf16: weights) over the HBM read ceiling (4.24 TB/s). Each FP8 row is checked against the
dequantizing W8A8 reference (`fp8_reference.grouped_experts_fp8`, relative error).

`--sweep` times a grid of tile configs per token count (BLOCK_M, down's BLOCK_N, GROUP_M, warps,
stages; each checked against the reference) and writes the fastest as a tile table
(`--table-out`, the format `fused_moe_fp8.load_fp8_table` reads; ship it in
safeserve/kernels/configs/ under `fused_moe_fp8.fp8_config_file_name`). `--fp8-ceiling` also
measures the FP8 matrix rate (`torch._scaled_mm`, 8192^3) for the compute-bound counts.

`--peer-dir .peer/sglang` also times the peer, SGLang's Triton `fused_moe` in its block-FP8 W8A8
mode (kernels/peer_sglang.py; SGLang's files are copied at run time by
kernels/fetch_peer_sglang.sh into the git-ignored .peer/, never committed), with its own tiles
(its tuned table of the shape and device, else its default), on the same experts and routings,
timed the same way: each row gains `peer_us`, `peer_over_floor` (the same FP8 floor),
`ours_over_peer`, `peer_rel_err` (against the same reference) and `peer_config`; the JSON's meta
the peer's commit. A peer that fails at a token count leaves `peer_error` in that row.

    python3 kernels/bench_fused_moe_fp8.py [--tokens 1,64,4096] [--sweep --table-out t.json]
        [--fp8-ceiling] [--peer-dir .peer/sglang] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_bench_harness import DEVICE, graph_times_us, make_routings, make_weights  # noqa: E402

from safeserve.kernels import fused_moe as fm  # noqa: E402
from safeserve.kernels import fused_moe_fp8 as f8  # noqa: E402
from safeserve.kernels.fp8_reference import block_quantize, grouped_experts_fp8  # noqa: E402

HBM_READ_BW = 4.24e12  # bytes/s, measured H200 read ceiling (kernels/RESULTS.md)
DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
SWEEP = {
    "BLOCK_M": (16, 32, 64, 128),
    "BLOCK_N2": (64, 128),
    "GROUP_M": (1, 8),
    "num_warps": (4, 8),
    "stages": (2, 3, 4),
}


def fp8_expert_bytes(hidden: int, inter: int) -> int:
    blocks = -(-hidden // 128) * -(-inter // 128)
    return 3 * hidden * inter + 3 * blocks * 4  # FP8 weights + float32 scales


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor):  # type: ignore[no-untyped-def]
    inter = w13.shape[1] // 2
    gq, gs = block_quantize(w13[:, :inter])
    uq, us = block_quantize(w13[:, inter:])
    w13q = torch.cat([gq.view(torch.uint8), uq.view(torch.uint8)], dim=1).view(gq.dtype)
    w2q, w2s = block_quantize(w2)
    return w13q, torch.cat([gs, us], dim=1), w2q, w2s


def fp8_ceiling_tflops() -> float:
    a = torch.randn(8192, 8192, device=DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device=DEVICE).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=DEVICE)
    times = graph_times_us(
        [lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)], 10
    )
    return 2 * 8192**3 / statistics.median(times) / 1e6


def time_fp8(routings, q, cfg, reps: int) -> list[float]:  # type: ignore[no-untyped-def]
    w13q, w13s, w2q, w2s = q
    fns = [
        (lambda r=r: f8.fused_moe_fp8(r[0], w13q, w13s, w2q, w2s, r[1], r[2], config=cfg))
        for r in routings
    ]
    return graph_times_us(fns, reps)


def rel_err(routing, q, cfg) -> float:  # type: ignore[no-untyped-def]
    x, w, ids = routing
    w13q, w13s, w2q, w2s = q
    got = f8.fused_moe_fp8(x, w13q, w13s, w2q, w2s, w, ids, config=cfg).float()
    want = grouped_experts_fp8(x.float(), w13q, w13s, w2q, w2s, ids, w, quantize_input=True)
    return ((got - want).norm() / want.norm()).item()


def peer_row(peer, routings, q, reps: int, floor_us: float, fp8_us: float) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The peer's columns of a row: its own config, timed as ours, its error against our
    reference."""
    w13q, w13s, w2q, w2s = q
    x0, w0, ids0 = routings[0]
    cfg = peer.config_for(x0.shape[0], w13q.shape[0], w2q.shape[2], torch.device(DEVICE))
    try:
        fns = [(lambda r=r: peer(r[0], w13q, w13s, w2q, w2s, r[1], r[2])) for r in routings]
        peer_us = statistics.median(graph_times_us(fns, reps))
        got = peer(x0, w13q, w13s, w2q, w2s, w0, ids0).float()
    except Exception as e:  # noqa: BLE001 - the peer's failure must not cost our row
        return {"peer_error": repr(e)[:500], "peer_config": cfg}
    want = grouped_experts_fp8(x0.float(), w13q, w13s, w2q, w2s, ids0, w0, quantize_input=True)
    return {
        "peer_us": peer_us,
        "peer_over_floor": peer_us / floor_us,
        "ours_over_peer": fp8_us / peer_us,
        "peer_rel_err": ((got - want).norm() / want.norm()).item(),
        "peer_config": cfg,
    }


def short_peer_config(cfg: dict[str, Any]) -> str:
    def one(c: dict[str, Any], swap: bool) -> str:
        return (
            f"M{c['BLOCK_SIZE_M']}N{c['BLOCK_SIZE_N']}K{c['BLOCK_SIZE_K']}G{c['GROUP_SIZE_M']}"
            f"w{c.get('num_warps', 4)}s{c.get('num_stages', 3)}{' swap_ab' if swap else ''}"
        )

    up = one(cfg["up"], cfg["swap_ab"][0])
    down = f" / down {one(cfg['down'], cfg['swap_ab'][1])}" if cfg["down"] else ""
    return up + down + ("" if cfg["table"] else " (default)")


def sweep_one(routings, q, reps: int, max_err: float) -> tuple[dict, float, int]:  # type: ignore[no-untyped-def]
    best, best_us, tried = None, float("inf"), 0
    for values in itertools.product(*SWEEP.values()):
        cfg = dict(zip(SWEEP, values, strict=True))
        try:
            if rel_err(routings[0], q, cfg) > max_err:
                continue
            us = statistics.median(time_fp8(routings, q, cfg, reps))
        except Exception:  # noqa: BLE001 - a tile that does not fit (out of resources) is skipped
            continue
        tried += 1
        if us < best_us:
            best, best_us = cfg, us
    assert best is not None, "no config ran"
    return best, best_us, tried


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rotations", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-reps", type=int, default=6)
    p.add_argument("--table-out")
    p.add_argument("--fp8-ceiling", action="store_true")
    p.add_argument("--max-err", type=float, default=1e-2, help="a config above this is wrong")
    p.add_argument("--peer-dir", help="also time SGLang's fused MoE from this copy")
    p.add_argument("--json")
    ns = p.parse_args(argv)
    tokens = [int(t) for t in ns.tokens.split(",")]
    e, h, i, k = ns.experts, ns.hidden, ns.inter, ns.top_k
    w13, w2 = make_weights(e, h, i, torch.bfloat16)
    q = quantize_experts(w13, w2)
    ceiling = fp8_ceiling_tflops() if ns.fp8_ceiling else None
    meta = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability()))
        if DEVICE == "cuda"
        else None,
        "shape": {"E": e, "H": h, "I": i, "top_k": k},
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "fp8_matrix_TFLOPs": ceiling,
    }
    peer = None
    if ns.peer_dir:
        from peer_sglang import load as load_peer

        peer = load_peer(ns.peer_dir)
        meta["peer"] = {
            "name": "sglang fused_moe (Triton, use_fp8_w8a8, block_shape [128, 128])",
            "commit": peer.commit,
            "harness": "kernels/peer_sglang.py",
        }
    rows, table = [], {}
    for n in tokens:
        routings = make_routings(n, e, h, k, torch.bfloat16, ns.rotations)
        t0 = time.monotonic()
        swept = None
        if ns.sweep:
            cfg, _, tried = sweep_one(routings, q, ns.sweep_reps, ns.max_err)
            swept = tried
        else:
            cfg = f8.get_fp8_config(n, e, h, i, torch.device(DEVICE))
        fp8_us = statistics.median(time_fp8(routings, q, cfg, ns.reps))
        fns = [(lambda r=r: fm.fused_moe(r[0], w13, w2, r[1], r[2])) for r in routings]
        bf16_us = statistics.median(graph_times_us(fns, ns.reps))
        distinct = statistics.mean(int(torch.unique(r[2]).numel()) for r in routings)
        floor8 = distinct * fp8_expert_bytes(h, i) / HBM_READ_BW * 1e6
        floor16 = distinct * 3 * h * i * 2 / HBM_READ_BW * 1e6
        flops = 2 * n * k * 3 * h * i
        row: dict[str, Any] = {
            "tokens": n,
            "experts_read": distinct,
            "fp8_us": fp8_us,
            "bf16_us": bf16_us,
            "fp8_over_bf16": fp8_us / bf16_us,
            "fp8_floor_us": floor8,
            "fp8_over_floor": fp8_us / floor8,
            "bf16_over_floor": bf16_us / floor16,
            "fp8_TFLOPs": flops / fp8_us / 1e6,
            "rel_err": rel_err(routings[0], q, cfg),
            "config": cfg,
        }
        if ceiling:
            row["fp8_matrix_share"] = row["fp8_TFLOPs"] / ceiling
        peer_text = ""
        if peer is not None:
            row.update(peer_row(peer, routings, q, ns.reps, floor8, fp8_us))
            if "peer_us" in row:
                peer_text = (
                    f", sglang {row['peer_us']:8.1f} us (x{row['peer_over_floor']:.2f}), "
                    f"ours/sglang {row['ours_over_peer']:.3f}, err "
                    f"{row['peer_rel_err']:.1e}, {short_peer_config(row['peer_config'])}"
                )
            else:
                peer_text = f", sglang failed: {row['peer_error'][:200]}"
        if swept is not None:
            row["configs_tried"] = swept
            table[str(n)] = {**cfg, "tuned_us": round(fp8_us, 2)}
        rows.append(row)
        if ns.table_out and table:  # after every token count: a run cut short keeps its entries
            Path(ns.table_out).write_text(json.dumps({"configs": table, "meta": meta}, indent=1))
        print(
            f"tokens {n:5d}: fp8 {fp8_us:8.1f} us (x{row['fp8_over_floor']:.2f} floor), bf16 "
            f"{bf16_us:8.1f} us (x{row['bf16_over_floor']:.2f}), fp8/bf16 "
            f"{row['fp8_over_bf16']:.3f}, err {row['rel_err']:.1e}, {cfg}{peer_text} "
            f"({time.monotonic() - t0:.0f} s)",
            flush=True,
        )
    if ns.json:
        Path(ns.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
