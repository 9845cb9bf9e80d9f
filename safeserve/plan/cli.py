"""`safeserve plan`: its flags, its bad-input checks, and the guard policy it writes."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from safeserve.config import DTYPES, ConfigError, ServerArgs
from safeserve.config_cli import add_server_args, check_output_file
from safeserve.model import registry
from safeserve.model.checkpoint import LoadError, load_model_config
from safeserve.model.config import ModelConfig, ModelConfigError
from safeserve.plan.arithmetic import selection_probs
from safeserve.plan.gpus import PlanError, gpu_names, load_gpu
from safeserve.plan.model import KV_CACHE_DTYPES, QUANTIZATIONS, ModelFacts
from safeserve.plan.planner import (
    MIN_STALL_S,
    STALL_FACTOR,
    LayoutPlan,
    Plan,
    Workload,
    longest_step_s,
    plan,
    size_rank,
    stall_timeout_s,
)
from safeserve.plan.report import text, to_json

# The serve flags that change what a rank allocates: the planner sizes with the same values.
SIZING_FLAGS = {
    "max_model_len",
    "block_size",
    "max_running_requests",
    "max_num_batched_tokens",
    "chunked_prefill_size",
    "num_kv_blocks",
    "kv_cache_memory_gb",
    "mem_fraction_static",
    "dispatch_budget_tokens",
    "dispatch_memory_gb",
    "prefill_sizing",
}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("plan")
    g.add_argument("--model", required=True, help="A checkpoint directory or its config.json.")
    g.add_argument(
        "--gpu", required=True, help=f"GPU model of the deployment ({', '.join(gpu_names())})."
    )
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default: 8).")
    g.add_argument("--nodes", type=int, default=1, help="Nodes (default: 1).")
    g.add_argument(
        "--tpot-target-ms",
        type=float,
        default=None,
        help="Time per output token to meet at the largest --concurrency.",
    )
    g.add_argument(
        "--concurrency",
        default="1,8,16,32,64,128,256",
        help="Comma-separated requests decoding at once over the service.",
    )
    g.add_argument("--input-len", type=int, default=512, help="Prompt tokens per request.")
    g.add_argument("--output-len", type=int, default=128, help="Generated tokens per request.")
    g.add_argument(
        "--expert-distribution",
        default=None,
        help="Recorded routing (a file of POST /admin/expert_distribution/dump or "
        "`safeserve bench --expert-distribution-out`) instead of uniform routing.",
    )
    g.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPES),
        help="Weight, activation and KV dtype (default: bfloat16 on GPUs, float32 on cpu).",
    )
    g.add_argument(
        "--quantization",
        default="none",
        choices=list(QUANTIZATIONS),
        help="'fp8': linear weights block-quantized to FP8 (128 x 128 blocks, float32 "
        "scales), as DeepSeek-V3's checkpoints (an FP8 checkpoint needs no flag). Bytes "
        "only: the calibration is bf16's.",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="'auto': the model's dtype; 'fp8' (or 'fp8_e4m3'): one byte per element, as "
        "serve's --kv-cache-dtype of the same name (float8_e4m3fn) stores it.",
    )
    g.add_argument("-o", "--output", default="table", choices=("table", "json"))
    g.add_argument(
        "--write-policy",
        default=None,
        metavar="FILE",
        help="Write the recommended layout's guard policy preset (TOML) for "
        "`safeserve serve --guard-policy`.",
    )
    add_server_args(parser, only=SIZING_FLAGS)


def read_config(model: str) -> ModelConfig:
    """The family config of a checkpoint directory or of a config.json file."""
    path = Path(model)
    if path.is_file():
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}: not JSON ({e})") from e
        return registry.parse_config(d)
    return load_model_config(model)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise PlanError(f"{flag} takes comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise PlanError(f"{flag} takes positive integers, got {text!r}")
    return values


def read_distribution(path: str, facts: ModelFacts) -> list[list[float]]:
    """Per MoE layer and expert, the probability a token chooses it, from a dumped file;
    PlanError where the file is of another model."""
    from safeserve.moe.eplb.distribution import read_expert_distribution

    try:
        counts = read_expert_distribution(
            path, num_layers=facts.moe_layers, num_logical_experts=facts.cfg.num_experts
        )
    except (OSError, ValueError) as e:
        raise PlanError(f"--expert-distribution: {e}") from e
    k = facts.cfg.num_experts_per_tok
    try:
        return [selection_probs(row, k) for row in counts.tolist()]
    except ValueError as e:
        raise PlanError(f"--expert-distribution {path}: {e}") from e


def sizing_args(ns: argparse.Namespace, dtype: str, **override: Any) -> ServerArgs:
    kw = {name: getattr(ns, name) for name in SIZING_FLAGS}
    kw.update(override)
    return ServerArgs(dtype=dtype, **kw)


# Presets turn the canary on (the server's default is off): a device computing wrong results is
# fenced within two intervals, for one short greedy request per group this often.
PRESET_CANARY_INTERVAL_S = 30.0


def policy_values(lp: LayoutPlan, args: ServerArgs, cpu: bool) -> dict[str, Any]:
    """The preset of a layout: what its ranks were sized with and the guards' sizes."""
    s = lp.sizing
    pre = s.prefill
    out: dict[str, Any] = {
        "max_running_requests": args.max_running_requests,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "mem_fraction_static": args.mem_fraction_static,
        "prefill_sizing": args.prefill_sizing,
    }
    if cpu:  # CPU ranks are sized by these, not by device memory
        out.update(
            kv_cache_memory_gb=args.kv_cache_memory_gb, dispatch_memory_gb=args.dispatch_memory_gb
        )
    if args.num_kv_blocks is not None:
        out["num_kv_blocks"] = args.num_kv_blocks
    if s.dispatch_budget is not None:
        out["dispatch_budget_tokens"] = s.dispatch_budget
    if pre is not None:
        out["chunked_prefill_size"] = pre.chunk
    out["canary_interval_s"] = PRESET_CANARY_INTERVAL_S
    return out


