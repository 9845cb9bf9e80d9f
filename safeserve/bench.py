"""`safeserve bench`: offline, in-process decode benchmark against the memory floor.

For each concurrency B the bench prefills B prompts of `--input-len` random tokens, then decodes
`--output-len` tokens for all of them in lock-step through the engine's own `ModelRunner` (the
same forward, kernels, CUDA graphs and sampler as `serve`). Each decode step's bytes are what it
must read from memory: the dense weights, the experts the step's routing actually selected in
each MoE layer (read from the router outputs of that very step), and the KV cache of every
sequence. Bytes over the HBM read ceiling, which the bench measures at start (a large bf16 sum),
give the floor; step time over floor says how close to the hardware a step runs.

`--peer transformers` runs Hugging Face transformers' own model of the same config on the same
prompts, in the same process, as the side-by-side.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from safeserve.config import ServerArgs

PEERS = ("none", "transformers")


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Every serve flag (model, device, dtype, KV cache, ...) plus the bench's own."""
    ServerArgs.add_cli_args(parser)
    g = parser.add_argument_group("bench")
    g.add_argument(
        "--concurrency", default="1,2,4,8,16,32,64", help="Comma-separated batch sizes to run."
    )
    g.add_argument("--input-len", type=int, default=512, help="Prompt tokens per request.")
    g.add_argument("--output-len", type=int, default=128, help="Generated tokens per request.")
    g.add_argument(
        "--peer", default="none", choices=PEERS, help="Also run this implementation (same config)."
    )
    g.add_argument(
        "--peer-concurrency",
        default=None,
        help="Batch sizes for the peer (default: the first and last of --concurrency).",
    )
    g.add_argument(
        "--peer-output-len",
        type=int,
        default=None,
        help="Generated tokens per request for the peer (default: --output-len).",
    )
    g.add_argument(
        "--ceiling-gib",
        type=float,
        default=None,
        help="Size of the HBM read-ceiling test tensor (default: 4 on CUDA, 0.25 on CPU).",
    )
    g.add_argument("--json", default=None, help="Write every number to this file.")


@dataclasses.dataclass
class BenchOptions:
    concurrency: list[int]
    input_len: int
    output_len: int
    peer: str = "none"
    peer_concurrency: list[int] | None = None
    peer_output_len: int | None = None
    ceiling_gib: float | None = None
    json_path: str | None = None

    @staticmethod
    def from_namespace(ns: argparse.Namespace) -> BenchOptions:
        def ints(text: str) -> list[int]:
            values = [int(x) for x in text.split(",") if x.strip()]
            if not values or min(values) < 1:
                raise ValueError(f"expected positive comma-separated integers, got {text!r}")
            return values

        opts = BenchOptions(
            concurrency=ints(ns.concurrency),
            input_len=ns.input_len,
            output_len=ns.output_len,
            peer=ns.peer,
            peer_concurrency=ints(ns.peer_concurrency) if ns.peer_concurrency else None,
            peer_output_len=ns.peer_output_len,
            ceiling_gib=ns.ceiling_gib,
            json_path=ns.json,
        )
        if opts.input_len < 1 or opts.output_len < 2:
            raise ValueError("--input-len must be >= 1 and --output-len >= 2")
        return opts


def bench_server_args(args: ServerArgs, opts: BenchOptions) -> ServerArgs:
    """Room for the largest batch at full length; context just long enough unless given."""
    need_len = opts.input_len + opts.output_len
    max_len = args.max_model_len or need_len
    if max_len < need_len:
        raise ValueError(f"--max-model-len {max_len} < input + output = {need_len}")
    return dataclasses.replace(
        args,
        max_model_len=max_len,
        max_running_requests=max(args.max_running_requests, max(opts.concurrency)),
    )


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_read_ceiling(device: torch.device, gib: float, repeats: int = 10) -> float:
    """Bytes/s of a large bf16 sum (reads every byte once): the HBM (or DRAM) read ceiling."""
    n = int(gib * (1 << 30)) // 2
    x = torch.empty(n, dtype=torch.bfloat16, device=device)
    x.uniform_(-1, 1)  # never time on zeros
    times = []
    for i in range(repeats + 2):
        _sync(device)
        t0 = time.perf_counter()
        x.sum(dtype=torch.float32)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del x
    return n * 2 / statistics.median(times)


