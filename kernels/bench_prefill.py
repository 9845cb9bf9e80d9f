"""Where a long prompt's prefill time goes: one prompt's chunk steps through the engine's own
`ModelRunner.execute`, as the server runs them (chunks of --chunk tokens, each attending over the
chunks before it; the last one samples).

* `chunk_ms`: host wall time of each chunk step, synchronized (median over --runs prompts);
  `total_ms`: their sum, the prompt's prefill time without queueing;
* with --profile: a torch.profiler trace of one more prompt, GPU kernel time by family (the
  families of kernels/profile_decode.py, plus the paged prefill attention). Dependent launches
  (the default on Hopper) make a kernel's span include its wait for the one before, so
  --disable-pdl gives each kernel's own time (the steps are then a little slower).

Runs against whatever `safeserve` is importable (PYTHONPATH=<old tree> measures a baseline).

    python3 kernels/bench_prefill.py --prompt-len 8192,32768 [--chunk 2048] [--profile]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_decode import FAMILIES, build_runner, family  # noqa: E402

FAMILIES.insert(0, ("prefill attention", r"_prefill_kernel"))


def prefill_steps(runner, prompt: list[int], chunk: int, table: list[int]):  # type: ignore[no-untyped-def]
    """One plan per chunk of the prompt, in order."""
    from safeserve.engine.plan import SeqPlan, StepPlan
    from safeserve.messages import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for start in range(0, len(prompt), chunk):
        last = start + chunk >= len(prompt)
        seq = SeqPlan(prompt[start : start + chunk], start, table, params if last else None)
        yield StepPlan(step=0, per_rank=[[seq]])


def run_prompt(runner, prompt: list[int], chunk: int, table: list[int]) -> list[float]:  # type: ignore[no-untyped-def]
    cuda = runner.device.type == "cuda"
    times = []
    for plan in prefill_steps(runner, prompt, chunk, table):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.execute(plan)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def profile_prompt(runner, prompt: list[int], chunk: int, table: list[int]) -> dict:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if runner.device.type == "cuda" else []
    )
    with profile(activities=acts) as prof:
        run_prompt(runner, prompt, chunk, table)
    fams: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        dev = getattr(ev, "device_type", None)
        if dev is not None and dev.name == "CUDA":
            f = fams[family(ev.name)]
            f[0] += 1
            f[1] += ev.time_range.elapsed_us()
    return {f: {"launches": n, "ms": us / 1e3} for f, (n, us) in fams.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kernels/configs/qwen3-30b-a3b")
    ap.add_argument("--prompt-len", default="8192")
    ap.add_argument("--chunk", type=int, default=2048, help="tokens per step (the server's "
                    "--max-num-batched-tokens)")  # fmt: skip
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--disable-pdl", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    lens = [int(v) for v in ns.prompt_len.split(",")]
    runner = build_runner(ns.model, 4, max(lens) + 64, ns.device, ns.disable_pdl)
    bsz = runner.args.block_size
    points = []
    for n in lens:
        table = list(range((n + bsz - 1) // bsz))
        gen = torch.Generator().manual_seed(n)
        prompt = torch.randint(0, runner.config.vocab_size, (n,), generator=gen).tolist()
        run_prompt(runner, prompt, ns.chunk, table)  # warm-up
        runs = [run_prompt(runner, prompt, ns.chunk, table) for _ in range(ns.runs)]
        chunk_ms = [statistics.median(r[i] for r in runs) for i in range(len(runs[0]))]
        point = {"prompt_len": n, "chunk": ns.chunk, "total_ms": sum(chunk_ms),
                 "totals_ms": [sum(r) for r in runs], "chunk_ms": chunk_ms}  # fmt: skip
        if ns.profile:
            point["kernels"] = profile_prompt(runner, prompt, ns.chunk, table)
        points.append(point)
        print(
            f"prompt {n}: prefill {point['total_ms']:.1f} ms in {len(chunk_ms)} chunks of "
            f"{ns.chunk} (runs {', '.join(f'{t:.1f}' for t in point['totals_ms'])}); first "
            f"{chunk_ms[0]:.2f} ms, last {chunk_ms[-1]:.2f} ms",
            flush=True,
        )
        for f, v in sorted(point.get("kernels", {}).items(), key=lambda kv: -kv[1]["ms"]):
            print(f"  {f:36s} {v['launches']:6d} launches {v['ms']:9.2f} ms")
    if ns.json:
        name = torch.cuda.get_device_name() if ns.device == "cuda" else "cpu"
        Path(ns.json).write_text(
            json.dumps({"device": name, "disable_pdl": ns.disable_pdl, "points": points}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
