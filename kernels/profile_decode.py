"""Where one decode step's time goes: the CUDA graph's kernels vs the host around them.

For each concurrency B: B prompts prefilled, then decode steps of all B through the engine's own
`ModelRunner.execute` (plan -> input copies -> graph replay -> logits -> sample -> `.tolist()`).
Measured per B:

* `step_ms`: host wall time of a whole `execute` (median of --steps),
* `replay_ms`: the decode graph's replay alone, CUDA events (median of --steps),
* `kernels`: a torch.profiler trace around --trace-steps whole steps: every GPU kernel's name,
  launches per step and time per step, grouped into families, plus host-side CPU ops. With
  dependent launches (the engine's default on Hopper) a kernel starts while the one before it
  runs and waits inside, so its span includes that wait: at small batches the per-kernel times
  then say little (RMSNorm showed 19.7 us a launch at concurrency 1). `--disable-pdl` profiles
  ordinary launches, whose times are each kernel's own (the step itself is slower).

Runs against whatever `safeserve` is importable (PYTHONPATH=<old tree> profiles a baseline):
it uses only `ModelRunner.execute` and `cuda_graphs.graphs` / `bucket_for`.

python3 kernels/profile_decode.py --concurrency 1,64 --json $OUT/profile.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import defaultdict

import torch

FAMILIES = [  # first match wins
    ("fused_moe", r"moe|_gate_up|_down|_align|_sum_topk|topk_sum"),
    ("router + top-k", r"_router_topk|topk_softmax"),
    ("rms_norm (fused)", r"_rms_norm_kernel"),
    ("q|k|v + qk norm/RoPE/store (fused)", r"_skinny_qkv"),
    ("qk_norm_rope_store (fused)", r"_qk_norm_rope"),
    ("linear (skinny)", r"_skinny_linear"),
    ("decode attention", r"_decode|_merge"),
    ("kv store", r"_store_kv"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|sm90|gemv|splitK|ampere"),
    ("argmax/reduce", r"reduce|argmax|ArgMax"),
    ("copy/cast", r"copy|Copy|cast|to_|convert"),
    ("cat", r"[Cc]at"),
    ("elementwise", r"elementwise|vectorized|unrolled|Elementwise"),
    ("index", r"index|gather|scatter|Index"),
    ("memcpy/memset", r"Memcpy|Memset|memcpy|memset"),
]


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name):
            return fam
    return "other"


def build_runner(  # type: ignore[no-untyped-def]
    model: str,
    max_bs: int,
    max_len: int,
    device: str,
    disable_pdl: bool = False,
    deterministic: bool = False,
):
    from safeserve.config import ServerArgs
    from safeserve.engine.model_runner import ModelRunner

    args = ServerArgs(
        model=model,
        load_format="dummy",
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        max_model_len=max_len,
        max_running_requests=max_bs,
        cuda_graph_max_bs=max_bs,
        disable_pdl=disable_pdl,
        enable_deterministic_inference=deterministic,
    )
    return ModelRunner(args)


def decode_plans(runner, batch: int, input_len: int, steps: int):  # type: ignore[no-untyped-def]
    """Prefills `batch` prompts; yields decode plans one step at a time (tokens fed back)."""
    from safeserve.engine.kv_cache import new_table_id
    from safeserve.engine.plan import SeqPlan, StepPlan
    from safeserve.messages import SamplingParams

    bsz = runner.args.block_size
    per_req = (input_len + steps + 2 + bsz - 1) // bsz
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(batch)]
    ids = [new_table_id() for _ in range(batch)]  # as the server's: only new entries go up
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    vocab = runner.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, input_len), generator=gen).tolist()
    last = []
    for i in range(batch):  # one prompt per step keeps prefill inside the token budget
        plan = StepPlan(step=i, per_rank=[[SeqPlan(prompts[i], 0, tables[i], params)]])
        last.extend(runner.execute(plan))
    for j in range(steps):
        pos = input_len + j
        seqs = [SeqPlan([last[i]], pos, tables[i], params, j + 1, ids[i]) for i in range(batch)]
        plan = StepPlan(step=batch + j, per_rank=[seqs])
        last = yield plan
        assert last is not None and len(last) == batch


def profile_point(runner, batch: int, input_len: int, steps: int, trace_steps: int) -> dict:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    graphs = runner.cuda_graphs
    bucket = graphs.bucket_for(batch) if graphs is not None else None
    total = 5 + steps + trace_steps
    gen = decode_plans(runner, batch, input_len, total + 1)
    plan = next(gen)
    step_s: list[float] = []

    cuda = runner.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step(p):  # type: ignore[no-untyped-def]
        sync()
        t0 = time.perf_counter()
        out = runner.execute(p)
        step_s.append(time.perf_counter() - t0)
        return out

    for _ in range(5 + steps):
        plan = gen.send(step(plan))
    step_s = step_s[5:]
    replay_ms: list[float] = []
    if bucket is not None:
        graph = graphs.graphs[bucket]
        for _ in range(steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            replay_ms.append(a.elapsed_time(b))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(trace_steps):
            plan = gen.send(step(plan))
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    host_ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        dev = getattr(ev, "device_type", None)
        if dev is not None and dev.name == "CUDA":
            k = kernels[ev.name]
            k[0] += 1
            k[1] += ev.time_range.elapsed_us()
        elif ev.cpu_parent is None:
            h = host_ops[ev.name]
            h[0] += 1
            h[1] += ev.cpu_time_total
    per_step = {
        name: {"launches": n / trace_steps, "us": us / trace_steps, "family": family(name)}
        for name, (n, us) in kernels.items()
    }
    fams: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for k in per_step.values():
        fams[k["family"]][0] += k["launches"]
        fams[k["family"]][1] += k["us"]
    top_host = sorted(host_ops.items(), key=lambda kv: -kv[1][1])[:12]
    return {
        "concurrency": batch,
        "graph_bucket": bucket,
        "step_ms": statistics.median(step_s) * 1e3,
        "replay_ms": statistics.median(replay_ms) if replay_ms else None,
        "kernel_us_per_step": sum(k["us"] for k in per_step.values()),
        "launches_per_step": sum(k["launches"] for k in per_step.values()),
        "families": {f: {"launches": v[0], "us": v[1]} for f, v in fams.items()},
        "kernels": dict(sorted(per_step.items(), key=lambda kv: -kv[1]["us"])[:40]),
        "host_top_level_ops_us": {n: v[1] / trace_steps for n, v in top_host},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kernels/configs/qwen3-30b-a3b")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--trace-steps", type=int, default=3)
    ap.add_argument("--label", default="current")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument(
        "--disable-pdl",
        action="store_true",
        help="launch kernels as ordinary launches: with dependent launches (the engine's "
        "default) each kernel's span in the trace includes its wait for the one before, so "
        "per-kernel times are only meaningful with this flag (the step itself is slower)",
    )
    ap.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="the batch-invariant kernels (serve's flag of that name)",
    )
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    conc = [int(c) for c in ns.concurrency.split(",")]
    length = ns.input_len + 5 + ns.steps + ns.trace_steps + 16
    runner = build_runner(
        ns.model, max(conc), length, ns.device, ns.disable_pdl, ns.enable_deterministic_inference
    )
    points = [profile_point(runner, b, ns.input_len, ns.steps, ns.trace_steps) for b in conc]
    name = torch.cuda.get_device_name() if ns.device == "cuda" else "cpu"
    result = {"label": ns.label, "device": name, "disable_pdl": ns.disable_pdl, "points": points}
    for p in points:
        print(
            f"\n[{ns.label}] concurrency {p['concurrency']}: step {p['step_ms']:.3f} ms, "
            f"graph replay {p['replay_ms'] or float('nan'):.3f} ms, kernels "
            f"{p['kernel_us_per_step'] / 1e3:.3f} ms in {p['launches_per_step']:.0f} launches"
        )
        for f, v in sorted(p["families"].items(), key=lambda kv: -kv[1]["us"]):
            print(f"  {f:28s} {v['launches']:7.0f} launches {v['us']:9.1f} us")
        for name, k in list(p["kernels"].items())[:8]:
            print(f"    {k['us']:8.1f} us {k['launches']:5.0f}x {name[:90]}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