def run_plan(ns: argparse.Namespace) -> int:
    try:
        gpu = load_gpu(ns.gpu)
        cfg = read_config(ns.model)
        dtype = ns.dtype or ("float32" if gpu.is_cpu else "bfloat16")
        facts = ModelFacts(
            cfg,
            ITEMSIZE[dtype],
            ns.quantization,
            1 if ns.kv_cache_dtype != "auto" else None,
        )
        if ns.gpus_per_node < 1 or ns.nodes < 1:
            raise PlanError("--gpus-per-node and --nodes must be at least 1")
        work = Workload(
            _ints(ns.concurrency, "--concurrency"),
            ns.input_len,
            ns.output_len,
            ns.tpot_target_ms,
        )
        if work.input_len < 1 or work.output_len < 1:
            raise PlanError("--input-len and --output-len must be at least 1")
        target = work.tpot_target_ms
        if target is not None and not (0 < target < math.inf):
            raise PlanError(f"--tpot-target-ms must be a positive number of ms, got {target:g}")
        if gpu.is_cpu and work.tpot_target_ms is not None:
            raise PlanError("--tpot-target-ms needs a GPU's speed data; --gpu cpu has none")
        args = sizing_args(ns, dtype)
        probs = None
        if ns.expert_distribution is not None:
            if not cfg.num_experts:
                raise PlanError("--expert-distribution: the model has no routed experts")
            probs = read_distribution(ns.expert_distribution, facts)
        if ns.write_policy:
            if ns.quantization != "none" or ns.kv_cache_dtype != "auto":
                raise PlanError(
                    "--write-policy: a preset holds guard flags only, not --quantization or "
                    "--kv-cache-dtype, so one sized for FP8 would not size what serve allocates"
                )
            check_output_file(ns.write_policy, "--write-policy")
    except (PlanError, ConfigError, ModelConfigError, LoadError, ValueError) as e:
        print(f"safeserve plan: error: {e}", file=sys.stderr)
        return 2
    print(
        f"[plan] {len(work.concurrency)} concurrencies on {ns.gpus_per_node * ns.nodes} GPUs ...",
        file=sys.stderr,
    )
    result = plan(facts, gpu, args, work, ns.gpus_per_node, ns.nodes, probs)
    if ns.output == "json":
        print(json.dumps(to_json(result, gpu, work, ns.model), indent=2))
    else:
        fp8 = (["weights"] if ns.quantization == "fp8" else []) + (
            ["KV cache"] if ns.kv_cache_dtype != "auto" else []
        )
        gpus = ns.gpus_per_node * ns.nodes
        print(text(result, gpu, work, ns.model, gpus, fp8, ns.gpus_per_node))
    if ns.write_policy and result.recommended is not None:
        _write(ns, result, facts, gpu, work, dtype)
    elif ns.write_policy:
        print(f"[plan] {ns.write_policy} not written: no layout to recommend", file=sys.stderr)
    if result.recommended is None or not result.target_met:
        return 1
    return 0


