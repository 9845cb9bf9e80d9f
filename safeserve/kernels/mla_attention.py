"""Multi-head latent attention (DeepSeek-V2/V3, Moonlight) over the paged latent cache (Triton),
with torch references: decode (one query token per sequence, CUDA-graph safe) and prefill (chunks
of query tokens, causal, over contexts that may hold earlier chunks).

The cache of one layer is one tensor `cache [num_slots, 1, Dk]`; per token it holds the
normalized latent (its first `v_dim` = kv_lora_rank entries) followed by the rotated rope key
(Dk - v_dim = qk_rope_head_dim entries). The values are the latent itself (`cache[..., :v_dim]`,
a view), shared by every head. Token `p` of a sequence lives in slot `block_tables[s, p //
block_size] * block_size + p % block_size`. The query is absorbed (`q_nope @ W_UK ‖ q_pe`):
`q [T, H, Dk]`; the output is in the latent space: `[T, H, v_dim]`.

* `mla_decode`: programs are (head block, split of the context, sequence); a program holds
  BLOCK_H heads of its sequence as one row tile and reads each latent tile once for all of them
  (the bytes read are the latent cache, not per head), keeping an online softmax in float32.
  A context longer than one split is spread over several programs (split-K, flash-decoding)
  whose float32 partials a second launch (`_mla_combine_kernel`, one program per sequence and
  head) merges in a fixed order. The merge is its own launch, not done by the last split to
  arrive as in `paged_decode`: a partial here is BLOCK_H x v_dim floats (32 KiB at 16 heads of
  512), so one program merging a sequence's splits would read them serially; one program per
  head reads them in parallel. Grids and buffers depend on shapes only (the splits follow the
  block table's width, not the contexts), nothing reads back to the host: CUDA-graph safe, and
  no arrival counters. A sequence with context 0 (a graph batch's padding row) gets zeros.
* `mla_prefill`: programs are (sequence x tile of query tokens, head block), each holding the
  tile's tokens times a block of heads as one row tile; causal: query i of a chunk of q_len
  over a context of ctx sits at position ctx - q_len + i. `info` as for
  `safeserve.kernels.paged_prefill` (`prefill_info`).

The torch references (`mla_decode_torch`, `mla_prefill_torch`) are the CPU path and the tests'
oracles; the kernels are in `safeserve.kernels.mla_attention_kernels`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from safeserve.kernels.common import (
    HAS_TRITON,
    next_power_of_2,
    pdl_supported,
    shared_memory_per_program,
    triton,
    use_kernels,
)

if HAS_TRITON:
    from safeserve.kernels.mla_attention_kernels import (
        _mla_combine_kernel,
        _mla_decode_kernel,
        _mla_prefill_kernel,
    )

# Decode: heads per program (tl.dot takes 16 rows at least), context tokens per loop step, the
# shortest split, and the programs a launch aims for (four per multiprocessor of an H100/H200).
# A split's float32 partial (block_h x v_dim: 32 KiB at 16 heads of 512) costs about what 28
# tokens of a 576-entry bf16 cache do, so splits stay well above that; but one program walks
# its split tile after tile (about 2 us a tile of 32 tokens on an H200, measured), so short
# contexts need many of them: 128 tokens and 528 programs were the best of those timed by
# kernels/bench_mla_decode.py on an H200 at 16 heads of 576 / 512 (1-64 sequences, 512-4,096
# tokens).
DECODE_CONFIG: dict[str, int] = {
    "block_h": 16,
    "block_n": 32,
    "min_split": 128,
    "target_programs": 528,
    "num_warps": 4,
    "num_stages": 2,
}
# Prefill: rows (query tokens x heads of a block) per program, context tokens per loop step.
# Wide latents (kv_lora_rank 512) hold a rows x v_dim float32 accumulator: fewer rows per warp.
PREFILL_CONFIGS: dict[str, dict[str, int]] = {
    "narrow": {"rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
    "wide": {"rows": 64, "block_n": 32, "num_warps": 8, "num_stages": 2},
}
# Partial-sum elements the combine loads at once ([splits, v_dim]).
_COMBINE_TILE = 8192
# Shared memory left over for what the estimate below does not count (layout conversions).
_SHARED_SLACK = 16 * 1024


def _dims(head_dim: int, v_dim: int) -> tuple[int, int, int]:
    """(latent dim padded, rope dim, rope dim padded); tl.dot's inner dims take 16 at least."""
    if not 0 < v_dim <= head_dim:
        raise ValueError(f"v_dim {v_dim} must be in 1 .. the cache's entry size {head_dim}")
    rope = head_dim - v_dim
    return max(16, next_power_of_2(v_dim)), rope, max(16, next_power_of_2(rope))


