"""Entry: one bench run (our engine, then the peer), its table, and `main` of `safeserve bench`."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
from pathlib import Path

import torch

from safeserve.bench.engine import make_prompts, run_engine
from safeserve.bench.floor import measure_read_ceiling
from safeserve.bench.options import BenchOptions, bench_server_args, check_context, progress
from safeserve.bench.peer import run_transformers
from safeserve.config import ServerArgs


def check_one_rank(args: ServerArgs) -> None:
    """The bench runs one rank in this process; a group of several is another script's."""
    if args.tp_size != 1:
        raise ValueError(
            "safeserve bench runs one rank (--tp-size 1); for a multi-GPU group run "
            "kernels/bench_tp_decode.py with the same layout flags (one engine rank per GPU, "
            "decode steps eagerly and as CUDA graphs)"
        )


def check_device(args: ServerArgs) -> None:
    """--device cuda needs a CUDA device this torch can see."""
    if args.device == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(
            f"--device cuda: no CUDA device is visible (torch {torch.__version__}, {build})"
        )


def run_bench(args: ServerArgs, opts: BenchOptions) -> dict:
    args = bench_server_args(args, opts)
    check_one_rank(args)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gib = opts.ceiling_gib or (4.0 if device.type == "cuda" else 0.25)
    ceiling = measure_read_ceiling(device, gib)
    progress(f"read ceiling: {ceiling / 1e9:.0f} GB/s ({gib:g} GiB bf16 sum)")
    result: dict = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "args": args.to_dict(),
        "input_len": opts.input_len,
        "output_len": opts.output_len,
        "read_ceiling_gbs": ceiling / 1e9,
    }
    ours, runner, routing = run_engine(args, opts, ceiling)
    result.update(ours)
    if opts.distribution_path:
        if routing is None:
            raise ValueError("--expert-distribution-out: the model has no routed experts")
        from safeserve.moe.eplb.distribution import write_expert_distribution

        write_expert_distribution(opts.distribution_path, routing)
        result["expert_distribution"] = opts.distribution_path
        progress(f"wrote the decode steps' routing to {opts.distribution_path}")
    prompts = make_prompts(
        max(opts.concurrency), opts.input_len, runner.config.vocab_size, args.seed
    )
    del runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if opts.peer == "transformers":
        conc = opts.peer_concurrency or sorted({opts.concurrency[0], opts.concurrency[-1]})
        peer_len = opts.peer_output_len or opts.output_len
        peer = run_transformers(args, prompts, conc, peer_len)
        mine = {p["concurrency"]: p for p in result["points"]}
        for p in peer:
            if p["concurrency"] in mine:
                m = mine[p["concurrency"]]
                p["speedup_decode_tok_s"] = m["decode_tok_s"] / p["decode_tok_s"]
                p["speedup_output_tok_s"] = m["output_tok_s"] / p["output_tok_s"]
        result["peer"] = {"name": "transformers", "output_len": peer_len, "points": peer}
    return result


def format_table(result: dict) -> str:
    head = (
        "| conc | TPOT ms | out tok/s | step ms | floor ms | step/floor | GB/s | ceiling share "
        "| experts/layer |"
    )
    lines = [head, "|" + " --- |" * 9]
    for p in result["points"]:
        lines.append(
            f"| {p['concurrency']} | {p['tpot_ms']:.2f} | {p['output_tok_s']:.1f} "
            f"| {p['decode_step_ms']:.2f} | {p['floor_ms']:.2f} | {p['step_over_floor']:.2f} "
            f"| {p['achieved_gbs']:.3g} | {p['ceiling_share'] * 100:.1f} % "
            f"| {p['experts_per_layer']:.1f} |"
        )
    pts = result["points"]
    if len(pts) > 1:
        lines.append(
            f"\nTPOT growth {pts[0]['concurrency']} -> {pts[-1]['concurrency']}: "
            f"{pts[-1]['tpot_ms'] / pts[0]['tpot_ms']:.2f}x"
        )
    if "peer" in result:
        lines.append("\n| conc | transformers step ms | decode tok/s | ours / transformers |")
        lines.append("| --- | --- | --- | --- |")
        for p in result["peer"]["points"]:
            ratio = p.get("speedup_decode_tok_s")
            lines.append(
                f"| {p['concurrency']} | {p['decode_step_ms']:.2f} | {p['decode_tok_s']:.1f} "
                f"| {f'{ratio:.1f}x' if ratio else '-'} |"
            )
    lines.append(f"\nread ceiling {result['read_ceiling_gbs']:.0f} GB/s on {result['device']}")
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    import logging

    from safeserve.config import ConfigError
    from safeserve.config_cli import check_output_file, server_args_from
    from safeserve.model.checkpoint import load_model_config
    from safeserve.model.quant import check_fp8_flags

    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s [bench] %(levelname)s %(name)s: %(message)s"
    )
    try:
        args = server_args_from(ns)
        opts = BenchOptions.from_namespace(ns)
        check_one_rank(args)
        check_device(args)
        check_context(args, opts)
        quant = load_model_config(args.model, args.quantization).quant
        check_fp8_flags(quant, args.enable_deterministic_inference)
        check_output_file(opts.json_path, "--json")
        check_output_file(opts.distribution_path, "--expert-distribution-out")
        if opts.distribution_path and not load_model_config(args.model).num_experts:
            raise ValueError("--expert-distribution-out: the model has no routed experts")
    except (ConfigError, ValueError) as e:
        print(f"safeserve bench: error: {e}", file=sys.stderr)
        return 2
    result = run_bench(args, opts)
    print(format_table(result), flush=True)
    if opts.json_path:
        Path(opts.json_path).write_text(json.dumps(result, indent=1))
        progress(f"wrote {opts.json_path}")
    return 0
