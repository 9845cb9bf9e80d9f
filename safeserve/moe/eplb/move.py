"""Moving expert weights to a new placement, one MoE layer at a time, on every rank of a group.

For one layer, every slot whose logical expert changes gets the new expert's weights from a slot
that holds them under the old placement: one on its own rank where there is one (a copy),
else one on another rank (point-to-point, NCCL on GPU, gloo on CPU), the holders taking the
requests in turn. Every rank computes the same list of transfers from the two rows, so the
sends and receives pair up without a word exchanged. What a rank receives or copies is staged
(only the slots that change) and written into the stacked weights in place once every transfer
of the layer is done: a slot that is the source of another's move is read before it is
overwritten, and captured CUDA graphs keep reading the same tensors. The staging is one tensor
per weight for the local copies and one for what is received, whatever the number of slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from safeserve.parallel.comm import Comm


@dataclass(frozen=True)
class Transfer:
    """Local slot `src_slot` of EP rank `src_rank` -> local slot `dst_slot` of `dst_rank`."""

    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int

    @property
    def remote(self) -> bool:
        return self.src_rank != self.dst_rank


def layer_transfers(
    old_row: Sequence[int], new_row: Sequence[int], slots_per_rank: int
) -> list[Transfer]:
    """The transfers that turn a layer's old placement (`old_row[p]`: the logical expert of
    physical slot p) into the new one, in slot order of the destinations."""
    if len(old_row) != len(new_row) or len(old_row) % slots_per_rank:
        raise ValueError(
            f"rows of {len(old_row)} and {len(new_row)} slots over ranks of {slots_per_rank}"
        )
    holders: dict[int, list[int]] = {}
    for p, e in enumerate(old_row):
        holders.setdefault(e, []).append(p)
    turns: dict[int, int] = {}
    out = []
    for p, (old, new) in enumerate(zip(old_row, new_row, strict=True)):
        if old == new:
            continue
        if new not in holders:
            raise ValueError(f"slot {p}: expert {new} is held by no slot of the old placement")
        rank = p // slots_per_rank
        own = [q for q in holders[new] if q // slots_per_rank == rank]
        if own:
            src = own[0]
        else:
            k = turns.get(new, 0)
            turns[new] = k + 1
            src = holders[new][k % len(holders[new])]
        out.append(Transfer(src // slots_per_rank, src % slots_per_rank, rank, p % slots_per_rank))
    return out


def move_layer(
    weights: Sequence[torch.Tensor], transfers: Sequence[Transfer], rank: int, comm: Comm
) -> int:
    """Carries out `transfers` on this EP rank (`rank`) for the stacked per-slot `weights` (each
    `[slots, ...]`); returns the bytes this rank sent to other ranks. Every rank of the group
    calls it with the same transfers. What a rank copies from its own slots is gathered in one
    launch per tensor and what it receives lands in one buffer per tensor (a row per incoming
    slot), so a layer's move is a few launches and allocations, not a few per slot."""
    local = [t for t in transfers if t.dst_rank == rank and not t.remote]
    incoming = [t for t in transfers if t.dst_rank == rank and t.remote]
    sends: list[tuple[int, torch.Tensor]] = []
    sent = 0
    for t in transfers:
        if t.src_rank == rank and t.remote:
            for w in weights:
                sends.append((t.dst_rank, w[t.src_slot]))
                sent += w[t.src_slot].numel() * w.element_size()
    device = weights[0].device if weights else None

    def index(slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.int64, device=device)

    # read before anything is written: a slot may be the source of another's move
    copied = [_raw(w).index_select(0, index([t.src_slot for t in local])) for w in weights]
    received = [w.new_empty((len(incoming), *w.shape[1:])) for w in weights]
    recvs = [(t.src_rank, buf[i]) for i, t in enumerate(incoming) for buf in received]
    comm.exchange(sends, recvs)
    with torch.no_grad():
        for group, staged in ((local, copied), (incoming, received)):
            if group:
                dst = index([t.dst_slot for t in group])
                for w, b in zip(weights, staged, strict=True):
                    _raw(w).index_copy_(0, dst, _raw(b))
    return sent


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor, or its bytes where the index kernels lack its dtype (FP8 on CPU)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def slot_bytes(weights: Sequence[torch.Tensor]) -> int:
    """Bytes of one slot's weights (what one transfer carries)."""
    return sum(w[0].numel() * w.element_size() for w in weights)