def _fit(cfg: dict[str, int], width: int, elem: int, device: torch.device) -> None:
    """Shrinks cfg in place (stages, then block_n, then a prefill's rows) until its estimated
    shared memory fits a program on `device`: the query rows and the pipelined latent tiles
    (an over-estimate: compiled for sm_90, the shipped tiles take 64 KiB (decode) and 108 KiB
    (prefill) in bf16 at 576 entries)."""
    budget = shared_memory_per_program(device) - _SHARED_SLACK

    def need() -> int:
        rows = cfg.get("rows", cfg.get("block_h", 16))
        n = cfg["block_n"]
        return (rows * width + cfg["num_stages"] * n * width + rows * n) * elem

    while need() > budget:
        if cfg["num_stages"] > 1:
            cfg["num_stages"] -= 1
        elif cfg["block_n"] > 16:
            cfg["block_n"] //= 2
        elif cfg.get("rows", 16) > 16:
            cfg["rows"] //= 2
        else:
            break


def decode_config(device: torch.device, dtype: torch.dtype, head_dim: int, v_dim: int) -> dict:
    """The decode launch's tiles for this device, dtype and cache entry (a copy)."""
    cfg = dict(DECODE_CONFIG)
    dv_pad, _, dr_pad = _dims(head_dim, v_dim)
    elem = dtype.itemsize
    _fit(cfg, dv_pad + dr_pad, elem, device)
    return cfg


def prefill_config(device: torch.device, dtype: torch.dtype, head_dim: int, v_dim: int) -> dict:
    """The prefill launch's tiles for this device, dtype and cache entry (a copy)."""
    dv_pad, _, dr_pad = _dims(head_dim, v_dim)
    cfg = dict(PREFILL_CONFIGS["wide" if dv_pad + dr_pad > 256 else "narrow"])
    elem = dtype.itemsize
    _fit(cfg, dv_pad + dr_pad, elem, device)
    return cfg