class RoutingProbe:
    """Reads which experts each MoE layer's router chose in the last step.

    Forward hooks see eager steps; a CUDA graph's replays run no Python, so the hooks also keep,
    per graph and bucket, the router outputs recorded while it was captured: their memory is the
    graph's and holds each replay's routing. The runner captures its decode graphs first
    (`runner.cuda_graphs` is set once they all are), then its piecewise graphs (whose token
    buckets overlap the decode batch buckets): a step reads the record of what ran it.
    """

    def __init__(self, model: torch.nn.Module, num_experts: int, runner: Any = None) -> None:
        self.runner = runner
        self.num_experts = num_experts
        self.eager: dict[int, torch.Tensor] = {}
        self.captured: dict[str, dict[int, dict[int, torch.Tensor]]] = {
            "decode": {},
            "piecewise": {},
        }
        self.handles = []
        moe = [layer for layer in model.layers if layer.is_moe]
        for i, layer in enumerate(moe):
            self.handles.append(layer.mlp.gate.register_forward_hook(self._hook(i)))
        self.num_layers = len(moe)

    def _hook(self, index: int) -> Callable:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            ids = output.topk_ids
            if ids.is_cuda and torch.cuda.is_current_stream_capturing():
                kind = (
                    "decode" if getattr(self.runner, "cuda_graphs", None) is None else "piecewise"
                )
                self.captured[kind].setdefault(ids.shape[0], {})[index] = ids
            else:
                self.eager[index] = ids

        return hook

    def experts_read(self, batch: int, graph_bucket: int | None) -> list[int]:
        """Distinct experts of each MoE layer among the real `batch` rows of the last step."""
        from safeserve.engine.cuda_graph import smallest_bucket

        piecewise = getattr(self.runner, "piecewise", None)
        if graph_bucket is not None:
            src = self.captured["decode"][graph_bucket]
        elif piecewise is not None and piecewise.can_run(batch):  # one token per sequence
            src = self.captured["piecewise"][smallest_bucket(piecewise.buckets, batch)]
        else:
            src = self.eager
        ids = torch.stack([src[i][:batch] for i in range(self.num_layers)])  # [L, B, k]
        flat = ids.reshape(self.num_layers, -1)
        seen = torch.zeros(self.num_layers, self.num_experts + 1, dtype=torch.bool)
        # -1 (no expert) lands in the extra last column, which is not counted.
        seen.scatter_(1, flat.cpu().where(flat.cpu() >= 0, self.num_experts), True)
        return seen[:, : self.num_experts].sum(dim=1).tolist()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@dataclasses.dataclass
class ModelBytes:
    """What one decode step must read, by part."""

    dense: int  # every weight except the experts and the embedding table
    embed_row: int  # one embedding row (a step reads B of them)
    expert: int  # one expert of one layer (gate + up + down)
    kv_token: int  # K and V of one token over all layers

    @staticmethod
    def of(runner: Any) -> ModelBytes:
        model = runner.model
        expert_ids: set[int] = set()
        expert_bytes = 0
        for layer in model.layers:
            if layer.is_moe:
                ex = layer.mlp.experts
                expert_ids.update({id(ex.w13), id(ex.w2)})
                expert_bytes = (ex.w13[0].numel() + ex.w2[0].numel()) * ex.w13.element_size()
        embed = model.embed_tokens.weight
        tied = model.lm_head.weight is embed
        dense = 0
        seen: set[int] = set()
        for p in model.parameters():
            if id(p) in seen or id(p) in expert_ids or (p is embed and not tied):
                continue
            seen.add(id(p))
            dense += p.numel() * p.element_size()
        k_cache = runner.kv.layers[0][0]
        kv_token = 2 * len(runner.kv.layers) * k_cache[0].numel() * k_cache.element_size()
        return ModelBytes(dense, embed[0].numel() * embed.element_size(), expert_bytes, kv_token)


