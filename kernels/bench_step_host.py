"""How long a step takes on the host against its GPU work, eagerly and through CUDA graphs.

One rank. Three step kinds through `ModelRunner.execute`: a decode step of `--batch`
sequences, a prefill of `--prefill-len` tokens, and a mixed step (the `--batch` decodes plus a
chunk of `--chunk` tokens of another request). Each kind is timed first eagerly (graphs not
captured), then after the same runner captured its decode and piecewise graphs: host wall time
per step (median of `--steps`, each step from its plan to its sampled tokens on the host), and,
eagerly, the GPU kernel time of one step summed from a torch.profiler trace. Wall far above the
kernel time means the step is bound by the host issuing launches. `--cprofile` also prints the
functions with the most own host time in one eager step of each kind.

    python3 kernels/bench_step_host.py --json $OUT/step_host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safeserve.config import ServerArgs  # noqa: E402
from safeserve.engine.model_runner import ModelRunner  # noqa: E402
from safeserve.engine.plan import SeqPlan, StepPlan  # noqa: E402
from safeserve.messages import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _kernel_ms(runner: ModelRunner, plan: StepPlan) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
        runner.execute(plan)
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in trace.key_averages()) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "kernels/configs/qwen3-30b-a3b"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    args = ServerArgs(
        model=opts.model,
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        max_running_requests=max(opts.batch, 8),
    )
    runner = ModelRunner(args, capture_cuda_graphs=False)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 16)
    # Sequences 0 .. batch-1 decode (one token more per step that has them); the prefills and
    # the mixed steps' chunks are first chunks of new requests, alternating between two
    # sequences each, whose cache they overwrite.
    blocks = (max(opts.prefill_len, opts.chunk) + 8 * opts.steps + 64) // args.block_size + 1
    steps = iter(range(1, 1 << 30))
    pos: dict[int, int] = {}
    turn = iter(range(1 << 30))

    def chunk(seq: int, n: int, start: int | None = None) -> SeqPlan:
        start = pos.get(seq, 0) if start is None else start
        pos[seq] = start + n
        ids = [(7 * j + seq) % 1000 for j in range(start, start + n)]
        return SeqPlan(ids, start, list(range(seq * blocks, (seq + 1) * blocks)), params, 0)

    for b in range(opts.batch):  # the decoding sequences' contexts
        runner.execute(StepPlan(next(steps), [[chunk(b, opts.prefill_len)]]))

    def decodes() -> list[SeqPlan]:
        return [chunk(b, 1) for b in range(opts.batch)]

    def new_request(first: int, n: int) -> SeqPlan:
        return chunk(first + next(turn) % 2, n, start=0)

    kinds = {
        f"decode x{opts.batch}": decodes,
        f"prefill {opts.prefill_len}": lambda: [new_request(opts.batch, opts.prefill_len)],
        f"mixed: {opts.batch} decodes + chunk {opts.chunk}": lambda: (
            decodes() + [new_request(opts.batch + 2, opts.chunk)]
        ),
    }
    rows: dict[str, dict] = {name: {} for name in kinds}
    for mode in ("eager", "graphs"):
        if mode == "graphs":
            runner.capture_cuda_graphs()
            assert runner.cuda_graphs is not None and runner.piecewise is not None
        for name, make in kinds.items():
            for _ in range(3):  # compiles, allocations
                runner.execute(StepPlan(next(steps), [make()]))
            walls = []
            for _ in range(opts.steps):
                plan = StepPlan(next(steps), [make()])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner.execute(plan)
                walls.append(1e3 * (time.perf_counter() - t0))
            row = rows[name]
            row[f"{mode}_wall_ms"] = statistics.median(walls)
            if mode == "eager":
                row["gpu_kernels_ms"] = _kernel_ms(runner, StepPlan(next(steps), [make()]))
                if opts.cprofile:
                    prof = cProfile.Profile()
                    plan = StepPlan(next(steps), [make()])
                    prof.enable()
                    runner.execute(plan)
                    prof.disable()
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
                    row["cprofile"] = text.getvalue()
                    print(f"== {name}, eager\n{row['cprofile']}")
            print(f"{mode:>6} {name}: wall {row[f'{mode}_wall_ms']:.2f} ms", flush=True)
    replays = (runner.cuda_graphs.replays, runner.piecewise.replays)
    print("| step | GPU kernels ms (eager) | eager wall ms | graphs wall ms | eager / graphs |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(
            f"| {name} | {r['gpu_kernels_ms']:.2f} | {r['eager_wall_ms']:.2f} | "
            f"{r['graphs_wall_ms']:.2f} | {r['eager_wall_ms'] / r['graphs_wall_ms']:.2f}× |"
        )
    print(f"replays (decode, piecewise): {replays}")
    if opts.json:
        out = {"args": {k: str(v) for k, v in vars(opts).items()}, "rows": rows}
        opts.json.write_text(json.dumps(out | {"replays": replays}, indent=2))


if __name__ == "__main__":
    main()
