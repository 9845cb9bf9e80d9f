"""Every layout the GPUs allow, sized as the ranks would size themselves, and each requested
concurrency's decode step predicted on it; then the recommendation.

A layout: groups of `W` GPUs (`--tp-size W`), experts spread over all `W` (`--ep-size W`,
`--moe-a2a-backend alltoall` where W > 1), attention split by heads (TP) or one attention group
per rank (`--enable-dp-attention`), and as many groups as the GPUs hold. Memory is sized with
the ranks' own functions (`guards/sizing.py`): what the planner says a rank gets, the rank gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from safeserve.config import ServerArgs
from safeserve.guards.prefill_sizing import size_prefill
from safeserve.guards.sizing import (
    buffer_row_bytes,
    dispatch_budget,
    gpu_kv_budget,
    kv_blocks,
    recv_row_bytes,
)
from safeserve.messages import PrefillSizing
from safeserve.model.registry import check_layout
from safeserve.model.sharding import LayoutError, expert_split
from safeserve.moe.expert_map import ExpertMap
from safeserve.parallel.layout import Layout
from safeserve.plan.arithmetic import (
    a2a_bytes,
    a2a_seconds,
    expected_union,
    in_node_share,
    p_chosen_uniform,
    predicted_step_s,
)
from safeserve.plan.gpus import Gpu
from safeserve.plan.model import ModelFacts, RankBytes

GIB = 1 << 30


@dataclass(frozen=True)
class Workload:
    concurrency: list[int]  # requests decoding at once, over the whole service
    input_len: int
    output_len: int
    tpot_target_ms: float | None = None

    @property
    def mean_context(self) -> float:
        """Mean tokens in a sequence's cache over its decode steps (the bench's floor too)."""
        return self.input_len + self.output_len / 2


@dataclass(frozen=True)
class Candidate:
    group_gpus: int  # W: --tp-size and --ep-size
    dp_attention: bool
    num_groups: int

    @property
    def attention_groups(self) -> int:
        return self.group_gpus if self.dp_attention else 1

    @property
    def backend(self) -> str:
        return "alltoall" if self.group_gpus > 1 else "none"

    @property
    def name(self) -> str:
        name = f"{self.num_groups}x EP{self.group_gpus}"
        if self.group_gpus > 1:
            name += " DP-attn" if self.dp_attention else " TP-attn"
        return name

    def flags(self) -> str:
        out = f"--tp-size {self.group_gpus} --ep-size {self.group_gpus}"
        if self.group_gpus > 1:
            out += f" --moe-a2a-backend {self.backend}"
        if self.dp_attention:
            out += " --enable-dp-attention"
        if self.num_groups > 1:
            out += f" --num-groups {self.num_groups}"
        return out

    def layout(self, rank: int = 0) -> Layout:
        return Layout(rank, self.group_gpus, self.group_gpus, self.dp_attention)


@dataclass
class Point:
    """One concurrency on one layout."""

    concurrency: int
    per_group: int  # requests on one group
    fits: bool  # the KV cache holds them
    experts_per_layer: float  # distinct local experts the busiest rank reads, per MoE layer
    read_bytes: float  # what the busiest rank reads in one decode step
    a2a_bytes: float  # what one rank sends in one MoE layer's dispatch (as many in combine)
    comm_ms: float | None
    floor_ms: float | None  # read_bytes at the GPU's read ceiling
    tpot_ms: float | None  # predicted
    meets_target: bool | None = None
    a2a_step_bytes: float = 0.0  # what one rank sends in a step: dispatch and combine, every layer


@dataclass
class Sizing:
    """One rank of a layout at start-up."""

    weights_bytes: int
    free_after_weights: int | None  # GPU only
    per_block: int
    kv_blocks: int | None  # None: the weights do not fit
    dispatch_budget: int | None  # rows per round (None: admission off or nothing fits)
    dispatch_buffer_bytes: int
    recv_row_bytes: int
    prefill: PrefillSizing | None
    max_concurrency: (
        int  # requests the KV caches of the service hold (--max-running-requests aside)
    )
    kv_tokens: int  # tokens the KV cache of one attention rank holds
    why_not: str | None = None


@dataclass
class LayoutPlan:
    candidate: Candidate
    bytes: RankBytes
    sizing: Sizing
    points: list[Point] = field(default_factory=list)
    in_node_share: float = 1.0

    def blast_radius(self, concurrency: int) -> tuple[int, float]:
        """Requests one failed GPU interrupts (its group's, moved to other groups) and the
        share of capacity it takes down."""
        g = self.candidate.num_groups
        return math.ceil(concurrency / g), 1.0 / g


def blast_reason(lp: LayoutPlan, concurrency: int) -> str:
    g = lp.candidate.num_groups
    reqs, share = lp.blast_radius(concurrency)
    if g == 1:
        return (
            f"1 group: one failed GPU stops all {reqs} requests and the whole service until "
            "the group restarts (more groups, narrower, shrink this)"
        )
    return (
        f"{g} groups: one failed GPU interrupts {reqs} requests (they move to the other "
        f"groups) and {share:.0%} of capacity"
    )


def candidates(facts: ModelFacts, total_gpus: int) -> tuple[list[Candidate], list[str]]:
    """Every group width that divides the GPUs and the model, both attention modes; and why
    the widths left out were left out."""
    out, skipped = [], []
    w = 1
    while w <= total_gpus:
        if total_gpus % w == 0:
            for dp in (False, True) if w > 1 else (False,):
                cand = Candidate(w, dp, total_gpus // w)
                try:
                    for rank in range(w):
                        check_layout(facts.cfg, cand.layout(rank))
                except LayoutError as e:
                    skipped.append(f"{cand.name}: {e}")
                    continue
                out.append(cand)
        w *= 2
    return out, skipped


def size_rank(
    facts: ModelFacts,
    cand: Candidate,
    gpu: Gpu,
    args: ServerArgs,
    work: Workload,
    rb: RankBytes,
) -> Sizing:
    """What a rank of this layout allocates at start-up, with the ranks' own arithmetic."""
    cfg = facts.cfg
    layout = cand.layout()
    max_model_len = args.max_model_len or cfg.max_position_embeddings
    per_block = args.block_size * rb.kv_token
    weights = rb.total
    free_after_kv: float
    if gpu.is_cpu:
        free = None
        budget = args.kv_cache_memory_gb * GIB
        blocks: int | None = (
            args.num_kv_blocks
            if args.num_kv_blocks is not None
            else kv_blocks(
                budget, per_block, args.max_running_requests, max_model_len, args.block_size
            )
        )
        free_after_kv = args.dispatch_memory_gb * GIB
    else:
        assert gpu.calibration is not None
        free = gpu.memory_bytes - gpu.calibration.runtime_bytes - weights
        budget = gpu_kv_budget(free, gpu.memory_bytes, args.mem_fraction_static)
        if args.num_kv_blocks is not None:
            blocks = args.num_kv_blocks
        elif budget <= per_block:
            blocks = None
        else:
            blocks = kv_blocks(
                budget, per_block, args.max_running_requests, max_model_len, args.block_size
            )
        free_after_kv = (free - (blocks or 0) * per_block) // 2  # half: the rest is activations
    why = None
    if blocks is None:
        why = (
            f"weights {weights / GIB:.1f} GiB per GPU leave no KV cache under "
            f"--mem-fraction-static {args.mem_fraction_static}"
        )
    row = recv_bytes = 0
    budget_rows: int | None = None
    if cfg.num_experts and args.dispatch_budget_tokens != 0:
        _, i0, i1 = expert_split(cfg, layout)
        recv_bytes = recv_row_bytes(
            cfg.hidden_size, i1 - i0, cfg.num_experts_per_tok, rb.local_experts, facts.itemsize
        )
        row = buffer_row_bytes(cfg.hidden_size, i1 - i0, cfg.num_experts_per_tok, facts.itemsize)
        if args.dispatch_budget_tokens is not None:
            budget_rows = args.dispatch_budget_tokens
        elif free_after_kv > 0:
            budget_rows = dispatch_budget(
                int(free_after_kv),
                recv_bytes,
                layout.dp_size,
                args.max_num_batched_tokens,
            )
    prefill = size_prefill(
        args.prefill_sizing,
        budget_rows,
        layout.dp_size,
        args.max_num_batched_tokens,
        args.chunked_prefill_size,
    )
    per_req = math.ceil((work.input_len + work.output_len) / args.block_size)
    per_group = 0
    if blocks is not None:
        per_group = layout.dp_size * (blocks // per_req)
    return Sizing(
        weights,
        free,
        per_block,
        blocks,
        budget_rows,
        (budget_rows or 0) * row,
        recv_bytes,
        prefill,
        per_group * cand.num_groups,
        (blocks or 0) * args.block_size,
        why,
    )


def predict(
    facts: ModelFacts,
    cand: Candidate,
    gpu: Gpu,
    work: Workload,
    rb: RankBytes,
    sizing: Sizing,
    gpus_per_node: int,
    probs: list[list[float]] | None = None,
) -> list[Point]:
    """Each concurrency's decode step on the busiest rank of this layout. `probs[l][e]`: the
    probability that a token chooses logical expert e in MoE layer l (recorded routing); None:
    uniform routing."""
    cfg = facts.cfg
    w = cand.group_gpus
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    moe_layers = facts.moe_layers
    points = []
    for conc in work.concurrency:
        per_group = math.ceil(conc / cand.num_groups)
        seqs_on_rank = per_group / cand.attention_groups  # the attention rank's sequences
        experts = 0.0
        if e:
            if probs is None:
                local = expected_union([p_chosen_uniform(e, k)] * rb.local_experts, per_group)
                experts = local
            else:  # the busiest rank under the trivial expert map, layer by layer
                placed = ExpertMap.trivial(e, w, len(probs))
                total = max(
                    sum(
                        expected_union([layer[x] for x in placed.local_logical(i, r)], per_group)
                        for i, layer in enumerate(probs)
                    )
                    for r in range(w)
                )
                experts = total / moe_layers
        read = (
            rb.dense
            + seqs_on_rank * rb.embed_row
            + experts * moe_layers * rb.expert
            + seqs_on_rank * work.mean_context * rb.kv_token
        )
        sent = a2a_bytes(seqs_on_rank, w, e, k, cfg.hidden_size, facts.itemsize) if e else 0.0
        fits = sizing.kv_blocks is not None and per_group <= sizing.max_concurrency / max(
            1, cand.num_groups
        )
        comm = floor = tpot = None
        cal = gpu.calibration
        if cal is not None:
            comm_s = (
                2
                * moe_layers
                * a2a_seconds(sent, w, gpus_per_node, gpu.nvlink_gbs, gpu.scaleout_gbs)
            )
            comm = comm_s * 1e3
            floor = read / (cal.read_ceiling_gbs * 1e9) * 1e3
            step = predicted_step_s(
                read,
                cfg.num_hidden_layers,
                cal.read_ceiling_gbs,
                cal.efficiency,
                cal.layer_us,
                comm_s,
            )
            tpot = step * 1e3
        met = None
        if work.tpot_target_ms is not None and tpot is not None:
            met = fits and tpot <= work.tpot_target_ms
        points.append(
            Point(
                conc,
                per_group,
                fits,
                experts,
                read,
                sent,
                comm,
                floor,
                tpot,
                met,
                a2a_step_bytes=2 * moe_layers * sent,
            )
        )
    return points


@dataclass
class Plan:
    layouts: list[LayoutPlan]
    skipped: list[str]
    recommended: LayoutPlan | None
    reasons: list[str]
    target_met: bool
    serve_flags: str | None = None  # the recommended layout's serve flags (None: none)


def plan(
    facts: ModelFacts,
    gpu: Gpu,
    args: ServerArgs,
    work: Workload,
    gpus_per_node: int,
    nodes: int,
    probs: list[list[float]] | None = None,
) -> Plan:
    total = gpus_per_node * nodes
    cands, skipped = candidates(facts, total)
    layouts = []
    for cand in cands:
        rb = facts.rank_bytes(cand.layout())
        sizing = size_rank(facts, cand, gpu, args, work, rb)
        lp = LayoutPlan(
            cand, rb, sizing, in_node_share=in_node_share(cand.group_gpus, gpus_per_node)
        )
        lp.points = predict(facts, cand, gpu, work, rb, sizing, gpus_per_node, probs)
        layouts.append(lp)
    rec, reasons, met = recommend(layouts, work)
    flags = None
    if rec is not None:
        flags = rec.candidate.flags()
        per_group = max(pt.per_group for pt in rec.points)
        if per_group > args.max_running_requests:  # else a group would queue the rest
            flags += f" --max-running-requests {per_group}"
            reasons.append(
                f"{per_group} requests per group: above --max-running-requests "
                f"{args.max_running_requests}, so the command raises it (a preset sets it too)"
            )
    return Plan(layouts, skipped, rec, reasons, met, flags)


def recommend(
    layouts: list[LayoutPlan], work: Workload
) -> tuple[LayoutPlan | None, list[str], bool]:
    """The smallest group width that fits memory at the largest requested concurrency and meets
    the TPOT target there (of its attention modes, the faster); without a target, the smallest
    that fits. Else the best the GPUs can do, and why it falls short."""
    top = max(work.concurrency)

    def at_top(lp: LayoutPlan) -> Point:
        return next(p for p in lp.points if p.concurrency == top)

    fitting = [lp for lp in layouts if at_top(lp).fits]
    if not fitting:
        holding = [lp for lp in layouts if lp.sizing.kv_blocks is not None]
        if not holding:
            if not layouts:
                return None, ["no layout of these GPUs can split the model"], False
            least = min(layouts, key=lambda lp: lp.sizing.weights_bytes)
            return (
                None,
                [
                    f"the weights do not fit: {least.sizing.weights_bytes / GIB:.1f} GiB per GPU "
                    f"at the least ({least.candidate.name}) leave no KV cache; plan more GPUs "
                    "(--nodes, --gpus-per-node) or smaller weights (--quantization fp8)"
                ],
                False,
            )
        best = max(holding, key=lambda lp: lp.sizing.max_concurrency)
        return (
            best,
            [
                f"no layout holds {top} requests of {work.input_len}+{work.output_len} tokens; "
                f"the most is {best.sizing.max_concurrency} ({best.candidate.name})"
            ],
            False,
        )

    def tpot(lp: LayoutPlan) -> float:
        t = at_top(lp).tpot_ms
        return math.inf if t is None else t

    target = work.tpot_target_ms
    ok = fitting if target is None else [lp for lp in fitting if tpot(lp) <= target]
    if not ok:
        best = min(fitting, key=tpot)
        return (
            best,
            [
                f"no layout meets TPOT {target:g} ms at concurrency {top}; the best is "
                f"{tpot(best):.2f} ms ({best.candidate.name})"
            ],
            False,
        )
    width = min(lp.candidate.group_gpus for lp in ok)
    best = min((lp for lp in ok if lp.candidate.group_gpus == width), key=tpot)
    reasons = [
        f"smallest group that holds {top} requests of {work.input_len}+{work.output_len} "
        f"tokens: {width} GPU{'s' if width > 1 else ''} "
        f"(weights {best.sizing.weights_bytes / GIB:.1f} GiB per GPU, "
        f"KV cache {best.sizing.kv_tokens:,} tokens per attention rank)",
    ]
    if target is not None:
        reasons.append(f"predicted TPOT {tpot(best):.2f} ms <= target {target:g} ms")
    reasons.append(blast_reason(best, top))
    return best, reasons, True


PREFILL_MFU = 0.4  # share of the datasheet's tensor throughput a prefill step is assumed to run at
STALL_FACTOR = 20  # the stall timeout a preset writes: this many times the longest step, at least
MIN_STALL_S = 10.0  # ... the server's default


def longest_step_s(facts: ModelFacts, rb: RankBytes, gpu: Gpu, step_tokens: int) -> float | None:
    """A full prefill step on one rank of this layout: its matmuls at PREFILL_MFU of the GPU's
    tensor throughput plus one read of its weights (None on the CPU: no speed data)."""
    if gpu.calibration is None or not gpu.bf16_tflops:
        return None
    k = facts.cfg.num_experts_per_tok
    params = (rb.dense + facts.moe_layers * min(k, rb.local_experts) * rb.expert) / facts.itemsize
    flops = 2.0 * step_tokens * params
    read = rb.total / (gpu.calibration.efficiency * gpu.calibration.read_ceiling_gbs * 1e9)
    return flops / (gpu.bf16_tflops * 1e12 * PREFILL_MFU) + read


def stall_timeout_s(longest: float | None) -> float:
    return MIN_STALL_S if longest is None else max(MIN_STALL_S, round(STALL_FACTOR * longest, 1))
