"""What a model family declares to the rest of the server, without torch: for each parameter of
our model the checkpoint tensor(s) it is read from, its full shape and the slice a rank holds
(`WeightSpec`), and what one token keeps in the paged KV cache (`KVSpec`).

The loader, the start-up checkpoint check, random (`dummy`) weights, the KV cache, its sizing
and the benchmark's memory floor all read these, so they hold no family's names or shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the frontend reads specs without importing torch
    import torch


@dataclass(frozen=True)
class Slice:
    """Rows `[start, stop)` of dimension `dim` (None: the whole tensor)."""

    dim: int | None = None
    start: int = 0
    stop: int = 0

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return full
        return full.narrow(self.dim, self.start, self.stop - self.start)


@dataclass(frozen=True)
class ExpertSlice:
    """Per local physical slot, the logical expert whose weights it holds (`experts`, from the
    expert map: a contiguous block under the trivial map, repeats where experts have replicas);
    FFN width `[i0, i1)` of `width` (gate rows then up rows for w13)."""

    experts: tuple[int, ...]
    i0: int
    i1: int
    width: int
    is_w13: bool

    @property
    def contiguous(self) -> range | None:
        """The experts as one ascending block `range(e0, e1)`, where they are one."""
        e = self.experts
        if e and e == tuple(range(e[0], e[0] + len(e))):
            return range(e[0], e[0] + len(e))
        return None

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full `[E, ...]` stacked weight: its slots' experts, its
        width."""
        import torch

        block = self.contiguous
        if block is not None:
            experts = full[block.start : block.stop]
        else:
            experts = full[torch.tensor(self.experts, dtype=torch.int64, device=full.device)]
        return self.narrow(experts)

    def narrow(self, experts: torch.Tensor) -> torch.Tensor:
        """This rank's FFN width of stacked experts `[n, ...]` (of the full width)."""
        import torch

        if self.is_w13:
            return torch.cat(
                [
                    experts[:, self.i0 : self.i1],
                    experts[:, self.width + self.i0 : self.width + self.i1],
                ],
                dim=1,
            )
        return experts[:, :, self.i0 : self.i1]


@dataclass(frozen=True)
class ExpertSource:
    """Where a stacked expert parameter (`[E, 2I, H]` gate|up, or `[E, H, I]` down) is read
    from: one fused 3-D tensor of the full shape, where the checkpoint has it, else one tensor
    per expert and projection: `per_expert` holds format strings with `{e}`, (gate, up) for
    w13 and (down,) for w2."""

    fused: str | None
    per_expert: tuple[str, ...]

    def expert_names(self, e: int) -> tuple[str, ...]:
        return tuple(name.format(e=e) for name in self.per_expert)


@dataclass(frozen=True)
class WeightSpec:
    """One parameter of our model: its full (unsharded) shape, the slice this rank holds, and
    the checkpoint tensor it comes from (a name, or an `ExpertSource` for stacked experts)."""

    shape: tuple[int, ...]
    piece: Slice | ExpertSlice
    source: str | ExpertSource
    # Held in float32 whatever the model's dtype (DeepSeek-V3's router, as transformers keeps
    # it; the router module casts it so, and the planner counts its bytes so).
    float32: bool = False
    # A linear layer's weight (2-D `[out, in]`, or stacked experts): FP8 under quantization.
    linear: bool = False
    # A linear weight used other than as a GEMM (MLA's absorbed `kv_b_proj`): held in the
    # model's dtype all the same, its FP8 (stored, or quantized at load) dequantized as read.
    dequantize_fp8: bool = False
    # Set where the weight is held as block FP8 (`model/quant.py` sets it; None: not FP8).
    fp8: Fp8Spec | None = None


@dataclass(frozen=True)
class Fp8Spec:
    """A weight held as block FP8 (`safeserve.kernels.fp8_reference`): its `block` tiles, and
    `scale`, the spec of its block scales (the parameter `<name>_scale_inv`) where the
    checkpoint stores the weight in FP8 (None: quantized as it is loaded). `dequantize`: held
    in the model's dtype all the same, the checkpoint's FP8 dequantized at load (a weight used
    other than as a linear: MLA's absorbed `kv_b_proj`)."""

    block: tuple[int, int]
    scale: WeightSpec | None
    dequantize: bool = False


WeightSpecs = dict[str, WeightSpec]


@dataclass(frozen=True)
class KVSpec:
    """What one token keeps in the paged cache of each layer, on one rank.

    Per layer a key tensor `[slots, num_heads, k_dim]` and a value tensor `[slots, num_heads,
    v_dim]`; with `v_in_k` (multi-head latent attention: one compressed vector per token) there
    is one tensor only and the values are its first `v_dim` entries."""

    num_layers: int
    num_heads: int
    k_dim: int
    v_dim: int
    v_in_k: bool = False

    def __post_init__(self) -> None:
        if self.v_in_k and self.v_dim > self.k_dim:
            raise ValueError("values inside the key vector cannot be longer than it")

    def token_bytes(self, itemsize: int) -> int:
        """Bytes of one token's cache entries over all layers."""
        per_head = self.k_dim + (0 if self.v_in_k else self.v_dim)
        return self.num_layers * self.num_heads * per_head * itemsize