# ---------------------------------------------------------------------------------------------
# Our engine
# ---------------------------------------------------------------------------------------------


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
    graphs = runner.cuda_graphs
    for j in range(1, output_len):
        pos = len(prompts[0]) + j - 1
        seqs = [
            SeqPlan([outputs[i][-1]], pos, tables[i], params, output_index=j) for i in range(batch)
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
        "steps": step - step_base,
        "outputs": outputs,
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


def run_engine(args: ServerArgs, opts: BenchOptions, ceiling: float) -> tuple[dict, Any]:
    from safeserve.engine.model_runner import ModelRunner

    progress(f"loading {args.model} ({args.load_format}, {args.dtype}) on {args.device}")
    t0 = time.perf_counter()
    runner = ModelRunner(args, capture_cuda_graphs=False)
    probe = RoutingProbe(
        runner.model, runner.config.num_experts, runner
    )  # before capture: the hooks must see each graph's outputs
    runner.capture_cuda_graphs()
    progress(
        f"ready in {time.perf_counter() - t0:.1f} s: {runner.num_blocks} KV blocks, "
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
        point = _summarize(raw, opts.output_len, ceiling)
        points.append(point)
        progress(
            f"{label}: TPOT {point['tpot_ms']:.2f} ms, {point['output_tok_s']:.0f} tok/s, "
            f"step {point['decode_step_ms']:.2f} ms = {point['step_over_floor']:.2f}x floor"
        )
    probe.remove()
    info = {
        "dense_bytes": sizes.dense,
        "expert_bytes": sizes.expert,
        "kv_bytes_per_token": sizes.kv_token,
        "cuda_graphs": runner.cuda_graphs is not None,
        "num_kv_blocks": runner.num_blocks,
    }
    return {"points": points, "model_bytes": info}, runner


# ---------------------------------------------------------------------------------------------
# The peer: Hugging Face transformers
# ---------------------------------------------------------------------------------------------


def _hf_config(model: str) -> Any:
    from transformers import AutoConfig, Qwen3MoeConfig

    from safeserve.config import TINY_MODEL
    from safeserve.model.loader import TINY_CONFIG

    if model == TINY_MODEL:
        cfg = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
        return Qwen3MoeConfig(**cfg)
    return AutoConfig.from_pretrained(model)


def run_transformers(
    args: ServerArgs, prompts: list[list[int]], concurrency: list[int], output_len: int
) -> list[dict]:
    """transformers' model of the same config (random weights), greedy, its own KV cache."""
    from transformers import AutoModelForCausalLM

    from safeserve.model.loader import DTYPES

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    progress(f"peer transformers: building {args.model} on {device}")
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_hf_config(args.model), dtype=DTYPES[args.dtype])
    model.eval()
    points = []
    with torch.inference_mode():
        for batch in [concurrency[0], *concurrency]:  # the first run is a warm-up
            ids = torch.tensor(prompts[:batch], device=device)
            _sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            t_first = time.perf_counter()
            steps = []
            for _ in range(output_len - 1):
                s0 = time.perf_counter()
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                nxt.cpu()  # the engine's sampler syncs the same way
                steps.append(time.perf_counter() - s0)
            t_end = time.perf_counter()
            points.append(
                {
                    "concurrency": batch,
                    "ttft_ms": (t_first - t0) * 1e3,
                    "tpot_ms": statistics.mean(steps) * 1e3,
                    "decode_step_ms": statistics.median(steps) * 1e3,
                    "output_tok_s": batch * output_len / (t_end - t0),
                    "decode_tok_s": batch * len(steps) / sum(steps),
                }
            )
            del past, out
            progress(
                f"peer transformers: concurrency {batch}: step {points[-1]['decode_step_ms']:.2f} ms"
            )
    del model
    gc.collect()
    return points[1:]


# ---------------------------------------------------------------------------------------------
# Entry
# ---------------------------------------------------------------------------------------------


def check_one_rank(args: ServerArgs) -> None:
    """The bench runs one rank in this process; a group of several is another script's."""
    if args.tp_size != 1:
        raise ValueError(
            "safeserve bench runs one rank (--tp-size 1); for a multi-GPU group run "
            "kernels/bench_tp_decode.py with the same layout flags (one engine rank per GPU, "
            "decode steps eagerly and as CUDA graphs)"
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
    ours, runner = run_engine(args, opts, ceiling)
    result.update(ours)
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

    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s [bench] %(levelname)s %(name)s: %(message)s"
    )
    try:
        args = ServerArgs.from_cli_args(ns)
        opts = BenchOptions.from_namespace(ns)
        check_one_rank(args)
    except (ConfigError, ValueError) as e:
        print(f"safeserve bench: error: {e}", file=sys.stderr)
        return 2
    result = run_bench(args, opts)
    print(format_table(result), flush=True)
    if opts.json_path:
        Path(opts.json_path).write_text(json.dumps(result, indent=1))
        progress(f"wrote {opts.json_path}")
    return 0
