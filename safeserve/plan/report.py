"""The plan on one screen (aligned columns) or as JSON for scripts."""

from __future__ import annotations

import dataclasses
from typing import Any

from safeserve.plan.gpus import Gpu
from safeserve.plan.planner import GIB, Plan, Workload


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def columns(rows: list[list[str]], right: set[int] | None = None) -> list[str]:
    """Rows as aligned text columns (numbers right-aligned)."""
    right = right or set()
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return out


def text(
    p: Plan,
    gpu: Gpu,
    work: Workload,
    model: str,
    gpus: int,
    fp8: list[str] | None = None,
    gpus_per_node: int = 8,
) -> str:
    lines = [
        f"safeserve plan: {model} on {gpus} x {gpu.description}, "
        f"{work.input_len}+{work.output_len} tokens per request"
    ]
    if fp8:
        lines.append(
            f"FP8 {' and '.join(fp8)}: bytes planned (128 x 128 blocks, float32 scales); "
            "the calibration is bf16's (FP8 steps are not calibrated yet)"
        )
    if gpu.calibration is not None:
        cal = gpu.calibration
        lines.append(
            f"TPOT = reads / ({cal.efficiency:.3f} x {cal.read_ceiling_gbs:,.0f} GB/s) + "
            f"{cal.layer_us:.1f} us per layer + all-to-all; "
            f"{'calibration: ' + cal.source if gpu.calibrated else cal.source}"
        )
        if any(lp.candidate.group_gpus > 1 for lp in p.layouts):
            lines.append(
                "EP > 1: the all-to-all at link bandwidth, from datasheet figures (not yet "
                "measured on more than one GPU)"
            )
    else:
        lines.append("CPU ranks: sizes only, no speed prediction")
    lines.append("")
    head = ["layout", "weights/GPU", "KV tokens/rank", "budget rows", "buffers", "fits conc"]
    head += [f"TPOT@{c}" for c in work.concurrency]
    rows = [head]
    for lp in p.layouts:
        s = lp.sizing
        row = [
            lp.candidate.name + (" *" if lp is p.recommended else ""),
            f"{s.weights_bytes / GIB:.1f} GiB",
            f"{s.kv_tokens:,}" if s.kv_blocks is not None else "none",
            "-" if s.dispatch_budget is None else f"{s.dispatch_budget:,}",
            "-" if s.dispatch_budget is None else f"{s.dispatch_buffer_bytes / 2**20:,.0f} MiB",
            f"{s.max_concurrency:,}",
        ]
        for pt in lp.points:
            if s.kv_blocks is None:
                row.append("no fit")
            else:
                row.append(_ms(pt.tpot_ms) + ("" if pt.fits else "!"))
        rows.append(row)
    lines += columns(rows, right=set(range(1, len(head))))
    lines.append(
        "(* recommended; budget rows: what a rank receives per dispatch round, buffers: their "
        "preallocated memory; ! the KV cache does not hold that concurrency; no fit: the "
        "weights leave no KV cache; TPOT in ms)"
    )
    for why in p.skipped:
        lines.append(f"left out: {why}")
    rec = p.recommended
    if rec is not None:
        lines += ["", f"{rec.candidate.name}, per concurrency (the busiest rank of a step):"]
        rows = [
            [
                "conc",
                "per group",
                "experts/layer",
                "reads/step",
                "floor ms",
                "a2a MB",
                "a2a ms",
                "TPOT ms",
                "blast radius",
            ]
        ]
        for pt in rec.points:
            reqs, share = rec.blast_radius(pt.concurrency)
            rows.append(
                [
                    str(pt.concurrency),
                    str(pt.per_group),
                    f"{pt.experts_per_layer:.1f}",
                    f"{pt.read_bytes / 1e9:.2f} GB",
                    _ms(pt.floor_ms),
                    f"{pt.a2a_step_bytes / 1e6:.1f}",
                    _ms(pt.comm_ms),
                    _ms(pt.tpot_ms),
                    f"{reqs} req, {share:.0%}",
                ]
            )
        lines += columns(rows, right=set(range(9)))
        lines.append(
            "a2a MB: what one rank sends in a step's dispatch and combine over every MoE layer"
        )
    shares = {lp.candidate.group_gpus: lp.in_node_share for lp in p.layouts}
    if any(w > 1 for w in shares):
        lines.append(
            f"share of a token's dispatch and combine destinations inside its node "
            f"({gpus_per_node} GPUs): "
            + ", ".join(f"EP{w} {s:.0%}" for w, s in sorted(shares.items()) if w > 1)
        )
    if rec is not None:
        pre = rec.sizing.prefill
        if pre is not None:
            lines.append(
                f"prefill per attention group: step {pre.step_tokens} tokens, chunk "
                f"{pre.chunk} (safe step {pre.safe_step_tokens}, budget {pre.budget})"
            )
    lines.append("")
    if rec is None:
        lines.append("no layout to recommend:")
    else:
        verdict = "recommended" if p.target_met else "best possible"
        lines.append(f"{verdict}: safeserve serve {p.serve_flags}")
    lines += [f"  - {r}" for r in p.reasons]
    return "\n".join(lines)


def to_json(p: Plan, gpu: Gpu, work: Workload, model: str) -> dict[str, Any]:
    def layout(lp: Any) -> dict[str, Any]:
        return {
            "name": lp.candidate.name,
            "flags": lp.candidate.flags(),
            **dataclasses.asdict(lp.candidate),
            "attention_groups": lp.candidate.attention_groups,
            "rank_bytes": dataclasses.asdict(lp.bytes),
            "sizing": dataclasses.asdict(lp.sizing),
            "in_node_share": lp.in_node_share,
            "points": [
                {
                    **dataclasses.asdict(pt),
                    "blast_radius_requests": lp.blast_radius(pt.concurrency)[0],
                    "blast_radius_share": lp.blast_radius(pt.concurrency)[1],
                }
                for pt in lp.points
            ],
        }

    return {
        "model": model,
        "gpu": dataclasses.asdict(gpu),
        "workload": dataclasses.asdict(work),
        "layouts": [layout(lp) for lp in p.layouts],
        "skipped": p.skipped,
        "recommended": None if p.recommended is None else p.recommended.candidate.name,
        "recommended_flags": p.serve_flags,
        "target_met": p.target_met,
        "reasons": p.reasons,
    }
