"""Every rank's worker: holds its shard of the model and its KV cache, runs its part of a plan.

With tensor-parallel attention every rank computes the same sequences (its heads of them) and the
leader samples; with attention data-parallel each rank computes and samples its own sequences.
Ranks with no tokens still run the forward pass, so that every MoE collective has all ranks.

Start-up sizing and what a rank reports are in `rank_setup.py`, its CUDA graphs in
`rank_graphs.py`; this module sets a rank up and runs its steps.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch

from safeserve.config import ServerArgs
from safeserve.engine import rank_graphs
from safeserve.engine.cuda_graph import DecodeCudaGraphs
from safeserve.engine.kv_cache import KVCache, kv_cache_dtype
from safeserve.engine.logprobs import prompt_logprobs, sampled_logprobs
from safeserve.engine.outcome import RankResult, StepFailed, apply_request_faults
from safeserve.engine.overlap import cut_pieces
from safeserve.engine.piecewise_graph import PiecewiseCudaGraphs
from safeserve.engine.plan import EplbCollect, EplbMove, EplbRankReport, Faults, SeqPlan, StepPlan
from safeserve.engine.rank_eplb import RankEplb
from safeserve.engine.rank_setup import (
    admission_buffers,
    guard_sizing,
    num_kv_blocks,
    rank_device,
    rank_stats,
)
from safeserve.engine.sampler import sample
from safeserve.kernels.common import set_batch_invariant, set_pdl
from safeserve.layers.block_tables import TableUpload
from safeserve.layers.paged_attention import AttentionMetadata
from safeserve.messages import GuardSizing, RankStats, SamplingParams, TokenLogprob
from safeserve.model import registry
from safeserve.model.loader import build_model, load_model_config
from safeserve.model.sharding import expert_split, moe_layers, starting_expert_map
from safeserve.moe.dispatch import StepTokens, make_dispatcher
from safeserve.moe.expert_map import ExpertMap
from safeserve.parallel.comm import Comm, Layout
from safeserve.wire.tree import TreeCodec

logger = logging.getLogger(__name__)

# What a group's ranks send each other on the control plane (plans, results, agreed numbers).
CONTROL_CLASSES = (
    StepPlan,
    SeqPlan,
    SamplingParams,
    Faults,
    EplbCollect,
    EplbMove,
    EplbRankReport,
    RankResult,
    StepFailed,
    TokenLogprob,
)

PhaseCallback = Callable[[int, str], None]


class ModelRunner:
    def __init__(
        self,
        args: ServerArgs,
        rank: int = 0,
        init_method: str | None = None,
        on_phase: PhaseCallback | None = None,
        capture_cuda_graphs: bool = True,
        device_index: int | None = None,
        expert_map: ExpertMap | None = None,
    ) -> None:
        """`expert_map`: where the routed experts live (None: the trivial map, contiguous
        blocks per EP rank); every reader of the placement on this rank gets it from here."""
        self.args = args
        set_pdl(not args.disable_pdl)  # before any kernel is launched (or captured)
        set_batch_invariant(args.enable_deterministic_inference)
        self.layout = Layout(rank, args.tp_size, args.ep_size, args.enable_dp_attention)
        self.device = rank_device(args, rank, device_index)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.comm = Comm(self.layout, self.device)
        if args.placement == "remote":  # ranks on several hosts: no pickle between them
            self.comm.codec = TreeCodec(CONTROL_CLASSES)
        if self.comm.active:
            assert init_method is not None
            self.comm.init(init_method)
        self.on_phase = on_phase or (lambda step, phase: None)
        cfg = load_model_config(args.model, args.quantization)
        self.config = cfg
        if expert_map is None and cfg.num_experts:
            expert_map = starting_expert_map(args, cfg, self.layout)
        placement = expert_split(cfg, self.layout, expert_map)[0] if cfg.num_experts else None
        # The one placement of this rank: the map (its layer rows: the model's MoE layers).
        self.expert_map = (
            placement.map_for(cfg.num_experts, len(moe_layers(cfg))) if placement else None
        )
        self.dispatcher = (
            make_dispatcher(args.moe_a2a_backend, placement, self.comm) if placement else None
        )
        self.model = build_model(
            args.model,
            args.load_format,
            args.dtype,
            self.device,
            self.dispatcher,
            self.layout,
            self.comm,
            args.seed,
            args.quantization,
        )
        for layer in self.model.layers:
            if layer.is_moe:
                layer.mlp.on_phase = self._moe_phase
                layer.mlp.single_batch_overlap = args.enable_single_batch_overlap
        self.eplb = RankEplb.build(self)  # before the graphs: they hold its counting
        self.step_id = 0
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        self.kv_spec = registry.kv_spec(cfg, self.layout)
        self.num_blocks = self.agree_min(
            num_kv_blocks(args, self.kv_spec, self.device, self.max_model_len)
        )
        self.kv = KVCache.from_spec(
            self.kv_spec, self.num_blocks, args.block_size, kv_cache_dtype(args), self.device
        )
        self.buffers = admission_buffers(
            args, cfg, self.layout, self.device, self.agree_min, self.expert_map
        )
        if self.dispatcher is not None:
            self.dispatcher.buffers = self.buffers
        self.faults = Faults()
        self.corrupted = False  # fault injection `corrupt` damaged the weights (for good)
        self.serving = False  # set by begin_serving()
        # a rank process's runner: begin_serving() freezes start-up's objects out of the garbage
        # collector (not for runners built in a longer-lived process, which would keep them)
        self.freeze_gc_on_serving = False
        self.startup_peak_bytes: int | None = None  # set by begin_serving()
        self.last_own_step_s = 0.0  # this rank's step time outside collectives
        self.cuda_graphs: DecodeCudaGraphs | None = None
        self.piecewise: PiecewiseCudaGraphs | None = None
        # decode rows of the steps no decode graph runs: their block tables by difference
        self.eager_tables = (
            TableUpload.allocate(
                args.max_running_requests, self.max_model_len, args.block_size, self.device
            )
            if self.device.type == "cuda"
            else None
        )
        if capture_cuda_graphs:
            self.capture_cuda_graphs()

    def graphs_possible(self) -> bool:
        """Whether this group's steps can be CUDA graphs (`rank_graphs.graphs_possible`)."""
        return rank_graphs.graphs_possible(self)

    @property
    def attention_kernels(self) -> bool:
        """Whether the paged-attention kernels serve this family's cache: K and V heads of one
        size (`kernels/paged_attention.py`, `paged_prefill.py`), or one latent vector per token
        (MLA: `kernels/mla_attention.py`)."""
        spec = self.kv_spec
        return spec.v_in_k or spec.k_dim == spec.v_dim

    def capture_cuda_graphs(self) -> None:
        """Decode steps as CUDA graphs, then prefill and mixed steps as piecewise ones; each
        kind on every rank of the group or on none (`rank_graphs.capture`)."""
        self.cuda_graphs, self.piecewise = rank_graphs.capture(self)

    def guard_sizing(self) -> GuardSizing:
        """The numbers the leader sizes prefill chunks from (and /admin/config shows)."""
        return guard_sizing(self.buffers, self.config, self.layout, self.expert_map)

    def begin_serving(self) -> None:
        """Called when the group idles (the first time: start-up is over). From then on
        `memory_peak_bytes` is the peak while serving (start-up's profiling and capture peak is
        kept apart), the balancedness windows hold served passes only (not the warm-up's), and
        in a rank process the objects start-up made are frozen out of the garbage collector's
        generations."""
        if self.serving:
            return
        self.serving = True
        if self.device.type == "cuda":
            self.startup_peak_bytes = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.dispatcher is not None:
            self.dispatcher.balance.clear()
        if self.eplb is not None:
            self.eplb.begin_serving()
        if self.freeze_gc_on_serving:
            # What start-up built (the model, its tables, the graphs' bookkeeping) lives as long
            # as the rank: out of the collector's sight, a full collection while serving scans
            # only what serving allocates (one took 100 ms of an EPLB step before).
            gc.collect()
            gc.freeze()

    def stats(self) -> RankStats:
        """What this rank's heartbeats carry besides (step, phase)."""
        return rank_stats(self)

    def apply_faults(self, faults: Faults | None) -> None:
        faults = faults or Faults()
        if faults.route_skew_expert != self.faults.route_skew_expert:
            for layer in self.model.layers:
                if layer.is_moe:
                    layer.mlp.gate.skew_expert = faults.route_skew_expert
        if self.layout.rank in faults.corrupt_ranks and not self.corrupted:
            self._corrupt_weights()
        self.faults = faults

    def _corrupt_weights(self) -> None:
        """Fault injection `corrupt`: every other row of every floating-point matrix of this
        rank scaled by -4 in place (a sign and an exponent bit flipped), as bad memory would
        leave them: the rank keeps running and beating, and computes wrong results. In place, so
        captured CUDA graphs compute with the damaged weights too."""
        logger.warning("fault injection: corrupting this rank's weights")
        self.corrupted = True
        with torch.no_grad():
            for p in self.model.parameters():
                if p.dim() >= 2 and p.dtype in (torch.float32, torch.bfloat16, torch.float16):
                    p[::2].mul_(-4.0)

    def agree_min(self, value: int) -> int:
        """The group's smallest `value` (KV blocks, the receive budget, a capture's success),
        the same on every rank."""
        values = self.comm.gather_objects(value)
        return int(self.comm.broadcast_object(min(values) if values else value))  # type: ignore[type-var]

    # -- a step ---------------------------------------------------------------------------------
    def _moe_phase(self, phase: str) -> None:
        self.on_phase(self.step_id, phase)

    def execute(self, plan: StepPlan) -> list[int | str]:
        """Runs this rank's part of the plan; returns the tokens it sampled, in plan order (a
        row that could not be sampled holds its error instead: sampler.sample)."""
        return self.execute_step(plan).tokens

    def execute_step(self, plan: StepPlan) -> RankResult:
        """Runs this rank's part of the plan: its sampled tokens (or per-row errors) and the
        log-probabilities its requests ask for. Raises `RequestFault` on every rank, before
        any collective, for a plan holding a request with fault "raise" (outcome.py); a step
        that raises leaves no per-step state behind (the dispatcher's step is discarded)."""
        if plan.eplb is not None:
            if self.eplb is None:
                raise RuntimeError(f"step {plan.step}: an EPLB step, but EPLB is off here")
            return RankResult(eplb=self.eplb.run(plan.step, plan.eplb))
        apply_request_faults(plan, self.layout.rank, self.layout.dp_attention)
        start, waited = time.perf_counter(), self.comm.wait_s
        self.apply_faults(plan.faults)
        delay = self.faults.delay_s.get(self.layout.rank, 0.0)
        if delay > 0:
            time.sleep(delay)  # fault injection: a slow rank
        try:
            logits, greedy, sampling, prompt = self._run(plan)
            result = RankResult(prompt_logprobs=prompt)
            if logits is not None:
                self.on_phase(plan.step, "sample")
                result.tokens = sample(
                    logits,
                    [s.params for s in sampling],  # type: ignore[misc]
                    [s.output_index for s in sampling],
                    self.args.seed,
                    greedy_tokens=greedy,
                )
                result.logprobs = sampled_logprobs(logits, sampling, result.tokens)
        except Exception:
            if self.dispatcher is not None:
                self.dispatcher.discard_step()  # a half step is no balancedness pass
            if self.eplb is not None:
                self.eplb.discard_step()
            raise
        self._end_step()  # after sampling: the step's device work is done
        self.last_own_step_s = (time.perf_counter() - start) - (self.comm.wait_s - waited)
        return result

    def run_plan(self, plan: StepPlan) -> tuple[torch.Tensor | None, list[SeqPlan]]:
        """The forward pass of this rank's part; logits of its sampling rows when it samples."""
        logits, _, sampling, _ = self._run(plan)
        self._end_step()
        return logits, sampling

    def _end_step(self) -> None:
        """Closes the step's pass in the balancedness and expert-distribution records."""
        if self.dispatcher is not None:
            self.dispatcher.end_step()
        if self.eplb is not None:
            self.eplb.end_step()

    def _run(
        self, plan: StepPlan
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[SeqPlan], dict]:
        """(logits of the sampling rows, their argmax where a CUDA graph computed it, the
        sampling sequences, prompt log-probabilities by sequence index); logits None (and no
        prompt log-probabilities) where this rank does not sample."""
        self.step_id = plan.step
        dp = self.layout.dp_attention
        if dp:
            mine = plan.per_rank[self.layout.rank]
            sizes = [sum(len(s.token_ids) for s in seqs) for seqs in plan.per_rank]
            samples_here = True
        else:
            mine = plan.per_rank[0]
            sizes = [sum(len(s.token_ids) for s in mine)] * self.layout.tp_size
            samples_here = self.layout.rank == 0
        if self.dispatcher is not None:
            self.dispatcher.begin_step(StepTokens(sizes, replicated=not self.layout.dp_attention))
        self.on_phase(plan.step, "attention")
        sampling = [s for s in mine if s.params is not None]
        # only the requests asking for prompt log-probabilities need logits of more rows
        wants_prompt = samples_here and any(s.prompt_lp_targets for s in mine)
        graphs = self.cuda_graphs
        # Every rank holds the whole plan, so every rank picks the same bucket (or none). Fault
        # injection (route skew) lives in device tensors that the graphs read: no eager step.
        bucket = None
        if graphs is not None:
            bucket = graphs.group_bucket(plan.per_rank if dp else [mine])
        if bucket is not None:
            out = graphs.run(mine, bucket)
            if out is None or not samples_here:
                return None, None, sampling, {}
            logits, greedy = out  # every row's (one token each), valid until the next replay
            prompt = prompt_logprobs(mine, lambda i: logits[i], self.device) if wants_prompt else {}
            if not sampling:
                return None, None, sampling, prompt
            if len(sampling) < len(mine):
                rows = [i for i, s in enumerate(mine) if s.params is not None]
                index = torch.tensor(rows, dtype=torch.int64, device=self.device)
                logits, greedy = logits[index], greedy[index]
            return logits, greedy, sampling, prompt
        if plan.split is not None:
            hidden, sample_rows = self._forward_split(mine, plan.split, sizes)
        else:
            hidden, sample_rows = self._forward(mine, max(sizes))
        if not samples_here:
            return None, None, sampling, {}
        prompt = (
            prompt_logprobs(mine, lambda i: self.model.compute_logits(hidden[i]), self.device)
            if wants_prompt
            else {}
        )
        if not sampling:
            return None, None, sampling, prompt
        return self.model.compute_logits(hidden[sample_rows]), None, sampling, prompt

    def _forward(self, seqs: list[SeqPlan], group_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A step that no decode graph runs: as piecewise graphs where the group's largest
        token count (`group_tokens`, this rank's own with tensor-parallel attention) fits, on
        every rank, else eagerly."""
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for s in seqs:
            ids.extend(s.token_ids)
            positions.extend(range(s.start, s.end))
            if s.params is not None:
                sample_rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(
            [len(s.token_ids) for s in seqs],
            [s.end for s in seqs],
            [s.block_table for s in seqs],
            self.args.block_size,
            self.device,
            use_kernels=self.attention_kernels,
            table_ids=[s.table_id for s in seqs],
            tables=self.eager_tables,
        )
        pw = self.piecewise
        if pw is not None and pw.can_run(group_tokens):
            hidden = pw.run(ids, positions, meta, group_tokens)
        else:
            d = self.dispatcher
            # single-batch overlap: the combine is issued asynchronously so that the shared
            # experts run while it moves
            overlap = d is not None and self.args.enable_single_batch_overlap
            if overlap:
                d.asynchronous = True
            try:
                hidden = self.model(
                    torch.tensor(ids, dtype=torch.int64, device=self.device),
                    torch.tensor(positions, dtype=torch.int64, device=self.device),
                    meta,
                    self.kv.layers,
                )
            finally:
                if overlap:
                    d.asynchronous = False
        return hidden, torch.tensor(sample_rows, dtype=torch.int64, device=self.device)

    def _forward_split(
        self, seqs: list[SeqPlan], split: list[int], sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two-batch overlap: this rank's step tokens cut at its `split` index into two
        micro-batches (one sequence may be cut across them: its second piece starts where the
        first ended and attends to it as its prefix) that run in turns (`CausalLM.forward_split`),
        eagerly. Every rank of the group runs the same schedule; `sizes` are the ranks' step
        tokens (each its own with attention data-parallel)."""
        rank = self.layout.rank if self.layout.dp_attention else 0
        at = split[rank]
        first, second = cut_pieces([len(s.token_ids) for s in seqs], at)
        parts = []
        for pieces in (first, second):
            ids: list[int] = []
            positions: list[int] = []
            for p in pieces:
                s = seqs[p.seq]
                ids.extend(s.token_ids[p.offset : p.offset + p.length])
                positions.extend(range(s.start + p.offset, s.start + p.offset + p.length))
            meta = AttentionMetadata.build(
                [p.length for p in pieces],
                [seqs[p.seq].start + p.offset + p.length for p in pieces],
                [seqs[p.seq].block_table for p in pieces],
                self.args.block_size,
                self.device,
                use_kernels=self.attention_kernels,
            )
            parts.append(
                (
                    torch.tensor(ids, dtype=torch.int64, device=self.device),
                    torch.tensor(positions, dtype=torch.int64, device=self.device),
                    meta,
                )
            )
        if self.dispatcher is not None:
            if self.layout.dp_attention:
                halves = [list(split), [n - k for n, k in zip(sizes, split, strict=True)]]
            else:
                halves = [[at] * len(sizes), [sizes[0] - at] * len(sizes)]
            replicated = not self.layout.dp_attention
            enter = self.dispatcher.micro_batches(
                [StepTokens(h, replicated=replicated) for h in halves]
            )
        else:  # a model without routed experts: nothing moves, nothing to overlap
            enter = [lambda: None, lambda: None]
        try:
            hidden = self.model.forward_split(parts, self.kv.layers, enter)
        finally:
            if self.dispatcher is not None:
                self.dispatcher.end_micro_batches()
        sample_rows = []
        row = 0
        for s in seqs:
            row += len(s.token_ids)
            if s.params is not None:
                sample_rows.append(row - 1)
        return hidden, torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
