"""Decode steps as CUDA graphs, one graph per batch-size bucket.

A decode step launches hundreds of small kernels (48 layers × norm, projections, RoPE, KV store,
attention, router, two grouped GEMMs, ...); replayed as one graph, host launch overhead drops
out. Each bucket's graph reads its inputs from static buffers: a step of `n` sequences copies its
token ids, positions, slots, context lengths and block tables into the first `n` rows of the
smallest bucket that holds it; the padding rows have context 0 and slot -1, so they write no KV
and attend to nothing. The graph also computes the logits and their argmax, so a greedy step
costs one replay and one small device-to-host copy. Everything inside the forward must be
capture-safe (no host sync): on CUDA that is the Triton fused MoE, top-k and decode-attention
path, and with more than one rank the NCCL all-reduces of tensor-parallel attention and of the
`none` backend. The `alltoall` backend needs its split sizes on the host: inside a graph it
dispatches as `none` does (moe/dispatch/alltoall.py). With attention data-parallel each rank
holds its own sequences: every rank replays the bucket of the largest rank's count, padding its
own (a rank with none replays all padding), so the MoE's all-gathers have the same sizes on
every rank.

Every rank of a group captures the same buckets in the same order, and replays the same bucket
in a step (every rank holds the same plan), so the collectives inside match. Ranks that do not
sample (tensor-parallel attention: all but the leader) capture no logits. A step's host
bookkeeping inside the forward (admission rounds, expert loads for balancedness) is taped at
capture and run again after each replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from safeserve.engine.plan import SeqPlan
from safeserve.layers.block_tables import TableUpload
from safeserve.layers.paged_attention import AttentionMetadata
from safeserve.moe.dispatch.base import Dispatcher, StepTokens

logger = logging.getLogger(__name__)


def graph_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 beyond; always ending at max_bs."""
    sizes = [b for b in (1, 2, 4) if b < max_bs]
    b = 8
    while b < max_bs:
        sizes.append(b)
        b += 8 if b < 64 else 16
    sizes.append(max_bs)
    return sizes


def begin_bucket_step(
    dispatcher: Dispatcher | None,
    tokens: int,
    ranks: int,
    replicated: bool = True,
    real: torch.Tensor | None = None,
) -> None:
    """Before a forward that a graph captures (or its warm-up): every rank of the group holds
    the bucket's `tokens` (the same ones with tensor-parallel attention, its own with attention
    data-parallel), as the step the graph will replay does; `real` marks the rows that are not
    padding (StepTokens)."""
    if dispatcher is not None:
        step = StepTokens([tokens] * ranks, replicated=replicated, graph=True, real=real)
        dispatcher.begin_step(step)


def host_tape(dispatcher: Dispatcher | None) -> AbstractContextManager[list[Callable[[], None]]]:
    """The dispatcher's host bookkeeping of the steps run inside, to run after each replay
    (nothing to tape without a dispatcher)."""
    return dispatcher.taping() if dispatcher is not None else nullcontext([])


def smallest_bucket(buckets: list[int], n: int) -> int | None:
    """The first of the ascending `buckets` that holds `n`; None if none does."""
    return next((b for b in buckets if b >= n), None)


