"""Paged-attention prefill (Triton), with its torch reference: causal attention of a batch of
query chunks of different lengths over their sequences' paged KV cache, in one launch.

Sequence `s` of the batch has `q_len[s]` query rows starting at row `q_start[s]` of `q`; they are
its positions `ctx[s] - q_len[s] .. ctx[s] - 1`, whose keys and values are already in the cache
with everything before them (a chunked prefill attends over the chunks computed in earlier
steps too). Keys and values are read straight through the block tables, as by the decode kernel
(`safeserve.kernels.paged_attention`).

Programs are (sequence, tile of query tokens, kv head): one program holds the tile's tokens times
all query heads of its kv head as one row tile (GQA: the group shares each K/V load) and keeps an
online softmax over the context up to the tile's last position, causally masked per row. The grid
is (sequences x the longest chunk's tiles, kv heads); tiles past a shorter chunk exit at once.

Context tiles that every row of a program sees whole run without masks; the last ones (the
chunk's own diagonal) are masked causally. A sequence's programs run longest-context first.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from safeserve.kernels.common import (
    HAS_TRITON,
    HOPPER_SHARED_BYTES,
    next_power_of_2,
    optin_shared_bytes,
    pdl_supported,
    pdl_wait,
    tl,
    triton,
    use_kernels,
)

# Tiles and launch shape: rows (query tokens x padded group) per program, context tokens per
# loop step. Per device class, a list of (longest chunk of the launch from which it applies,
# configuration). "sm90": Hopper-class GPUs with Hopper's shared memory (the 128 x 128 tiles take
# 128 KiB a program; a GB10 or an RTX 50 offers 99 KiB and gets "default"), tuned on an H200
# (kernels/bench_prefill_attention.py, kernels/RESULTS.md): long chunks take larger tiles.
PREFILL_CONFIGS: dict[str, list[tuple[int, dict[str, int]]]] = {
    "default": [(0, {"rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 2})],
    "sm90": [
        (0, {"rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}),
        (1024, {"rows": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}),
    ],
}


def prefill_config(device: torch.device, max_q_len: int) -> dict[str, int]:
    """The tile configuration for a launch whose longest chunk is `max_q_len` tokens on this
    device (a copy: callers may change it)."""
    sm90 = device.type == "cuda" and _hopper_class(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    table = PREFILL_CONFIGS["sm90" if sm90 else "default"]
    return dict(next(cfg for lo, cfg in reversed(table) if max_q_len >= lo))


@functools.cache
def _hopper_class(index: int) -> bool:
    props = torch.cuda.get_device_properties(index)
    return props.major >= 9 and optin_shared_bytes(props) >= HOPPER_SHARED_BYTES


def prefill_info(q_starts: list[int], q_lens: list[int], context_lens: list[int]) -> torch.Tensor:
    """[S, 3] int32 (context length, first query row, query length) of each sequence, on the
    host: the `info` argument of `paged_prefill`."""
    return torch.tensor(list(zip(context_lens, q_starts, q_lens, strict=True)), dtype=torch.int32)


def paged_prefill_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    info: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Reference: one causal SDPA per sequence over its context gathered from the cache."""
    group = q.shape[1] // k_cache.shape[1]
    for s, (ctx, start, q_len) in enumerate(info.tolist()):
        if q_len <= 0:
            continue
        pos = torch.arange(ctx, device=q.device)
        slots = block_tables[s].to(torch.int64)[pos // block_size] * block_size + pos % block_size
        ks = k_cache[slots].to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
        vs = v_cache[slots].to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
        qs = q[start : start + q_len].transpose(0, 1)
        mask = pos[None, :] <= torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[start : start + q_len] = o.transpose(0, 1)
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    info: torch.Tensor,
    max_q_len: int,
    block_size: int,
    scale: float,
    out: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Writes the attention of every sequence's query rows into `out` [T, Hq, D] (other rows
    are left as they are). block_tables [S, W] int32 (W * block_size bounds every context);
    info [S, 3] int32 from `prefill_info`, on q's device; max_q_len = the longest chunk.
    `config`: tiles and launch shape (default: `prefill_config`)."""
    if not use_kernels(q):
        return paged_prefill_torch(q, k_cache, v_cache, block_tables, info, block_size, scale, out)
    num_seqs = info.shape[0]
    if num_seqs == 0 or max_q_len <= 0:
        return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    g_pad = next_power_of_2(group)
    cfg = config or prefill_config(q.device, max_q_len)
    block_m = max(1, cfg["rows"] // g_pad)  # query tokens per program
    tiles = triton.cdiv(max_q_len, block_m)
    q = q if q.stride(2) == 1 else q.contiguous()
    pdl = pdl_supported(q.device)
    _prefill_kernel[(num_seqs * tiles, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        info,
        out,
        scale,
        tiles,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        D_PAD=next_power_of_2(head_dim),
        GROUP=group,
        G_PAD=g_pad,
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


if HAS_TRITON:
    from safeserve.kernels.paged_attention_kernels import _decode_tile

    # Values that change from step to step are not specialized (Triton would compile a variant
    # per divisibility by 16, or for 1), so a step of a new shape never waits for a compile:
    # the block tables' width (stride_bt) follows the step's longest context.
    @triton.jit(do_not_specialize=["scale", "stride_bt", "tiles"])
    def _prefill_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        bt_ptr,
        info_ptr,
        out_ptr,
        scale,
        tiles,
        stride_qt,
        stride_qh,
        stride_cs,
        stride_ch,
        stride_bt,
        stride_ot,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        WHILE_LOOP: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        seq = tl.program_id(0) // tiles
        # a sequence's last tiles (the longest contexts) first: the short ones fill in the end
        t0 = (tiles - 1 - tl.program_id(0) % tiles) * BLOCK_M
        kvh = tl.program_id(1)
        ctx = tl.load(info_ptr + seq * 3)
        q_start = tl.load(info_ptr + seq * 3 + 1)
        q_len = tl.load(info_ptr + seq * 3 + 2)
        if t0 >= q_len:
            return
        r = tl.arange(0, BLOCK_M * G_PAD)
        tok = t0 + r // G_PAD  # query token of each row, within the chunk
        g = r % G_PAD
        row_ok = (tok < q_len) & (g < GROUP)
        pos_q = ctx - q_len + tok  # its position: it sees positions 0 .. pos_q
        heads = kvh * GROUP + g
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        rows = (q_start + tok).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M * G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * G_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], dtype=tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
        hi = tl.minimum(ctx, ctx - q_len + t0 + BLOCK_M)  # the tile's last row sees up to hi-1
        # Context tiles before `full` are visible to every row (the tile's first token sees
        # positions 0 .. ctx - q_len + t0): no mask. The rest are masked causally.
        full = (ctx - q_len + t0 + 1) // BLOCK_N * BLOCK_N
        if WHILE_LOOP:  # Triton's interpreter cannot take loaded values as range() bounds
            start = hi * 0
            while start < full:
                m_i, l_i, acc = _decode_tile(
                    q, kc_ptr, vc_ptr, bt_ptr, seq, kvh, start, hi, pos_q, m_i, l_i, acc,
                    qk_scale, stride_cs, stride_ch, stride_bt,
                    D_PAD, HEAD_DIM, BLOCK_N, PAGE, DOT_PRECISION, True, True,
                )  # fmt: skip
                start += BLOCK_N
            while start < hi:
                m_i, l_i, acc = _decode_tile(
                    q, kc_ptr, vc_ptr, bt_ptr, seq, kvh, start, hi, pos_q, m_i, l_i, acc,
                    qk_scale, stride_cs, stride_ch, stride_bt,
                    D_PAD, HEAD_DIM, BLOCK_N, PAGE, DOT_PRECISION, True,
                )  # fmt: skip
                start += BLOCK_N
        else:
            for start in range(0, full, BLOCK_N):
                m_i, l_i, acc = _decode_tile(
                    q, kc_ptr, vc_ptr, bt_ptr, seq, kvh, start, hi, pos_q, m_i, l_i, acc,
                    qk_scale, stride_cs, stride_ch, stride_bt,
                    D_PAD, HEAD_DIM, BLOCK_N, PAGE, DOT_PRECISION, True, True,
                )  # fmt: skip
            for start in range(full, hi, BLOCK_N):
                m_i, l_i, acc = _decode_tile(
                    q, kc_ptr, vc_ptr, bt_ptr, seq, kvh, start, hi, pos_q, m_i, l_i, acc,
                    qk_scale, stride_cs, stride_ch, stride_bt,
                    D_PAD, HEAD_DIM, BLOCK_N, PAGE, DOT_PRECISION, True,
                )  # fmt: skip
        o = acc / l_i[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
