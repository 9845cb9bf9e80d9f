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

On `--device cpu` (a smoke run, gloo ranks) there is no peak memory and no Triton: the layer's
time only, of the torch expert path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import rank_bench
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safeserve.guards.admission import DispatchBuffers, bytes_per_recv_row  # noqa: E402
from safeserve.moe.dispatch import AllToAllDispatcher, StepTokens  # noqa: E402
from safeserve.moe.placement import ExpertPlacement  # noqa: E402
from safeserve.moe.runner import ExpertRunner  # noqa: E402
from safeserve.moe.topk import TopKOutput  # noqa: E402
from safeserve.parallel.comm import Comm, Layout  # noqa: E402

H, E, K, FFN = 2048, 128, 8, 768  # the defaults of --hidden, --experts, --top-k, --ffn


def _layer(disp, runner, x, topk, tokens, world):
    disp.begin_step(StepTokens([tokens] * world, replicated=False))
    return disp.run(x, topk, runner)


def _worker(rank: int, world: int, init: str, args: argparse.Namespace) -> list[dict]:
    H, E, K, FFN = args.hidden, args.experts, args.top_k, args.ffn
    dev = rank_bench.rank_device(rank, args.device)
    cuda = dev.type == "cuda"
    comm = Comm(Layout(rank, world, world, dp_attention=True), dev)
    comm.init(init)
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
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(dev)
        if budget:
            disp.buffers = DispatchBuffers.allocate(budget, H, FFN, K, dtype, dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        res: dict = {"rank": rank, "budget": budget, "tokens_per_rank": tokens}
        try:
            with torch.no_grad():
                times = rank_bench.times(  # one warm-up call (Triton JIT)
                    lambda: _layer(disp, runner, x, topk, tokens, world), iters, dev, warmup=1
                )
            res["layer_us"] = statistics.median(times) * 1e6
            if cuda:
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
    comm.shutdown()
    return out


def main() -> None:
    p = rank_bench.parser(__doc__)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--skew-tokens", type=int, default=16384)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--uniform-tokens", type=int, default=1024)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--hidden", type=int, default=H)
    p.add_argument("--experts", type=int, default=E)
    p.add_argument("--top-k", type=int, default=K)
    p.add_argument("--ffn", type=int, default=FFN, help="the expert FFN width")
    args = p.parse_args()
    rank_bench.need_gpus(args.device, args.gpus)
    rows = [row for out in rank_bench.run(_worker, args.gpus, (args,), 900) for row in out]
    print(
        f"{args.gpus} x {rank_bench.device_name(args.device)}; MoE layer E={args.experts} "
        f"top-{args.top_k} H={args.hidden} I={args.ffn} bf16, ep {args.gpus}"
    )
    print(
        "| scenario | tokens/rank | rank | budget | rounds | recv peak | peak MiB above weights | layer µs |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: (r["scenario"], r["rank"])):
        peak = (
            f"{r['peak_bytes_above_weights'] / 2**20:.0f}"
            if "peak_bytes_above_weights" in r
            else r.get("oom", "-")
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
    rank_bench.write_json(args.json, rows, indent=1)
    os._exit(0)


if __name__ == "__main__":
    main()
