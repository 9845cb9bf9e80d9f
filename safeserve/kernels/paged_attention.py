"""Paged-attention decode and KV-cache store (Triton), with torch reference paths.

The cache of one layer is `[num_blocks * block_size, kv_heads, head_dim]`; token `p` of a
sequence lives in slot `block_tables[b, p // block_size] * block_size + p % block_size`.

* `store_kv` writes this step's keys/values into their slots in one launch; a slot of -1 is
  skipped (the padding rows of a CUDA-graph batch write nowhere).
* `paged_decode` attends one query token per sequence over its whole context, read straight
  through the block table (flash-decoding): programs are (sequence, kv head, split of the
  context); each holds all query heads of its kv head as one row tile (GQA) and keeps an online
  softmax. One launch: where a context spans several splits, the last of them to finish (an
  arrival counter per sequence and kv head) merges them. A sequence with context 0 gets zeros.
  Every grid and buffer depends on shapes only, so a decode step can be captured in a CUDA
  graph.

The torch references (`store_kv_torch`, `paged_decode_torch`) are the oracles of the GPU tests;
CPU runs never reach the kernels (unless TRITON_INTERPRET=1). The kernels themselves are in
`safeserve.kernels.paged_attention_kernels`.
"""

from __future__ import annotations

import torch

from safeserve.kernels.common import (
    HAS_TRITON,
    batch_invariant,
    next_power_of_2,
    pdl_supported,
    triton,
    use_kernels,
    zeroed_counters,
)
from safeserve.kernels.kv_quant import to_cache

if HAS_TRITON:
    from safeserve.kernels.paged_attention_kernels import (
        _decode_kernel,
        _store_kv_kernel,
    )

# Tokens one program loads per iteration, and the programs a decode launch aims for (about four
# per multiprocessor on an H100/H200), which sets how finely a short batch splits its contexts.
_BLOCK_N = 64
# --enable-deterministic-inference: every context is cut into splits of this many tokens (whole
# tiles of _BLOCK_N), whatever the batch and the table's width.
INVARIANT_SPLIT_TOKENS = 2 * _BLOCK_N
_TARGET_PROGRAMS = 512
# Partial-sum elements the merge loads at once ([heads, splits, head dim]): as many splits per
# pass as fit, so the few splits a context holds are read in one or two passes (one split or
# many is a runtime branch of the decode kernel, num_splits is not specialized: eager decode
# steps of any batch and context, and every graph bucket, use one compiled variant).
_MERGE_TILE = 8192


# ---------------------------------------------------------------------------------------------
# Torch references.
# ---------------------------------------------------------------------------------------------


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    ok = slot_mapping >= 0
    slots = slot_mapping[ok]
    k_cache[slots] = to_cache(k[ok], k_cache.dtype)
    v_cache[slots] = to_cache(v[ok], v_cache.dtype)


def paged_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, D]; one query per sequence at its last position. Returns [B, Hq, D]."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for b, ctx in enumerate(context_lens.tolist()):
        if ctx <= 0:
            continue
        n_blocks = (ctx + block_size - 1) // block_size
        blocks = block_tables[b, :n_blocks].to(torch.int64)
        pos = torch.arange(block_size, device=q.device)
        slots = (blocks[:, None] * block_size + pos[None, :]).reshape(-1)[:ctx]
        ks = k_cache[slots].float().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        vs = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].float(), ks) * scale
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("ht,thd->hd", probs, vs).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Entry points.
# ---------------------------------------------------------------------------------------------


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k/v [T, Hkv, D] into the caches at `slot_mapping` [T] (-1 = skip)."""
    if not use_kernels(k):
        store_kv_torch(k, v, k_cache, v_cache, slot_mapping)
        return
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    width = num_kv_heads * head_dim
    block = min(1024, next_power_of_2(width))
    pdl = pdl_supported(k.device)
    _store_kv_kernel[(num_tokens, triton.cdiv(width, block))](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        head_dim,
        width,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        BLOCK=block,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )


def decode_splits(batch: int, num_kv_heads: int, max_context: int) -> int:
    """The decode grid's splits per (sequence, kv head): enough programs to fill the GPU, no more
    than the table holds tiles of `_BLOCK_N`; the kernel cuts each context into at most as many."""
    most = max(1, triton.cdiv(max_context, _BLOCK_N) if HAS_TRITON else 1)
    want = max(1, -(-_TARGET_PROGRAMS // max(1, batch * num_kv_heads)))
    return min(most, want)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache: q [B, Hq, D] -> [B, Hq, D].

    block_tables [B, W] int32 (W * block_size bounds every context); context_lens [B] int32,
    the tokens in the cache including this step's. No host synchronisation. Its arrival
    counters (`zeroed_counters`, batch x kv heads words) are never allocated inside a CUDA-graph
    capture: run a batch at least as large once eagerly before capturing.
    """
    if not use_kernels(q):
        return paged_decode_torch(
            q, k_cache, v_cache, block_tables, context_lens, block_size, scale
        )
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    max_context = block_tables.shape[1] * block_size
    if batch_invariant():  # splits of a fixed length: a row's sums follow its context alone
        split_tokens = INVARIANT_SPLIT_TOKENS
        splits = max(1, triton.cdiv(max_context, split_tokens))
    else:
        split_tokens = 0
        splits = decode_splits(batch, num_kv_heads, max_context)  # the kernel cuts each context
    d_pad = next_power_of_2(head_dim)
    g_pad = max(16, next_power_of_2(group))  # the decode's row tile (tl.dot takes 16 rows)
    m_pad = next_power_of_2(group)  # the merge's (no tl.dot there)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    pdl = pdl_supported(q.device)
    if splits > 1:
        acc = torch.empty(batch, num_heads, splits, d_pad, dtype=torch.float32, device=q.device)
        stats = torch.empty(batch, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    else:  # not read; float32 all the same, so one split or many is one compiled variant
        acc = stats = torch.empty(0, dtype=torch.float32, device=q.device)
    # one counter per (sequence, kv head), and one per group of merged splits (the kernel's
    # two-level merge)
    s_chunk = max(2, _MERGE_TILE // (m_pad * d_pad))  # splits per merge pass
    groups = triton.cdiv(splits, s_chunk)
    sync = zeroed_counters(q.device, batch * num_kv_heads * (1 + groups), "paged_decode")
    _decode_kernel[(batch, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        acc,
        stats,
        sync,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        splits,
        split_tokens,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_N=_BLOCK_N,
        PAGE=block_size,
        DOT_PRECISION=precision,
        M_PAD=m_pad,
        S_CHUNK=s_chunk,
        WHILE_LOOP=not q.is_cuda,
        USE_PDL=pdl,
        num_warps=4,
        num_stages=2,
        launch_pdl=pdl,
    )
    return out
