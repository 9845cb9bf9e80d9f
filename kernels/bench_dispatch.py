"""Dispatch + combine of the `alltoall` backend against raw `all_to_all_single`, on N GPUs.

One process per GPU (NCCL). For each tokens-per-rank count: random top-k routing over the
experts, then `AllToAllDispatcher` `prepare`, `dispatch` + `combine` per round and `finish`
(the count-matrix all-gather, two all-to-alls there (rows, routing), one back, the per-token
sum), timed with CUDA events, median of the iterations. The bytes are the token rows each rank sends in dispatch plus those it sends back
in combine (hidden x dtype size each, ids and weights not counted). The raw peak is one
`all_to_all_single` of the same number of bytes with equal splits, in the same run.

    python3 kernels/bench_dispatch.py --gpus 2 --tokens 128,1024,8192 --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import rank_bench
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safeserve.moe.dispatch import AllToAllDispatcher, CombineInput, StepTokens  # noqa: E402
from safeserve.moe.placement import ExpertPlacement  # noqa: E402
from safeserve.moe.topk import TopKOutput  # noqa: E402
from safeserve.parallel.comm import Comm, Layout  # noqa: E402
from safeserve.parallel.schedule import drive  # noqa: E402


def _time(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median seconds of a call, the ranks entering each together."""
    return statistics.median(rank_bench.times(fn, iters, device, warmup, barrier=True))


def _worker(rank: int, world: int, init: str, args: argparse.Namespace) -> list[dict]:
    device = rank_bench.rank_device(rank, args.device)
    layout = Layout(rank, world, world, dp_attention=True)
    comm = Comm(layout, device)
    comm.init(init)
    placement = ExpertPlacement(args.experts, world, rank)
    disp = AllToAllDispatcher(placement, comm)
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, device=device, dtype=dtype, generator=gen)
        logits = torch.randn(tokens, args.experts, device=device, generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), args.top_k, dim=-1)
        topk = TopKOutput(ids, weights.to(dtype), logits)

        def step(x=x, topk=topk, tokens=tokens) -> None:
            disp.begin_step(StepTokens([tokens] * world, replicated=False))
            disp.run(x, topk, lambda d: CombineInput(d.hidden_states))  # experts: the identity

        t_ours = _time(step, args.iters, args.warmup, device)
        disp.begin_step(StepTokens([tokens] * world, replicated=False))
        counts = drive(disp.prepare(x, topk)).counts  # [source rank][destination rank] rows
        sent_rows = sum(counts[rank])
        recv_rows = sum(row[rank] for row in counts)
        remote_rows = sent_rows - counts[rank][rank]
        row_bytes = args.hidden * x.element_size()
        moved = (sent_rows + recv_rows) * row_bytes  # dispatch sends + combine sends back
        # Raw: one all_to_all_single moving the same bytes per rank, equal splits: the most any
        # rank moved, so that every rank's splits agree (gloo refuses sizes that differ).
        most = torch.tensor([moved], device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        elems = max(world, int(most.item()) // x.element_size() // world * world)
        src = torch.randn(elems, device=device, dtype=dtype, generator=gen)
        dst = torch.empty_like(src)
        t_raw = _time(
            lambda src=src, dst=dst: dist.all_to_all_single(dst, src),
            args.iters,
            args.warmup,
            device,
        )
        rows.append(
            {
                "rank": rank,
                "tokens_per_rank": tokens,
                "rows_sent": sent_rows,
                "rows_sent_remote": remote_rows,
                "bytes_moved": moved,
                "ours_us": t_ours * 1e6,
                "ours_gbps": moved / t_ours / 1e9,
                "raw_us": t_raw * 1e6,
                "raw_gbps": elems * x.element_size() / t_raw / 1e9,
            }
        )
    if args.profile and rank == 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
        top = sorted(
            (e for e in prof.events() if e.cpu_parent is None), key=lambda e: e.time_range.start
        )
        t0 = top[0].time_range.start
        print("host timeline of the last step (µs from the profile start: start, length, op):")
        for e in top[-40:]:
            print(f"{e.time_range.start - t0:9.0f} {e.time_range.elapsed_us():7.0f}  {e.name}")
    elif args.profile:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    dist.barrier()
    comm.shutdown()
    return rows


def main() -> None:
    p = rank_bench.parser(__doc__)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument(
        "--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[128, 1024, 8192]
    )
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument(
        "--profile", action="store_true", help="print a torch.profiler table (rank 0, last size)"
    )
    args = p.parse_args()
    if args.gpus < 2:
        sys.exit("needs at least 2 GPUs")
    rank_bench.need_gpus(args.device, args.gpus)
    results = [row for rows in rank_bench.run(_worker, args.gpus, (args,), 600) for row in rows]
    print(
        f"{args.gpus} GPUs ({rank_bench.device_name(args.device)}), hidden {args.hidden}, top-{args.top_k} of "
        f"{args.experts}, bf16; per rank: dispatch+combine vs raw all_to_all_single of the same bytes"
    )
    print(
        "| tokens/rank | rows sent (remote) | MB moved | ours µs | ours GB/s | raw µs | raw GB/s | ours/raw |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for tokens in args.tokens:
        rs = [r for r in results if r["tokens_per_rank"] == tokens]
        ours = statistics.mean(r["ours_gbps"] for r in rs)
        raw = statistics.mean(r["raw_gbps"] for r in rs)
        print(
            f"| {tokens} | {statistics.mean(r['rows_sent'] for r in rs):.0f} "
            f"({statistics.mean(r['rows_sent_remote'] for r in rs):.0f}) | "
            f"{statistics.mean(r['bytes_moved'] for r in rs) / 1e6:.1f} | "
            f"{statistics.mean(r['ours_us'] for r in rs):.0f} | {ours:.0f} | "
            f"{statistics.mean(r['raw_us'] for r in rs):.0f} | {raw:.0f} | {ours / raw:.0%} |"
        )
    rank_bench.write_json(args.json, results, indent=1)
    os._exit(0)


if __name__ == "__main__":
    main()
