"""Prefill and mixed steps as CUDA graphs, in pieces cut at attention.

A step that is not a pure decode (prefill chunks, or chunks and decodes together) used to run
eagerly: about ten launches per layer, which on a 48-layer model take the host 30-40 ms to
issue, several times the GPU's own work for a step of a few hundred tokens
(kernels/RESULTS.md). Everything between two attention calls depends on the step's token count
only, so it is captured once per bucket of token counts; attention depends on every sequence's
context and chunk, so it runs eagerly between the pieces:

    piece 0: embedding, layer 0's norm, q|k|v, q/k norm + RoPE + KV-cache store
    attention of layer 0 (eager, the step's real rows)
    piece 1: layer 0's o_proj, MoE; layer 1's norm ... KV-cache store
    ...
    piece L: layer L-1's o_proj and MLP, the final norm

A step of `n` tokens copies its ids, positions and cache slots into the first rows of the
smallest bucket that holds it; the padding rows have slot -1 (no KV written) and their outputs
are ignored. Each piece leaves its queries in one static buffer, which the eager attention reads
(rows `:n` only) and whose output it writes into another, which the next piece reads. The pieces
of all buckets share one memory pool; a bucket's pieces always replay in order, so a piece may
reuse what an earlier piece of the same bucket no longer needs.

Like the decode graphs (engine/cuda_graph.py): every rank of a group captures the same buckets
in the same order and replays the same bucket in a step (with attention data-parallel, the
bucket of the largest rank's token count), and the host bookkeeping of the dispatcher is taped
at capture and run after each replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from safeserve.engine.cuda_graph import begin_bucket_step, host_tape, smallest_bucket
from safeserve.layers.paged_attention import AttentionMetadata, attend
from safeserve.moe.dispatch.base import Dispatcher

logger = logging.getLogger(__name__)


def piecewise_buckets(max_tokens: int) -> list[int]:
    """Token counts captured: 16, 32, 64, 128, 256, every 128 up to 1024, every 256 beyond;
    always ending at max_tokens."""
    sizes, b = [], 16
    while b < max_tokens:
        sizes.append(b)
        b = b * 2 if b < 256 else b + (128 if b < 1024 else 256)
    sizes.append(max_tokens)
    return sizes


@dataclass
class _Piece:
    graph: torch.cuda.CUDAGraph
    # The attention that follows this piece (None after the last piece).
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None
    scale: float


class PiecewiseCudaGraphs:
    """Graphs of a whole step but its attention, per bucket of the step's token count."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        max_tokens: int,
        num_heads: int,
        q_dim: int,
        out_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        dispatcher: Dispatcher | None = None,
        ranks: int = 1,
        replicated: bool = True,
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.dispatcher = dispatcher
        self.ranks = ranks
        self.replicated = replicated  # False: attention data-parallel (engine/cuda_graph.py)
        self.buckets = piecewise_buckets(max_tokens)
        self.max_tokens = max_tokens
        # ids, positions, slots: one int64 buffer, mirrored in pinned host memory.
        self.static = torch.zeros(3, max_tokens, dtype=torch.int64, device=device)
        self.host = torch.zeros(2, max_tokens, dtype=torch.int64, pin_memory=True)
        self.uploaded = torch.cuda.Event()
        # Queries out of a piece, attention output into the next: one buffer each, all layers.
        # (Per head: q as the cache's keys, the output as its values: `KVSpec.k_dim`, `v_dim`.)
        self.q_buf = torch.zeros(max_tokens, num_heads, q_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros(max_tokens, num_heads, out_dim, dtype=dtype, device=device)
        self.pieces: dict[int, list[_Piece]] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.tapes: dict[int, list[Callable[[], None]]] = {}
        self.replays = 0

    # -- capture ----------------------------------------------------------------------------------
    def _forward(self, bs: int, cut: Callable) -> torch.Tensor:
        # padding rows have slot -1 (computed inside the graph: each replay sees its own)
        real = self.static[2, :bs] >= 0 if self.ranks > 1 else None  # (as engine/cuda_graph.py)
        begin_bucket_step(self.dispatcher, bs, self.ranks, self.replicated, real)
        meta = AttentionMetadata(self.static[2, :bs], [], cut=cut)
        return self.model(self.static[0, :bs], self.static[1, :bs], meta, self.kv_layers)

    def _no_attention(self, q: torch.Tensor, kv_cache: tuple, scale: float) -> torch.Tensor:
        return self.attn_out[: q.shape[0]]

    def _capture_bucket(
        self, bs: int, pool: tuple | None, stream: torch.cuda.Stream
    ) -> tuple[list[_Piece], torch.Tensor]:
        pieces: list[_Piece] = []
        current = [torch.cuda.CUDAGraph()]

        def cut(q: torch.Tensor, kv_cache: tuple, scale: float) -> torch.Tensor:
            n = q.shape[0]
            self.q_buf[:n].copy_(q)  # the last work of this piece
            current[0].capture_end()
            pieces.append(_Piece(current[0], kv_cache, scale))
            current[0] = torch.cuda.CUDAGraph()
            current[0].capture_begin(pool=pieces[0].graph.pool())
            return self.attn_out[:n]  # the next piece reads what the attention will write

        with torch.cuda.stream(stream):
            current[0].capture_begin(pool=pool)
            try:
                hidden = self._forward(bs, cut)
            finally:
                current[0].capture_end()
        pieces.append(_Piece(current[0], None, 0.0))
        return pieces, hidden

    def capture(self) -> None:
        """Largest bucket first, all sharing one memory pool."""
        start = time.perf_counter()
        self.static[2].fill_(-1)  # no KV written while capturing
        stream = torch.cuda.Stream()
        pool = None
        d = self.dispatcher
        for bs in reversed(self.buckets):
            # Compiles this size's kernels and settles allocations outside the capture.
            self._forward(bs, self._no_attention)
            torch.cuda.synchronize()
            with host_tape(d) as tape:
                pieces, hidden = self._capture_bucket(bs, pool, stream)
            pool = pieces[0].graph.pool()
            self.pieces[bs] = pieces
            self.hidden[bs] = hidden
            self.tapes[bs] = tape
        if d is not None:
            d.discard_step()
        torch.cuda.synchronize()
        logger.info(
            "captured piecewise CUDA graphs for %d token counts up to %d in %.1f s",
            len(self.buckets),
            self.max_tokens,
            time.perf_counter() - start,
        )

    # -- replay -----------------------------------------------------------------------------------
    def can_run(self, num_tokens: int) -> bool:
        """Whether a step whose largest rank holds `num_tokens` tokens runs as these graphs."""
        return 0 < num_tokens <= self.max_tokens

    def run(
        self,
        ids: list[int],
        positions: list[int],
        meta: AttentionMetadata,
        group_tokens: int | None = None,
    ) -> torch.Tensor:
        """The step's final hidden states [n, H] (a view, valid until the next replay).
        `group_tokens`: the largest token count of the group's ranks (attention data-parallel),
        whose bucket every rank replays; a rank with no tokens replays it too."""
        n = len(ids)
        bs = smallest_bucket(self.buckets, max(n, group_tokens or 0))
        assert bs is not None
        self.uploaded.synchronize()  # the pinned buffer's last upload has left
        self.host[0, :n] = torch.tensor(ids, dtype=torch.int64)
        self.host[1, :n] = torch.tensor(positions, dtype=torch.int64)
        self.static[:2, :n].copy_(self.host[:, :n], non_blocking=True)
        self.uploaded.record()
        self.static[2, :n].copy_(meta.slot_mapping)
        if bs > n:
            self.static[2, n:bs].fill_(-1)  # padding rows: no KV written
        for piece in self.pieces[bs]:
            piece.graph.replay()
            if piece.kv_cache is not None and n:
                out = attend(self.q_buf[:n], piece.kv_cache, meta, piece.scale)
                self.attn_out[:n].copy_(out)
        self.replays += 1
        for effect in self.tapes[bs]:
            effect()
        return self.hidden[bs][:n]