def decode_splits(batch: int, head_blocks: int, max_context: int, cfg: dict[str, int]) -> int:
    """The decode grid's splits per (sequence, head block): enough programs to fill the GPU,
    no more than the table's width holds splits of `min_split` tokens. Shapes only."""
    most = max(1, -(-max_context // cfg["min_split"]))
    want = max(1, -(-cfg["target_programs"] // max(1, batch * head_blocks)))
    return min(most, want)


# ---------------------------------------------------------------------------------------------
# Torch references.
# ---------------------------------------------------------------------------------------------


def _context_slots(table: torch.Tensor, ctx: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(ctx, device=table.device)
    return table.to(torch.int64)[pos // block_size] * block_size + pos % block_size


def mla_decode_torch(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    v_dim: int,
) -> torch.Tensor:
    """q [B, H, Dk], one query per sequence at its last position; computed in float32 (or q's
    dtype, if wider). Returns [B, H, v_dim] in q's dtype; context 0: zeros."""
    work = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(q.shape[0], q.shape[1], v_dim)
    for b, ctx in enumerate(context_lens.tolist()):
        if ctx <= 0:
            continue
        kv = cache[_context_slots(block_tables[b], ctx, block_size), 0].to(work)  # [ctx, Dk]
        probs = torch.softmax((q[b].to(work) @ kv.T) * scale, dim=-1)  # [H, ctx]
        out[b] = (probs @ kv[:, :v_dim]).to(q.dtype)
    return out


def mla_prefill_torch(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    info: torch.Tensor,
    block_size: int,
    scale: float,
    v_dim: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """One causal SDPA per sequence over its context gathered from the cache (keys: the whole
    entries; values: their first v_dim), in q's dtype as the engine's torch path computes."""
    heads = q.shape[1]
    for s, (ctx, start, q_len) in enumerate(info.tolist()):
        if q_len <= 0:
            continue
        kv = cache[_context_slots(block_tables[s], ctx, block_size), 0].to(q.dtype)
        ks = kv[None].expand(heads, ctx, kv.shape[-1])
        vs = kv[None, :, :v_dim].expand(heads, ctx, v_dim)
        qs = q[start : start + q_len].transpose(0, 1)  # [H, q_len, Dk]
        pos = torch.arange(ctx, device=q.device)
        mask = pos[None, :] <= torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[start : start + q_len] = o.transpose(0, 1).to(out.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Entry points.
# ---------------------------------------------------------------------------------------------


def _check(q: torch.Tensor, cache: torch.Tensor) -> None:
    if cache.dim() != 3 or cache.shape[1] != 1 or cache.shape[2] != q.shape[-1]:
        raise ValueError(f"cache {tuple(cache.shape)} is not [slots, 1, {q.shape[-1]}]")
    if cache.stride(2) != 1:
        raise ValueError("the cache's entries must be contiguous")


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    v_dim: int,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Decode attention over the paged latent cache: q [B, H, Dk] -> [B, H, v_dim].

    block_tables [B, W] int32 (W * block_size bounds every context; its width sets the
    splits); context_lens [B] int32, the tokens in the cache including this step's (0: a
    padding row, zeros). No host synchronisation, grids from shapes only: capturable in a CUDA
    graph. `config`: tiles (default `decode_config`)."""
    if not use_kernels(q):
        ref = mla_decode_torch(q, cache, block_tables, context_lens, block_size, scale, v_dim)
        return ref if out is None else out.copy_(ref)
    _check(q, cache)
    batch, num_heads, head_dim = q.shape
    dv_pad, rope, dr_pad = _dims(head_dim, v_dim)
    if out is None:
        out = q.new_empty(batch, num_heads, v_dim)
    if batch == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    cfg = config or decode_config(q.device, q.dtype, head_dim, v_dim)
    block_h, block_n = cfg["block_h"], cfg["block_n"]
    min_split = max(block_n, cfg["min_split"] // block_n * block_n)
    head_blocks = triton.cdiv(num_heads, block_h)
    splits = decode_splits(batch, head_blocks, block_tables.shape[1] * block_size, cfg)
    if splits > 1:
        acc = torch.empty(batch, num_heads, splits, dv_pad, dtype=torch.float32, device=q.device)
        stats = torch.empty(batch, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    else:  # not read; float32 all the same, so one split or many is one compiled variant
        acc = stats = torch.empty(0, dtype=torch.float32, device=q.device)
    pdl = pdl_supported(q.device)
    interpret = not q.is_cuda
    _mla_decode_kernel[(head_blocks, splits, batch)](
        q,
        cache,
        block_tables,
        context_lens,
        out,
        acc,
        stats,
        scale,
        num_heads,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        splits,
        DV=v_dim,
        DV_PAD=dv_pad,
        DR=rope,
        DR_PAD=dr_pad,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        MIN_SPLIT=min_split,
        PAGE=block_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WHILE_LOOP=interpret,
        USE_PDL=pdl,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        launch_pdl=pdl,
    )
    if splits > 1:
        _mla_combine_kernel[(num_heads, batch)](
            context_lens,
            out,
            acc,
            stats,
            num_heads,
            out.stride(0),
            out.stride(1),
            splits,
            DV=v_dim,
            DV_PAD=dv_pad,
            BLOCK_N=block_n,
            MIN_SPLIT=min_split,
            S_CHUNK=max(2, min(32, _COMBINE_TILE // dv_pad)),
            USE_PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )
    return out


def mla_prefill(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    info: torch.Tensor,
    max_q_len: int,
    block_size: int,
    scale: float,
    v_dim: int,
    out: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Writes the attention of every sequence's query rows into `out` [T, H, v_dim] (other rows
    are left as they are). q [T, H, Dk]; block_tables [S, W] int32; info [S, 3] int32 (context
    length, first query row, query length: `paged_prefill.prefill_info`), on q's device;
    max_q_len = the longest chunk. `config`: tiles (default `prefill_config`)."""
    if not use_kernels(q):
        return mla_prefill_torch(q, cache, block_tables, info, block_size, scale, v_dim, out)
    _check(q, cache)
    num_seqs = info.shape[0]
    if num_seqs == 0 or max_q_len <= 0:
        return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    dv_pad, rope, dr_pad = _dims(head_dim, v_dim)
    cfg = config or prefill_config(q.device, q.dtype, head_dim, v_dim)
    block_h = min(next_power_of_2(num_heads), cfg["rows"])
    block_m = max(1, cfg["rows"] // block_h)
    tiles = triton.cdiv(max_q_len, block_m)
    q = q if q.stride(2) == 1 else q.contiguous()
    pdl = pdl_supported(q.device)
    _mla_prefill_kernel[(num_seqs * tiles, triton.cdiv(num_heads, block_h))](
        q,
        cache,
        block_tables,
        info,
        out,
        scale,
        tiles,
        num_heads,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        DV=v_dim,
        DV_PAD=dv_pad,
        DR=rope,
        DR_PAD=dr_pad,
        BLOCK_H=block_h,
        BLOCK_M=block_m,
        BLOCK_N=cfg["block_n"],
        PAGE=block_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WHILE_LOOP=not q.is_cuda,
        USE_PDL=pdl,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        launch_pdl=pdl,
    )
    return out