def plan_argv(ns: argparse.Namespace) -> list[str]:
    """The flags of this plan that change its numbers (a preset's header: how to make it again)."""
    out = ["--model", ns.model, "--gpu", ns.gpu.lower()]
    out += ["--gpus-per-node", str(ns.gpus_per_node), "--nodes", str(ns.nodes)]
    out += ["--concurrency", ns.concurrency, "--input-len", str(ns.input_len)]
    out += ["--output-len", str(ns.output_len)]
    if ns.tpot_target_ms is not None:
        out += ["--tpot-target-ms", f"{ns.tpot_target_ms:g}"]
    if ns.dtype is not None:
        out += ["--dtype", ns.dtype]
    if ns.expert_distribution is not None:
        out += ["--expert-distribution", ns.expert_distribution]
    if ns.quantization != "none":
        out += ["--quantization", ns.quantization]
    if ns.kv_cache_dtype != "auto":
        out += ["--kv-cache-dtype", ns.kv_cache_dtype]
    defaults = ServerArgs()
    for name in sorted(SIZING_FLAGS):
        value = getattr(ns, name)
        if value is not None and value != getattr(defaults, name):
            out += ["--" + name.replace("_", "-"), str(value)]
    return out


def _write(
    ns: argparse.Namespace,
    result: Plan,
    facts: ModelFacts,
    gpu: Any,
    work: Workload,
    dtype: str,
) -> None:
    """The recommended layout's preset: its requests per group as --max-running-requests,
    sized again with that value (the KV cache's cap follows it)."""
    from safeserve.policy import write_policy

    rec = result.recommended
    assert rec is not None
    per_group = max(pt.per_group for pt in rec.points)
    running = ns.max_running_requests
    if running == ServerArgs().max_running_requests:  # not chosen: the plan's requests per group
        running = per_group
    args = sizing_args(ns, dtype, max_running_requests=running)
    rb = facts.rank_bytes(rec.candidate.layout())
    rec = LayoutPlan(rec.candidate, rb, size_rank(facts, rec.candidate, gpu, args, work, rb))
    pre = rec.sizing.prefill
    longest = longest_step_s(
        facts, rb, gpu, pre.step_tokens if pre else args.max_num_batched_tokens
    )
    stall = stall_timeout_s(longest)
    header = [
        f"Written by: safeserve plan {' '.join(plan_argv(ns))}",
        f"Layout: safeserve serve --model {ns.model} --dtype {dtype} {rec.candidate.flags()}",
        f"Planned for: {gpu.description}"
        + (
            ""
            if gpu.calibration is None
            else f"; {'calibration: ' if gpu.calibrated else ''}{gpu.calibration.source}"
        ),
        f"Per rank: weights {rec.sizing.weights_bytes / 2**30:.2f} GiB, "
        f"KV cache {rec.sizing.kv_tokens:,} tokens, dispatch budget {rec.sizing.dispatch_budget} rows",
        *result.reasons,
        "watchdog_stall_timeout: "
        + (
            "the default (no speed data for this device)"
            if longest is None
            else f"max({MIN_STALL_S:g} s, {STALL_FACTOR} x the predicted longest step, "
            f"{longest * 1e3:.0f} ms)"
        ),
    ]
    values = policy_values(rec, args, gpu.is_cpu)
    values["watchdog_stall_timeout"] = stall
    write_policy(ns.write_policy, values, header)
    print(f"[plan] wrote {ns.write_policy}", file=sys.stderr)
