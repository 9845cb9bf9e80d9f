"""Block FP8 in torch: the CPU path of FP8 weights and the oracle of future GPU kernels.

The format is DeepSeek-V3's (and Qwen3-FP8's): a linear's weight `[out, in]` is stored as
`float8_e4m3fn` with one float32 `scale_inv` per `block` (128 x 128) tile, the last tiles of a
dimension partial where it is not a multiple of the block; the weight is `fp8 * scale_inv` of its
tile. Activations are quantized at run time ("dynamic"): per token and per group of `block[1]`
input columns, `scale = max|x| / 448`. A product is then the float32 sum of dequantized
activations times dequantized weights, what a block-FP8 GEMM computes up to float rounding.

The model's CPU path keeps activations in high precision (W8A16: `QUANTIZE_ACTIVATIONS`): a
rounding to 3 mantissa bits is a step function, so float noise of the order of 1e-7 (another
chunking of a prefill, another summation order under tensor parallelism) flips roundings, and
through top-k routing the test model's logits then move by 0.1 and more between two equally
valid runs (a prefill in chunks or in one step); the path that is the oracle must give one
answer. With no FP8 GEMM on a CPU there is
nothing to gain either. The W8A8 math stays here (`quantize_input=True`) for GPU kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from safeserve.kernels.moe_reference import pairs_by_expert

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# An all-zero block or token group still gets a finite scale (its values quantize to 0).
MIN_AMAX = 1e-10
# Whether the model's FP8 linears and experts quantize their inputs (see above: not on CPU).
QUANTIZE_ACTIVATIONS = False


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, c = x.shape[-2:]
    return F.pad(x, (0, cols - c, 0, rows - r)) if (r, c) != (rows, cols) else x


def _over_fp8_max(t: torch.Tensor) -> torch.Tensor:
    """`t / 448` correctly rounded on every device. torch on CUDA divides by a Python scalar as a
    product with its reciprocal, which is one ulp off for some `t`; the scale then differs from
    the kernels' (IEEE division, `tl.div_rn`) and so do the values rounded with it."""
    return t / torch.full((), FP8_MAX, dtype=t.dtype, device=t.device)


def block_quantize(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv) of `w` [..., out, in]: per `block` tile
    `scale_inv = max|tile| / 448` and `fp8 = w / scale_inv` rounded to nearest."""
    bo, bi = block
    *lead, rows, cols = w.shape
    nr, nc = _blocks(rows, bo), _blocks(cols, bi)
    wf = _pad_to(w.float(), nr * bo, nc * bi).reshape(*lead, nr, bo, nc, bi)
    amax = wf.abs().amax(dim=(-3, -1)).clamp(min=MIN_AMAX)  # [..., nr, nc]
    scale_inv = _over_fp8_max(amax)
    q = (wf / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(*lead, nr * bo, nc * bi)[..., :rows, :cols].to(FP8)
    return q, scale_inv


def block_dequantize(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weight `q * scale_inv` (each scale over its tile) of `q` [..., out, in]."""
    rows, cols = q.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return (q.float() * s[..., :rows, :cols]).to(dtype)


def token_group_quantize(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x, float32 scale [..., ceil(K / group)]) of activations `x` [..., K]: per token and
    per `group` columns `scale = max|x| / 448`."""
    k = x.shape[-1]
    n = _blocks(k, group)
    xf = F.pad(x.float(), (0, n * group - k)).unflatten(-1, (n, group))
    scale = _over_fp8_max(xf.abs().amax(dim=-1).clamp(min=MIN_AMAX))
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2)[..., :k].to(FP8)
    return q, scale


def token_group_dequantize(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(group, dim=-1)[..., :k]


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    quantize_input: bool = QUANTIZE_ACTIVATIONS,
) -> torch.Tensor:
    """x [..., in] @ W.T (+ bias) in x's dtype, W the block-FP8 weight `w` [out, in] with its
    `scale_inv`, in float32; `quantize_input`: x quantized per token and `block[1]` columns
    first (W8A8)."""
    xf = x.float()
    if quantize_input:
        xf = token_group_dequantize(*token_group_quantize(x, block[1]), block[1])
    out = F.linear(xf, block_dequantize(w, scale_inv, block))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def grouped_experts_fp8(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    out: torch.Tensor | None = None,
    quantize_input: bool = QUANTIZE_ACTIVATIONS,
) -> torch.Tensor:
    """`moe_reference.grouped_experts_torch` of block-FP8 experts: w13 [E, 2I, H] (gate rows,
    then up rows), its scales [E, 2 * ceil(I / b), ceil(H / b)] (gate's tiles, then up's: each
    projection is tiled on its own, as the checkpoint stores it), w2 [E, H, I] and its scales
    [E, ceil(H / b), ceil(I / b)]. `out` [N, H] (zeroed here): the result's buffer, if given;
    `quantize_input`: as `fp8_linear`'s, for both GEMMs."""
    out = torch.zeros_like(hidden_states) if out is None else out.zero_()
    pairs = pairs_by_expert(topk_ids, topk_weights, w13.shape[0])
    if pairs is None:
        return out
    token_idx, pair_w, counts = pairs
    width = w2.shape[2]
    half = w13_scale_inv.shape[1] // 2
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_idx[start : start + count]
        x = hidden_states[rows]
        s13 = w13_scale_inv[expert]
        w8a8 = quantize_input
        gate = fp8_linear(x, w13[expert, :width], s13[:half], None, block, w8a8)
        up = fp8_linear(x, w13[expert, width:], s13[half:], None, block, w8a8)
        y = fp8_linear(F.silu(gate) * up, w2[expert], w2_scale_inv[expert], None, block, w8a8)
        out.index_add_(0, rows, y * pair_w[start : start + count].to(y.dtype))
        start += count
    return out