class DecodeCudaGraphs:
    """Graphs of the whole decode step: forward, logits and the greedy argmax of every row."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        max_bs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        dispatcher: Dispatcher | None = None,
        logits: bool = True,
        ranks: int = 1,
        replicated: bool = True,
    ) -> None:
        self.model = model
        self.dispatcher = dispatcher
        self.ranks = ranks  # of the group
        # True: every rank holds the step's tokens (tensor-parallel attention); False: each its
        # own (attention data-parallel), padded to the same bucket on every rank.
        self.replicated = replicated
        self.logits = logits  # False on ranks that do not sample
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.buckets = graph_buckets(max_bs)
        self.max_bs = max_bs
        self.width = (max_model_len + block_size - 1) // block_size
        # Every input in one int32 buffer (token ids, positions, slots, context lengths, block
        # tables), mirrored in pinned host memory: a step uploads it in two copies.
        size = max_bs * (_SMALL_ROWS + self.width)
        self.static = torch.zeros(size, dtype=torch.int32, device=device)
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self.host_np = self.host.numpy()
        self.input_ids = self.static[0:max_bs]
        self.positions = self.static[max_bs : 2 * max_bs]
        self.slot_mapping = self.static[2 * max_bs : 3 * max_bs]
        self.context_lens = self.static[3 * max_bs : 4 * max_bs]
        self.block_tables = self.static[_SMALL_ROWS * max_bs :].view(max_bs, self.width)
        self.slot_mapping.fill_(-1)
        self.tables = TableUpload(self.block_tables, self.host[_SMALL_ROWS * max_bs :], block_size)
        self.uploaded = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self.tapes: dict[int, list[Callable[[], None]]] = {}
        self.replays = 0

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            seqs=[],
            block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs],
            block_size=self.block_size,
        )

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        # padding rows have context 0; computed inside the graph, so each replay sees its own
        # (read only by the multi-rank dispatchers: one rank's MoE layer runs its rows directly)
        real = self.context_lens[:bs] > 0 if self.ranks > 1 else None
        begin_bucket_step(self.dispatcher, bs, self.ranks, self.replicated, real)
        hidden = self.model(
            self.input_ids[:bs], self.positions[:bs], self._meta(bs), self.kv_layers
        )
        if not self.logits:
            return None
        logits = self.model.compute_logits(hidden)
        return logits, torch.argmax(logits, dim=-1)

    def capture(self) -> None:
        """Largest bucket first, all sharing one memory pool. Takes seconds (kernel compiles)."""
        start = time.perf_counter()
        pool = None
        d = self.dispatcher
        for bs in reversed(self.buckets):
            for _ in range(2):  # compiles kernels and settles allocations outside the capture
                self._forward(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with host_tape(d) as tape, torch.cuda.graph(graph, pool=pool):
                out = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
            self.tapes[bs] = tape
        if d is not None:
            d.discard_step()  # the runs above are not passes
        torch.cuda.synchronize()
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s",
            self.buckets,
            time.perf_counter() - start,
        )

    def bucket_for(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def can_run(self, seqs: list[SeqPlan]) -> bool:
        return self.group_bucket([seqs]) is not None

    def group_bucket(self, per_rank: list[list[SeqPlan]]) -> int | None:
        """The bucket every rank of the group replays for a step whose ranks hold these
        sequences (one list with tensor-parallel attention), or None: the step runs without a
        decode graph on every rank. Every sequence must be a one-token decode whose block table
        fits; the largest rank's count picks the bucket, and ranks with fewer (or none) pad."""
        largest = max((len(seqs) for seqs in per_rank), default=0)
        if largest == 0 or largest > self.max_bs:
            return None
        width, bsz = self.width, self.block_size
        fits = all(
            len(s.token_ids) == 1 and (s.end + bsz - 1) // bsz <= width
            for seqs in per_rank
            for s in seqs
        )
        return self.bucket_for(largest) if fits else None

    def run(
        self, seqs: list[SeqPlan], bs: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One decode step of `seqs` in bucket `bs` (default: the smallest that holds them; see
        `group_bucket`): float32 logits [n, V] and their argmax [n], views of the graph's
        outputs (valid until the next replay); None on a rank that captured no logits. A rank
        of an attention data-parallel group replays its group's bucket even with no sequence."""
        n = len(seqs)
        bs = bs if bs is not None else self.bucket_for(n)
        assert bs is not None and n <= bs
        bsz, max_bs = self.block_size, self.max_bs
        host = self.host_np
        # The pinned buffer is refilled only once its last upload has left (a step normally
        # ends in a host sync for its sampled tokens, so this rarely waits).
        self.uploaded.synchronize()
        for i, s in enumerate(seqs):
            p = s.start
            host[i] = s.token_ids[0]
            host[max_bs + i] = p
            host[2 * max_bs + i] = s.block_table[p // bsz] * bsz + p % bsz
            host[3 * max_bs + i] = s.end
        # Padding rows: context 0 and slot -1 (no KV written, nothing attended).
        host[2 * max_bs + n : 3 * max_bs] = -1
        host[3 * max_bs + n : 4 * max_bs] = 0
        small = _SMALL_ROWS * max_bs
        self.static[:small].copy_(self.host[:small], non_blocking=True)
        self.uploaded.record()
        # only the table entries the device lacks (group_bucket checked that the tables fit)
        tables = self.tables.load(
            [s.end for s in seqs], [s.block_table for s in seqs], [s.table_id for s in seqs]
        )
        assert tables is not None
        self.graphs[bs].replay()
        self.replays += 1
        for effect in self.tapes[bs]:
            effect()
        out = self.outputs[bs]
        if out is None:
            return None
        logits, tokens = out
        return logits[:n], tokens[:n]


# ids, positions, slots, context lengths: one row of max_bs int32 each
_SMALL_ROWS = 4
