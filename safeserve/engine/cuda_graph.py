"""Decode steps as CUDA graphs, one graph per batch-size bucket.

A decode step launches hundreds of small kernels (48 layers × norm, projections, RoPE, KV store,
attention, router, two grouped GEMMs, ...); replayed as one graph, host launch overhead drops
out. Each bucket's graph reads its inputs from static buffers: a step of `n` sequences copies its
token ids, positions, slots, context lengths and block tables into the first `n` rows of the
smallest bucket that holds it; the padding rows have context 0 and slot -1, so they write no KV
and attend to nothing. Everything inside the forward must be capture-safe (no host sync): on
CUDA that is the Triton fused MoE, top-k and decode-attention path.
"""

from __future__ import annotations

import logging
import time

import torch

from safeserve.engine.attention import AttentionMetadata
from safeserve.engine.plan import SeqPlan

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


class DecodeCudaGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        max_bs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.buckets = graph_buckets(max_bs)
        self.max_bs = max_bs
        width = (max_model_len + block_size - 1) // block_size
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_bs, width, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            seqs=[],
            block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs],
            block_size=self.block_size,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs), self.kv_layers)

    def capture(self) -> None:
        """Largest bucket first, all sharing one memory pool. Takes seconds (kernel compiles)."""
        start = time.perf_counter()
        pool = None
        for bs in reversed(self.buckets):
            for _ in range(2):  # compiles kernels and settles allocations outside the capture
                self._forward(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
        torch.cuda.synchronize()
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s",
            self.buckets,
            time.perf_counter() - start,
        )

    def bucket_for(self, n: int) -> int | None:
        for bs in self.buckets:
            if bs >= n:
                return bs
        return None

    def can_run(self, seqs: list[SeqPlan]) -> bool:
        if not seqs or len(seqs) > self.max_bs:
            return False
        width = self.block_tables.shape[1]
        return all(
            len(s.token_ids) == 1 and (s.end + self.block_size - 1) // self.block_size <= width
            for s in seqs
        )

    def run(self, seqs: list[SeqPlan]) -> torch.Tensor:
        """Final hidden states [n, H] of one decode step of `seqs` (check `can_run` first)."""
        n = len(seqs)
        bs = self.bucket_for(n)
        assert bs is not None
        bsz = self.block_size
        ids, pos, slots, ctx, rows = [], [], [], [], []
        width = max((s.end + bsz - 1) // bsz for s in seqs)
        for s in seqs:
            p = s.start
            ids.append(s.token_ids[0])
            pos.append(p)
            slots.append(s.block_table[p // bsz] * bsz + p % bsz)
            ctx.append(s.end)
            table = s.block_table[:width]
            rows.append(table + [0] * (width - len(table)))
        pad = bs - n
        host = torch.tensor(ids + pos + slots, dtype=torch.int64)
        self.input_ids[:n].copy_(host[:n], non_blocking=True)
        self.positions[:n].copy_(host[n : 2 * n], non_blocking=True)
        self.slot_mapping[:n].copy_(host[2 * n : 3 * n], non_blocking=True)
        if pad:
            self.context_lens[n:bs].zero_()
            self.slot_mapping[n:bs].fill_(-1)
        self.context_lens[:n].copy_(torch.tensor(ctx, dtype=torch.int32), non_blocking=True)
        self.block_tables[:n, :width].copy_(
            torch.tensor(rows, dtype=torch.int32), non_blocking=True
        )
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
