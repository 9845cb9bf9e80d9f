"""Attention over the paged KV cache.

The cache of one layer is a pair of tensors `[num_blocks * block_size, kv_heads, dim]` (keys,
values); for multi-head latent attention one tensor of one latent vector per token, the values
being a view of its first entries (`is_latent`). A token at position `p` of a request lives in
slot `block_table[p // block_size] * block_size + p % block_size`. Each step writes the new
tokens' keys/values into their slots, then every sequence attends over slots
`0 .. context_len-1` read back through its block table.

Two paths. On CUDA everything runs Triton kernels straight over the block tables, with no
per-sequence loop (in batch-invariant mode every token, prefill or decode, is a row of the decode
kernel at its own position, with splits of a fixed length): the sequences that decode one token
run the decode kernel
(`safeserve.kernels.paged_attention`, CUDA graph safe: all of a pure decode step, and the
decoding rows of a mixed step in one launch); the prefill chunks of a step run the prefill kernel
(`safeserve.kernels.paged_prefill`, one launch for all of them); over a latent cache the MLA
kernels do both (`safeserve.kernels.mla_attention`). On CPU (and with
`use_kernels=False`) the torch path below runs one SDPA call per sequence; it is also the
kernels' test oracle. The model stores this step's
keys/values itself (fused with q/k norm and RoPE: `safeserve.kernels.norm_rope`) and calls
`attend`; `paged_attention` is store-then-attend for callers holding k and v.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from safeserve.kernels import mla_attention as mla
from safeserve.kernels import paged_attention as pa
from safeserve.kernels import paged_prefill as pp
from safeserve.kernels.common import batch_invariant
from safeserve.kernels.kv_quant import to_cache
from safeserve.layers.block_tables import TableUpload


@dataclass
class SeqAttention:
    """One sequence of the batch: its query rows and the cache slots of its whole context."""

    query_start: int  # first row of this sequence in the flattened batch
    query_len: int  # tokens computed this step
    context_len: int  # tokens in the cache after this step (computed before + query_len)
    kv_slots: torch.Tensor  # [context_len] int64 cache slots, in position order


@dataclass
class PrefillBatch:
    """The prefill kernel's view of a step's chunks (CUDA): [S, W] int32 block tables, [S, 3]
    int32 (context length, first query row, query length), the longest chunk, and the kernel's
    tiles for it (`paged_prefill.prefill_config`, chosen once a step, not once a layer)."""

    block_tables: torch.Tensor
    info: torch.Tensor
    max_q_len: int
    config: dict[str, int] | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V goes (-1: nowhere)
    seqs: list[SeqAttention]  # the torch path's view; empty on the decode-kernel path
    # Decode-kernel path (CUDA, one query token per sequence): [B, W] int32 block tables,
    # [B] int32 context lengths (0 for padding rows), and the block size.
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_size: int = 0
    # Mixed step (CUDA): the rows that decode one token, and their decode-kernel metadata.
    decode_rows: torch.Tensor | None = None
    decode: AttentionMetadata | None = None
    # Prefill kernel (CUDA): every chunk of more than one token; block_size as above.
    prefill: PrefillBatch | None = None
    # While piecewise CUDA graphs capture (engine/piecewise_graph.py): called by `attend` in
    # place of attention, with (q, kv_cache, scale); returns the buffer the output will be in.
    cut: Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor], float], torch.Tensor] | None = (
        None
    )

    @property
    def is_decode_kernel(self) -> bool:
        return self.block_tables is not None

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        use_kernels: bool = True,
        table_ids: list[int] | None = None,
        tables: TableUpload | None = None,
    ) -> AttentionMetadata:
        """`use_kernels=False` forces the torch path (the kernels' oracle in tests). With
        `table_ids` (SeqPlan.table_id) and `tables` (layers/block_tables.py, TableUpload) the
        decode rows' block tables go up by difference."""
        kernels = use_kernels and _kernels_apply(device)
        ids = table_ids if table_ids is not None else [-1] * len(query_lens)
        if kernels and all(n == 1 for n in query_lens):
            return AttentionMetadata.build_decode(
                context_lens, block_tables, block_size, device, ids, tables
            )
        if kernels and batch_invariant():
            # Every token a row of the decode kernel at its own position (its context: the
            # tokens up to it), so a prompt's prefill computes each token's attention exactly
            # as the decode step that produced that token did.
            return AttentionMetadata.build_token_rows(
                query_lens, context_lens, block_tables, block_size, device
            )
        seqs: list[SeqAttention] = []
        # host slots (decodes: ints; kernel prefill: CPU tensors), or device slots (torch path)
        slot_chunks: list[torch.Tensor | list[int]] = []
        dec_rows: list[int] = []
        dec_ctx: list[int] = []
        dec_tables: list[list[int]] = []
        dec_ids: list[int] = []
        pre_tables: list[list[int]] = []
        pre_ctx: list[int] = []
        pre_starts: list[int] = []
        pre_lens: list[int] = []
        start = 0
        for q_len, ctx, table, tid in zip(query_lens, context_lens, block_tables, ids, strict=True):
            if kernels and q_len == 1:
                dec_rows.append(start)
                dec_ctx.append(ctx)
                dec_tables.append(table)
                dec_ids.append(tid)
                slot = table[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size
                if slot_chunks and isinstance(slot_chunks[-1], list):
                    slot_chunks[-1].append(slot)
                else:
                    slot_chunks.append([slot])
                start += 1
                continue
            if kernels:  # the prefill kernel reads the block table; only the new slots go up
                pre_tables.append(table[: (ctx + block_size - 1) // block_size])
                pre_ctx.append(ctx)
                pre_starts.append(start)
                pre_lens.append(q_len)
                slot_chunks.append(_slots(table, ctx - q_len, ctx, block_size))
                start += q_len
                continue
            slots = _slots(table, 0, ctx, block_size).to(device)
            seqs.append(SeqAttention(start, q_len, ctx, slots))
            slot_chunks.append(slots[ctx - q_len :])
            start += q_len
        chunks = [
            torch.tensor(c, dtype=torch.int64) if isinstance(c, list) else c for c in slot_chunks
        ]
        if chunks and all(c.device.type == "cpu" for c in chunks):
            slot_mapping = torch.cat(chunks).to(device)  # one upload
        elif chunks:
            slot_mapping = torch.cat([c.to(device) for c in chunks])
        else:
            slot_mapping = torch.empty(0, dtype=torch.int64, device=device)
        meta = AttentionMetadata(slot_mapping, seqs, block_size=block_size)
        if dec_rows:
            meta.decode_rows = torch.tensor(dec_rows, dtype=torch.int64).to(device)
            meta.decode = AttentionMetadata.build_decode(
                dec_ctx, dec_tables, block_size, device, dec_ids, tables
            )
        if pre_tables:
            width = max(len(t) for t in pre_tables)
            rows = [t + [0] * (width - len(t)) for t in pre_tables]
            meta.prefill = PrefillBatch(
                block_tables=torch.tensor(rows, dtype=torch.int32).to(device),
                info=pp.prefill_info(pre_starts, pre_lens, pre_ctx).to(device),
                max_q_len=max(pre_lens),
                config=pp.prefill_config(torch.device(device), max(pre_lens)),
            )
        return meta

    @staticmethod
    def build_token_rows(
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Decode-kernel metadata with one row per token of the step: a sequence's q_len tokens
        at positions ctx - q_len .. ctx - 1, each row with that sequence's block table and the
        context up to and including its token."""
        width = max(((ctx + block_size - 1) // block_size for ctx in context_lens), default=1)
        per_seq = torch.tensor(
            [
                t[: (ctx + block_size - 1) // block_size]
                + [0] * (width - (ctx + block_size - 1) // block_size)
                for t, ctx in zip(block_tables, context_lens, strict=True)
            ],
            dtype=torch.int32,
        ).reshape(len(block_tables), width)
        lens = torch.tensor(query_lens, dtype=torch.int64)
        rows_ctx = torch.cat(
            [
                torch.arange(ctx - n + 1, ctx + 1)
                for n, ctx in zip(query_lens, context_lens, strict=True)
            ]
        )
        slots = torch.cat(
            [
                _slots(t, ctx - n, ctx, block_size)
                for n, ctx, t in zip(query_lens, context_lens, block_tables, strict=True)
            ]
        )
        return AttentionMetadata(
            slot_mapping=slots.to(device, non_blocking=True),
            seqs=[],
            block_tables=per_seq.repeat_interleave(lens, dim=0).to(device, non_blocking=True),
            context_lens=rows_ctx.to(torch.int32).to(device, non_blocking=True),
            block_size=block_size,
        )

    @staticmethod
    def build_decode(
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        table_ids: list[int] | None = None,
        tables: TableUpload | None = None,
    ) -> AttentionMetadata:
        """Metadata of the decode kernel: one query token per sequence, at position ctx - 1.
        With `tables` (TableUpload) and `table_ids` the block tables are its device rows, which
        it uploads by difference; else they are built whole from the lists."""
        widths = [(ctx + block_size - 1) // block_size for ctx in context_lens]
        width = max(widths, default=1)
        device_tables = None
        if tables is not None and table_ids is not None:
            device_tables = tables.load(context_lens, block_tables, table_ids)
        if device_tables is not None:
            # only the columns the longest context uses (rows keep the full stride): the decode
            # grid's splits follow the table's width, which is --max-model-len's otherwise
            device_tables = device_tables[:, :width]
        else:
            rows = [t[:w] + [0] * (width - w) for t, w in zip(block_tables, widths, strict=True)]
            device_tables = (
                torch.tensor(rows, dtype=torch.int32)
                .reshape(len(rows), width)
                .to(device, non_blocking=True)
            )
        slots = [
            t[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size
            for t, ctx in zip(block_tables, context_lens, strict=True)
        ]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
            seqs=[],
            block_tables=device_tables,
            context_lens=torch.tensor(context_lens, dtype=torch.int32).to(
                device, non_blocking=True
            ),
            block_size=block_size,
        )


def _slots(table: list[int], lo: int, hi: int, block_size: int) -> torch.Tensor:
    """Cache slots (int64, on the host) of positions lo .. hi-1 of a sequence's block table."""
    pos = torch.arange(lo, hi)
    blocks = torch.tensor(table[: (hi + block_size - 1) // block_size], dtype=torch.int64)
    return blocks[pos // block_size] * block_size + pos % block_size


def _kernels_apply(device: torch.device | str) -> bool:
    """The attention kernels run: CUDA, with Triton."""
    return pa.HAS_TRITON and torch.device(device).type == "cuda"


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens. Returns [T, Hq, D]."""
    k_cache, v_cache = kv_cache
    if meta.is_decode_kernel:
        pa.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        k_cache[meta.slot_mapping] = to_cache(k, k_cache.dtype)
        v_cache[meta.slot_mapping] = to_cache(v, v_cache.dtype)
    return attend(q, kv_cache, meta, scale)


def attend(
    q: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the cache, this step's keys/values already stored."""
    if meta.cut is not None:
        return meta.cut(q, kv_cache, scale)
    k_cache, v_cache = kv_cache
    latent = is_latent(kv_cache)

    def decode(rows: torch.Tensor, d: AttentionMetadata) -> torch.Tensor:
        assert d.block_tables is not None and d.context_lens is not None
        if latent:
            return mla.mla_decode(
                rows,
                k_cache,
                d.block_tables,
                d.context_lens,
                d.block_size,
                scale,
                v_cache.shape[-1],
            )
        return pa.paged_decode(
            rows, k_cache, v_cache, d.block_tables, d.context_lens, d.block_size, scale
        )

    if meta.is_decode_kernel:
        return decode(q, meta)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = q.new_empty(*q.shape[:-1], v_cache.shape[-1])
    if meta.prefill is not None:
        p = meta.prefill
        if latent:
            mla.mla_prefill(
                q, k_cache, p.block_tables, p.info, p.max_q_len, meta.block_size, scale,
                v_cache.shape[-1], out,
            )  # fmt: skip
        else:
            pp.paged_prefill(
                q, k_cache, v_cache, p.block_tables, p.info, p.max_q_len, meta.block_size, scale,
                out, p.config,
            )  # fmt: skip
    if meta.decode is not None and meta.decode_rows is not None:
        out[meta.decode_rows] = decode(q[meta.decode_rows], meta.decode)
    for s in meta.seqs:
        rows = slice(s.query_start, s.query_start + s.query_len)
        qs = q[rows].transpose(0, 1)  # [Hq, q, D]
        ks = k_cache[s.kv_slots].to(q.dtype).transpose(0, 1)  # [Hkv, ctx, D]
        vs = v_cache[s.kv_slots].to(q.dtype).transpose(0, 1)
        if group > 1:
            ks = ks.repeat_interleave(group, dim=0)
            vs = vs.repeat_interleave(group, dim=0)
        # Query i sits at position context_len - query_len + i and sees keys 0..that position.
        q_pos = torch.arange(s.context_len - s.query_len, s.context_len, device=q.device)
        k_pos = torch.arange(s.context_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[rows] = o.transpose(0, 1)
    return out


def is_latent(kv_cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether the cache is one latent vector per token whose first entries are the values
    (multi-head latent attention: `KVSpec.v_in_k`): the value tensor is a view of the key
    tensor, shorter than it."""
    k_cache, v_cache = kv_cache
    return v_cache.data_ptr() == k_cache.data_ptr() and v_cache.shape[-1] < k_cache.shape[-1]
