"""Dispatch-buffer admission on GPUs: memory under routing skew, and its cost when not needed.

One process per GPU (NCCL), one Qwen3-30B-A3B-shaped MoE layer (bf16, 128 experts, top-8,
hidden 2048, expert FFN 768), expert parallel over the GPUs, attention data-parallel (each rank
dispatches its own tokens), the engine's own `AllToAllDispatcher` + `ExpertRunner` (Triton fused
MoE on CUDA).

- `skew`: every token of every rank routed to experts 0..7 (all on rank 0), `--skew-tokens`
  tokens per rank; the layer's peak allocated memory above the weights on each rank, with
  admission (`--budget` rows per round) and without.
- `uniform`: random routing, `--uniform-tokens` per rank, a budget no round needs; median layer
  time with admission on and off (the cost of admission when it does nothing).

    python3 kernels/bench_admission.py --gpus 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safeserve.guards.admission import DispatchBuffers, bytes_per_recv_row  # noqa: E402
from safeserve.moe.dispatch import AllToAllDispatcher, StepTokens  # noqa: E402
from safeserve.moe.placement import ExpertPlacement  # noqa: E402
from safeserve.moe.runner import ExpertRunner  # noqa: E402
from safeserve.moe.topk import TopKOutput  # noqa: E402
from safeserve.parallel.comm import Comm, Layout  # noqa: E402
from safeserve.ports import free_port  # noqa: E402

H, E, K, FFN = 2048, 128, 8, 768


def _layer(disp, runner, x, topk, tokens, world):
    disp.begin_step(StepTokens([tokens] * world, replicated=False))
    return disp.run(x, topk, runner)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, q: mp.Queue) -> None:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    comm = Comm(Layout(rank, world, world, dp_attention=True), dev)
    comm.init(f"tcp://127.0.0.1:{port}")
    placement = ExpertPlacement(E, world, rank)
    dtype = torch.bfloat16
    runner = ExpertRunner(placement.experts_per_rank, H, FFN).to(dev, dtype)
    gen = torch.Generator(device=dev).manual_seed(7 + rank)
    with torch.no_grad():
        runner.w13.normal_(0, 0.02, generator=gen)
        runner.w2.normal_(0, 0.02, generator=gen)
    disp = AllToAllDispatcher(placement, comm)
    row_bytes = bytes_per_recv_row(H, FFN, K, placement.experts_per_rank, dtype)
    out: list[dict] = []

    def routing(tokens: int, skew: bool) -> tuple[torch.Tensor, TopKOutput]:
        x = torch.randn(tokens, H, device=dev, dtype=dtype, generator=gen)
        logits = torch.randn(tokens, E, device=dev, generator=gen)
        w, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
        if skew:
            ids = torch.arange(K, device=dev).expand(tokens, K).contiguous()
        return x, TopKOutput(ids, w.to(dtype), logits)

    def measure(x, topk, tokens, budget: int | None, iters: int) -> dict:
        disp.buffers = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        if budget:
            disp.buffers = DispatchBuffers.allocate(budget, H, FFN, K, dtype, dev)
        torch.cuda.reset_peak_memory_stats(dev)
        res: dict = {"rank": rank, "budget": budget, "tokens_per_rank": tokens}
        try:
            with torch.no_grad():
                _layer(disp, runner, x, topk, tokens, world)  # warm-up (Triton JIT)
                times = []
                for _ in range(iters):
                    s, e = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    s.record()
                    _layer(disp, runner, x, topk, tokens, world)
                    e.record()
                    torch.cuda.synchronize()
                    times.append(s.elapsed_time(e) * 1e3)
            res["layer_us"] = statistics.median(times)
            res["peak_bytes_above_weights"] = torch.cuda.max_memory_allocated(dev) - base
            if disp.buffers is not None:
                st = disp.buffers.stats
                layers = iters + 1
                res.update(
                    recv_peak=st.recv_peak,
                    rounds=st.rounds_total // layers,
                    buffer_bytes=st.buffer_bytes,
                )
        except torch.OutOfMemoryError as err:
            res["oom"] = str(err).splitlines()[0]
        disp.buffers = None
        return res

    with torch.no_grad():
        x, topk = routing(args.skew_tokens, skew=True)
        for budget in (args.budget, None):
            r = measure(x, topk, args.skew_tokens, budget, iters=3)
            r.update(scenario="skew", row_bytes=row_bytes)
            out.append(r)
        x, topk = routing(args.uniform_tokens, skew=False)
        roomy = world * args.uniform_tokens
        for budget in (roomy, None, roomy, None):  # interleaved, twice
            r = measure(x, topk, args.uniform_tokens, budget, iters=args.iters)
            r.update(scenario="uniform")
            out.append(r)
    q.put(out)
    comm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--skew-tokens", type=int, default=16384)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--uniform-tokens", type=int, default=1024)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, args.gpus, port, args, q)) for r in range(args.gpus)
    ]
    for pr in procs:
        pr.start()
    rows = [row for _ in procs for row in q.get(timeout=900)]
    for pr in procs:
        pr.join()
    print(
        f"{args.gpus} x {torch.cuda.get_device_name(0)}; MoE layer E={E} top-{K} H={H} I={FFN} bf16, ep {args.gpus}"
    )
    print(
        "| scenario | tokens/rank | rank | budget | rounds | recv peak | peak MiB above weights | layer µs |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: (r["scenario"], r["rank"])):
        peak = (
            f"{r['peak_bytes_above_weights'] / 2**20:.0f}"
            if "peak_bytes_above_weights" in r
            else r.get("oom")
        )
        print(
            f"| {r['scenario']} | {r['tokens_per_rank']} | {r['rank']} | {r['budget'] or 'off'} | "
            f"{r.get('rounds', '-')} | {r.get('recv_peak', '-')} | {peak} | {r.get('layer_us', 0):.0f} |"
        )
    uni = [r for r in rows if r["scenario"] == "uniform" and "layer_us" in r]
    on = statistics.median(r["layer_us"] for r in uni if r["budget"])
    off = statistics.median(r["layer_us"] for r in uni if not r["budget"])
    print(
        f"uniform: admission on {on:.0f} µs, off {off:.0f} µs: cost {100 * (on / off - 1):+.1f} %"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    os._exit(0)


if __name__ == "__main__":
    main()
