"""Our engine: prefill, then lock-step decode through its own `ModelRunner`, timed and counted."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from safeserve.bench.floor import ModelBytes, RoutingProbe, _sync
from safeserve.bench.options import BenchOptions, progress
from safeserve.config import ServerArgs


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=gen).tolist()


def _run_point(
    runner: Any,
    probe: RoutingProbe | None,
    sizes: ModelBytes | None,
    prompts: list[list[int]],
    output_len: int,
    step_base: int,
    report: Callable[[str], None] | None = None,
) -> dict:
    """Prefill then decode `len(prompts)` requests in lock-step; every time and byte count."""
    from safeserve.engine.kv_cache import new_table_id
    from safeserve.engine.plan import SeqPlan, StepPlan
    from safeserve.messages import SamplingParams

    args, device = runner.args, runner.device
    batch = len(prompts)
    bsz = args.block_size
    per_req = (len(prompts[0]) + output_len + bsz - 1) // bsz
    if batch * per_req > runner.num_blocks:
        raise RuntimeError(
            f"concurrency {batch} needs {batch * per_req} KV blocks; the cache has "
            f"{runner.num_blocks} (raise --num-kv-blocks or --mem-fraction-static)"
        )
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(batch)]
    table_ids = [new_table_id() for _ in range(batch)]  # as the server's: fixed for the run
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    step = step_base
    outputs: list[list[int]] = [[] for _ in range(batch)]

    _sync(device)
    t_start = time.perf_counter()
    # Prefill: whole prompts (or chunks of them) packed up to the step's token budget.
    budget, chunk = args.max_num_batched_tokens, args.prefill_chunk
    pending = [(i, 0) for i in range(batch)]
    while pending:
        seqs, owners, used = [], [], 0
        while pending and used < budget:
            i, start = pending.pop(0)
            n = min(chunk, budget - used, len(prompts[i]) - start)
            done = start + n == len(prompts[i])
            seqs.append(
                SeqPlan(prompts[i][start : start + n], start, tables[i], params if done else None)
            )
            used += n
            if not done:  # the rest of this prompt goes first in the next step
                pending.insert(0, (i, start + n))
                break
            owners.append(i)
        tokens = runner.execute(StepPlan(step=step, per_rank=[seqs]))
        step += 1
        for i, tok in zip(owners, tokens, strict=True):
            outputs[i].append(tok)
    _sync(device)
    t_first = time.perf_counter()

    step_times: list[float] = []
    step_bytes: list[int] = []
    expert_counts: list[float] = []
    routing: torch.Tensor | None = None  # [L, E] choices per logical expert over the steps
    graphs = runner.cuda_graphs
    replays_before = graphs.replays if graphs is not None else 0
    for j in range(1, output_len):
        pos = len(prompts[0]) + j - 1
        seqs = [
            SeqPlan([outputs[i][-1]], pos, tables[i], params, j, table_ids[i]) for i in range(batch)
        ]
        bucket = graphs.bucket_for(batch) if graphs is not None and graphs.can_run(seqs) else None
        t0 = time.perf_counter()
        tokens = runner.execute(StepPlan(step=step, per_rank=[seqs]))  # ends in a host sync
        step_times.append(time.perf_counter() - t0)
        step += 1
        for i, tok in enumerate(tokens):
            outputs[i].append(tok)
        if probe is not None and sizes is not None:
            experts = probe.experts_read(batch, bucket)
            expert_counts.append(sum(experts) / max(1, len(experts)))
            counts = probe.logical_counts(batch, bucket)
            routing = counts if routing is None else routing + counts
            kv = sizes.kv_token * batch * (pos + 1)
            step_bytes.append(
                sizes.dense + batch * sizes.embed_row + sum(experts) * sizes.expert + kv
            )
        if report is not None and (j % 32 == 0 or j == output_len - 1):
            report(f"decode {j}/{output_len - 1}")
    t_end = time.perf_counter()
    return {
        "concurrency": batch,
        "ttft_s": t_first - t_start,
        "total_s": t_end - t_start,
        "step_times_s": step_times,
        "step_bytes": step_bytes,
        "experts_per_layer": expert_counts,
        "routing": routing,
        "steps": step - step_base,
        "outputs": outputs,
        "graph_replays": (graphs.replays - replays_before) if graphs is not None else 0,
    }


def _summarize(raw: dict, output_len: int, ceiling: float) -> dict:
    batch = raw["concurrency"]
    steps = raw["step_times_s"]
    decode_s = sum(steps)
    point = {
        "concurrency": batch,
        "ttft_ms": raw["ttft_s"] * 1e3,
        "tpot_ms": decode_s / len(steps) * 1e3,
        "output_tok_s": batch * output_len / raw["total_s"],
        "decode_tok_s": batch * len(steps) / decode_s,
        "decode_step_ms": statistics.median(steps) * 1e3,
        "decode_step_mean_ms": statistics.mean(steps) * 1e3,
        # decode steps of this point that replayed a captured CUDA graph (of len(steps))
        "decode_graph_replays": raw["graph_replays"],
    }
    if raw["step_bytes"]:
        mean_bytes = statistics.mean(raw["step_bytes"])
        floor_ms = mean_bytes / ceiling * 1e3
        achieved = mean_bytes / statistics.mean(steps)
        point.update(
            step_bytes=mean_bytes,
            experts_per_layer=statistics.mean(raw["experts_per_layer"]),
            floor_ms=floor_ms,
            achieved_gbs=achieved / 1e9,
            ceiling_share=achieved / ceiling,
            step_over_floor=statistics.mean(steps) * 1e3 / floor_ms,
        )
    return point


def run_engine(
    args: ServerArgs, opts: BenchOptions, ceiling: float
) -> tuple[dict, Any, torch.Tensor | None]:
    """The measured points and model facts, the runner, and the decode steps' routing: choices
    per MoE layer and logical expert, over every point (None without MoE layers)."""
    from safeserve.engine.model_runner import ModelRunner

    progress(f"loading {args.model} ({args.load_format}, {args.dtype}) on {args.device}")
    t0 = time.perf_counter()
    runner = ModelRunner(args, capture_cuda_graphs=False)
    probe = RoutingProbe.of_runner(
        runner
    )  # before capture: the hooks must see each graph's outputs
    runner.capture_cuda_graphs()
    progress(
        f"ready in {time.perf_counter() - t0:.1f} s: {runner.num_blocks} KV blocks, "
        f"max model length {runner.max_model_len}, "
        f"CUDA graphs {'on' if runner.cuda_graphs is not None else 'off'}"
    )
    sizes = ModelBytes.of(runner)
    vocab = runner.config.vocab_size
    prompts = make_prompts(max(opts.concurrency), opts.input_len, vocab, args.seed)
    step = 0
    # Warm-up: every batch shape once, so that kernel compiles stay out of the timings.
    for batch in sorted(set(opts.concurrency)):
        raw = _run_point(runner, None, None, prompts[:batch], 3, step)
        step += raw["steps"]
    progress("warm-up done")
    points = []
    routing: torch.Tensor | None = None
    for batch in opts.concurrency:
        label = f"concurrency {batch}"
        progress(f"{label}: prefill {batch} x {opts.input_len} tokens")
        raw = _run_point(
            runner,
            probe,
            sizes,
            prompts[:batch],
            opts.output_len,
            step,
            report=lambda m, label=label: progress(f"{label}: {m}"),
        )
        step += raw["steps"]
        if raw["routing"] is not None:
            routing = raw["routing"] if routing is None else routing + raw["routing"]
        point = _summarize(raw, opts.output_len, ceiling)
        points.append(point)
        progress(
            f"{label}: TPOT {point['tpot_ms']:.2f} ms, {point['output_tok_s']:.0f} tok/s, "
            f"step {point['decode_step_ms']:.2f} ms = {point['step_over_floor']:.2f}x floor"
        )
    probe.remove()
    params = {id(p): p for p in runner.model.parameters()}.values()
    info = {
        "weights_bytes": sum(p.numel() * p.element_size() for p in params),
        "device_memory_bytes": (
            torch.cuda.mem_get_info(runner.device)[1] if runner.device.type == "cuda" else None
        ),
        "dense_bytes": sizes.dense,
        "expert_bytes": sizes.expert,
        "kv_bytes_per_token": sizes.kv_token,
        "cuda_graphs": runner.cuda_graphs is not None,
        "num_kv_blocks": runner.num_blocks,
        "dispatch_budget_tokens": (
            runner.buffers.max_recv_tokens if runner.buffers is not None else None
        ),
        "max_model_len": runner.max_model_len,
    }
    return {"points": points, "model_bytes": info}, runner, routing
