"""A rank's start-up sizing: its device, the KV blocks it holds, the dispatch buffers admission
preallocates, and the numbers it reports (heartbeat stats, guard sizing).

Every value that must be the same on every rank of the group (blocks, the receive budget) goes
through `agree_min`, the group's smallest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from safeserve.config import ServerArgs
from safeserve.engine.kv_cache import KVCache, kv_blocks_from_memory, kv_cache_dtype
from safeserve.guards.admission import DispatchBuffers, bytes_per_recv_row
from safeserve.guards.sizing import dispatch_budget
from safeserve.messages import DispatchSizing, DispatchStats, GuardSizing, RankStats
from safeserve.model.config import ModelConfig
from safeserve.model.loader import DTYPES
from safeserve.model.sharding import expert_split
from safeserve.model.spec import KVSpec
from safeserve.moe.expert_map import ExpertMap
from safeserve.parallel.layout import Layout

AgreeMin = Callable[[int], int]


def rank_device(args: ServerArgs, rank: int, device_index: int | None = None) -> torch.device:
    if args.device == "cuda":
        return torch.device("cuda", rank if device_index is None else device_index)
    return torch.device("cpu")


def num_kv_blocks(args: ServerArgs, spec: KVSpec, device: torch.device, max_model_len: int) -> int:
    """This rank's KV blocks (before the group agrees on the smallest): `--num-kv-blocks`, or
    what memory holds of the family's cache entries (`kv_blocks_from_memory`)."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    per_block = KVCache.bytes_per_block(spec, args.block_size, kv_cache_dtype(args))
    return kv_blocks_from_memory(args, per_block, device, max_model_len)


def admission_buffers(
    args: ServerArgs,
    cfg: ModelConfig,
    layout: Layout,
    device: torch.device,
    agree_min: AgreeMin,
    expert_map: ExpertMap | None = None,
) -> DispatchBuffers | None:
    """The dispatch buffers preallocated at the receive budget (the same on every rank), sized
    for the local slots of `expert_map` (None: the trivial map); None without experts to
    dispatch to or with admission off (`--dispatch-budget-tokens 0`)."""
    if not cfg.num_experts or args.dispatch_budget_tokens == 0:
        return None
    placement, i0, i1 = expert_split(cfg, layout, expert_map)
    dtype = DTYPES[args.dtype]
    row_bytes = bytes_per_recv_row(
        cfg.hidden_size, i1 - i0, cfg.num_experts_per_tok, placement.experts_per_rank, dtype
    )
    if args.dispatch_budget_tokens is not None:
        budget = args.dispatch_budget_tokens
    else:
        if device.type == "cuda":
            # Half of what is left after weights and KV cache; the rest is for activations.
            free_bytes = torch.cuda.mem_get_info(device)[0] // 2
        else:
            free_bytes = int(args.dispatch_memory_gb * (1 << 30))
        budget = dispatch_budget(free_bytes, row_bytes, layout.dp_size, args.max_num_batched_tokens)
    budget = agree_min(budget)
    return DispatchBuffers.allocate(
        budget, cfg.hidden_size, i1 - i0, cfg.num_experts_per_tok, dtype, device
    )


def guard_sizing(
    buffers: DispatchBuffers | None,
    cfg: ModelConfig,
    layout: Layout,
    expert_map: ExpertMap | None = None,
) -> GuardSizing:
    """The numbers the leader sizes prefill chunks from (and /admin/config shows)."""
    if buffers is None:
        return GuardSizing()
    dispatch = DispatchSizing(
        buffer_bytes=buffers.nbytes,
        bytes_per_recv_row=buffers.row_bytes(),
        attention_groups=layout.dp_size,
        top_k=cfg.num_experts_per_tok,
        local_experts=expert_split(cfg, layout, expert_map)[0].experts_per_rank,
    )
    return GuardSizing(buffers.max_recv_tokens, dispatch)


def rank_stats(runner: Any) -> RankStats:
    """What a rank's heartbeats carry besides (step, phase): its own step time, memory, graph
    replays, expert-load balancedness and dispatch counters (a `ModelRunner`'s)."""
    device = runner.device
    out = RankStats(own_step_s=runner.last_own_step_s, device=str(device))
    if device.type == "cuda":
        out.memory_bytes = torch.cuda.memory_allocated(device)
        out.memory_peak_bytes = torch.cuda.max_memory_allocated(device)
        out.memory_startup_peak_bytes = runner.startup_peak_bytes
    if runner.cuda_graphs is not None:
        out.cuda_graph_replays = runner.cuda_graphs.replays
    if runner.piecewise is not None:
        out.piecewise_graph_replays = runner.piecewise.replays
    if runner.dispatcher is not None:
        out.balancedness = runner.dispatcher.balance.window_means()
    if runner.buffers is not None:
        st = runner.buffers.stats
        out.dispatch = DispatchStats(
            budget_tokens=st.budget,
            recv_tokens_peak=st.recv_peak,
            rounds_total=st.rounds_total,
            cut_total=st.dispatches_cut,
            buffer_bytes=st.buffer_bytes,
            buffer_peak_bytes=st.buffer_peak_bytes,
        )
    return out
