"""Linear layers: several of one input fused into one weight, so they run as one GEMM; block-FP8
linears (`BlockFp8Linear`); `project`, a linear's product on the path its weight takes."""

from __future__ import annotations

import torch
from torch import nn

from safeserve.kernels.common import use_kernels
from safeserve.kernels.fp8_linear import fp8_linear_w8a8
from safeserve.kernels.fp8_quant import GROUP
from safeserve.kernels.fp8_reference import FP8, fp8_linear
from safeserve.kernels.linear import linear


class BlockFp8Linear(nn.Module):
    """A linear whose weight `[out, in]` is float8_e4m3fn with a float32 scale per `block` tile
    (`weight_scale_inv` [ceil(out / b0), ceil(in / b1)]). Where the Triton kernels run (CUDA, or
    the interpreter) and the block is 128 x 128: W8A8 (`kernels.fp8_linear`, activations
    quantized per token and 128 columns); elsewhere the torch reference with activations in high
    precision (`kernels.fp8_reference`, W8A16: the CPU path)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, block: tuple[int, int]
    ) -> None:
        super().__init__()
        self.block = block
        tiles = (-(-out_features // block[0]), -(-in_features // block[1]))
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(tiles, dtype=torch.float32), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @classmethod
    def like(cls, m: nn.Linear, block: tuple[int, int]) -> BlockFp8Linear:
        """The FP8 counterpart of `m` (on `m`'s device, typically meta, before allocation)."""
        with m.weight.device:
            return cls(m.in_features, m.out_features, m.bias is not None, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x) and self.block == (GROUP, GROUP):
            return fp8_linear_w8a8(x, self.weight, self.weight_scale_inv, self.bias)
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, self.block)


def project(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`m(x)` of an `nn.Linear` (through `kernels.linear`: the skinny GEMM for decode-sized
    batches on CUDA) or a `BlockFp8Linear`."""
    if isinstance(m, BlockFp8Linear):
        return m(x)
    return linear(x, m.weight, m.bias)


def fuse_fp8_linears(linears: list[nn.Module]) -> BlockFp8Linear | None:
    """One `BlockFp8Linear` for several block-FP8 linears of the same input (one activation
    quantization and one launch instead of one each), or None where they cannot share one: not
    all block FP8 with the same block, or a projection other than the last ending inside a
    weight tile (its tiles' scales would then mix two projections).

    The parts' parameters become views of the fused weight, scales and bias, so loaders keep
    filling them by name; the fused module lists them in `parts`. Its owner keeps it out of the
    module tree (`object.__setattr__`): its parameters are the parts', loaded through them."""
    if not linears or not all(isinstance(m, BlockFp8Linear) for m in linears):
        return None
    block, k = linears[0].block, linears[0].weight.shape[1]
    has_bias = linears[0].bias is not None
    for m in linears:
        if m.block != block or m.weight.shape[1] != k or (m.bias is not None) != has_bias:
            return None
    if any(m.weight.shape[0] % block[0] for m in linears[:-1]):
        return None
    rows = sum(m.weight.shape[0] for m in linears)
    with linears[0].weight.device:
        fused = BlockFp8Linear(k, rows, has_bias, block)
    fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]), False)
    fused.weight_scale_inv = nn.Parameter(
        torch.cat([m.weight_scale_inv.detach() for m in linears]), False
    )
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in linears]), False)  # type: ignore[union-attr]
    start = tile = 0
    for m in linears:
        n, tiles = m.weight.shape[0], m.weight_scale_inv.shape[0]
        m.weight = nn.Parameter(fused.weight[start : start + n], requires_grad=False)
        m.weight_scale_inv = nn.Parameter(
            fused.weight_scale_inv[tile : tile + tiles], requires_grad=False
        )
        if has_bias:
            m.bias = nn.Parameter(fused.bias[start : start + n], requires_grad=False)  # type: ignore[index]
        start, tile = start + n, tile + tiles
    fused.parts = tuple(linears)  # a tuple: not registered as submodules
    return fused


def fuse_linears(linears: list[nn.Module]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One weight (and bias) for several linears of the same input; (None, None) where one is
    block FP8 (those fuse through `fuse_fp8_linears`).

    The linears' parameters become views of the fused tensors: loaders and `load_state_dict`
    keep filling them by name (and each rank's shard slices stay per projection).
    """
    if any(isinstance(m, BlockFp8Linear) for m in linears):
        return None, None
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([m.bias.detach() for m in linears]) if has_bias else None  # type: ignore[misc]
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias
