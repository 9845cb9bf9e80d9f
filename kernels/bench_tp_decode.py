"""Decode step time of a multi-GPU group, with and without CUDA graphs.

One process per GPU (NCCL), each rank the engine's own `ModelRunner` with the serve flags given
here (default: Qwen3-30B-A3B shapes, dummy bf16 weights, `--tp-size 2 --ep-size 2
--moe-a2a-backend none`; `--enable-dp-attention` spreads the sequences round-robin over the
ranks). Per concurrency B: B prompts of `--input-len` tokens are prefilled, then `--steps`
decode steps of all B run in lock-step on every rank, first eagerly, then (after the same
runners capture their graphs) as CUDA graph replays (decode graphs, or piecewise ones where a
step falls outside them; both are counted). A step is timed on the leader from its plan to its
sampled tokens on the host. Decode inputs are fixed pseudo-random token ids
(identical on every rank, as the leader's plan broadcast makes them), not the sampled ones:
every rank must hold the same plan without a broadcast in the timed loop.

    python3 kernels/bench_tp_decode.py --tp-size 2 --ep-size 2 --concurrency 1,8,64 \
        --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import rank_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safeserve.config import ServerArgs  # noqa: E402
from safeserve.engine.kv_cache import new_table_id  # noqa: E402
from safeserve.engine.model_runner import ModelRunner  # noqa: E402
from safeserve.engine.plan import SeqPlan, StepPlan  # noqa: E402
from safeserve.messages import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _token(step: int, i: int, vocab: int) -> int:
    return (step * 7919 + i * 104729) % vocab


def _split(runner: ModelRunner, seqs: list[SeqPlan]) -> list[list[SeqPlan]]:
    """The step's sequences per attention rank: all on one list (tensor-parallel attention),
    or round-robin over the ranks (data-parallel; each rank keeps its own KV cache, so the
    same block numbers on two ranks are different blocks)."""
    dp = runner.layout.dp_size
    return [seqs[r::dp] for r in range(dp)]


def _timed_decode(
    runner: ModelRunner, batch: int, input_len: int, steps: int, step0: int
) -> tuple[list[float], int]:
    """Prefills `batch` prompts, then times `steps` decode steps; (step seconds, next step)."""
    args, vocab = runner.args, runner.config.vocab_size
    per_seq = (input_len + steps + 8 + args.block_size - 1) // args.block_size
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    ids = [new_table_id() for _ in range(batch)]  # as the server's: only new entries go up
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8)
    step = step0
    # Prefill: as many whole prompts per step as the step's token budget holds.
    per_step = max(1, args.max_num_batched_tokens // input_len)
    for lo in range(0, batch, per_step):
        seqs = [
            SeqPlan([_token(0, i + j, vocab) for j in range(input_len)], 0, tables[i], params, 0)
            for i in range(lo, min(batch, lo + per_step))
        ]
        runner.execute(StepPlan(step=step, per_rank=_split(runner, seqs)))
        step += 1
    times: list[float] = []
    for j in range(steps + 4):  # the first 4 are not timed
        pos = input_len + j
        seqs = [
            SeqPlan([_token(step, i, vocab)], pos, tables[i], params, j + 1, ids[i])
            for i in range(batch)
        ]
        t0 = time.perf_counter()
        runner.execute(StepPlan(step=step, per_rank=_split(runner, seqs)))
        if j >= 4:
            times.append(time.perf_counter() - t0)
        step += 1
    return times, step


def _replays(runner: ModelRunner) -> list[int]:
    """[decode graph replays, piecewise graph replays] so far (0 for a kind not captured)."""
    return [g.replays if g is not None else 0 for g in (runner.cuda_graphs, runner.piecewise)]


def _worker(rank: int, world: int, init: str, opts: argparse.Namespace) -> dict:
    args = ServerArgs(
        model=opts.model,
        load_format=opts.load_format,
        dtype=opts.dtype,
        device=opts.device,
        tp_size=opts.tp_size,
        ep_size=opts.ep_size,
        moe_a2a_backend=opts.moe_a2a_backend,
        enable_dp_attention=opts.enable_dp_attention,
        max_running_requests=max(opts.concurrency),
    )
    runner = ModelRunner(args, rank, init, capture_cuda_graphs=False)
    rows = []
    step = 1
    modes = ("eager", "graphs") if opts.device == "cuda" else ("eager",)
    for mode in modes:
        if mode == "graphs":
            t0 = time.perf_counter()
            runner.capture_cuda_graphs()
            if rank == 0:
                print(f"captured in {time.perf_counter() - t0:.1f} s", flush=True)
            if runner.cuda_graphs is None and runner.piecewise is None:
                raise RuntimeError("no CUDA graphs for this layout")
            replays0 = _replays(runner)
        for batch in opts.concurrency:
            times, step = _timed_decode(runner, batch, opts.input_len, opts.steps, step)
            row = {
                "mode": mode,
                "concurrency": batch,
                "step_ms_median": 1e3 * statistics.median(times),
                "step_ms_p10": 1e3 * sorted(times)[len(times) // 10],
                "step_ms_p90": 1e3 * sorted(times)[(9 * len(times)) // 10],
            }
            rows.append(row)
            if rank == 0:
                print(
                    f"{mode:>6} concurrency {batch:>3}: step {row['step_ms_median']:.2f} ms "
                    f"(p10 {row['step_ms_p10']:.2f}, p90 {row['step_ms_p90']:.2f})",
                    flush=True,
                )
    replays = (
        [a - b for a, b in zip(_replays(runner), replays0, strict=True)]
        if "graphs" in modes
        else []
    )
    runner.comm.shutdown()
    return {"rows": rows, "replays": replays}


def main() -> None:
    p = rank_bench.parser(__doc__)
    p.add_argument("--model", default=str(ROOT / "kernels/configs/qwen3-30b-a3b"))
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--moe-a2a-backend", default="none")
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    opts = p.parse_args()
    opts.concurrency = [int(c) for c in opts.concurrency.split(",")]
    rank_bench.need_gpus(opts.device, opts.tp_size)
    results = dict(enumerate(rank_bench.run(_worker, opts.tp_size, (opts,), 900)))
    rows = results[0]["rows"]
    eager = {r["concurrency"]: r["step_ms_median"] for r in rows if r["mode"] == "eager"}
    if opts.device != "cuda":
        print(f"eager step ms: {eager}")
    print("| concurrency | eager step ms | graph step ms | eager / graph |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        if r["mode"] == "graphs":
            c = r["concurrency"]
            print(
                f"| {c} | {eager[c]:.2f} | {r['step_ms_median']:.2f} | "
                f"{eager[c] / r['step_ms_median']:.2f}× |"
            )
    replays = {rank: res["replays"] for rank, res in results.items()}
    print(f"graph replays per rank [decode, piecewise]: {replays}")
    if opts.json:
        args = vars(opts) | {"json": str(opts.json)}
        rank_bench.write_json(opts.json, {"args": args, "rows": rows, "replays": replays}, 2)


if __name__ == "__main__":
    main()
