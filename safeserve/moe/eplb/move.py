"""Moving expert weights to a new placement, one MoE layer at a time, on every rank of a group.

For one layer, every slot whose logical expert changes gets the new expert's weights from a slot
that holds them under the old placement: one on its own rank where there is one (a copy),
else one on another rank (point-to-point, NCCL on GPU, gloo on CPU), the holders taking the
requests in turn. Every rank computes the same list of transfers from the two rows, so the
sends and receives pair up without a word exchanged. What a rank receives or copies is staged
(only the slots that change) and written into the stacked weights in place once every transfer
of the layer is done: a slot that is the source of another's move is read before it is
overwritten, and captured CUDA graphs keep reading the same tensors.
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
    calls it with the same transfers."""
    staged: list[tuple[int, list[torch.Tensor]]] = []
    sends: list[tuple[int, torch.Tensor]] = []
    recvs: list[tuple[int, torch.Tensor]] = []
    sent = 0
    for t in transfers:
        if t.dst_rank == rank:
            if t.remote:
                bufs = [torch.empty_like(w[t.dst_slot]) for w in weights]
                recvs.extend((t.src_rank, b) for b in bufs)
            else:
                bufs = [w[t.src_slot].clone() for w in weights]
            staged.append((t.dst_slot, bufs))
        elif t.src_rank == rank:
            for w in weights:
                sends.append((t.dst_rank, w[t.src_slot]))
                sent += w[t.src_slot].numel() * w.element_size()
    comm.exchange(sends, recvs)
    with torch.no_grad():
        for slot, bufs in staged:
            for w, b in zip(weights, bufs, strict=True):
                w[slot].copy_(b)
    return sent


def slot_bytes(weights: Sequence[torch.Tensor]) -> int:
    """Bytes of one slot's weights (what one transfer carries)."""
    return sum(w[0].numel() * w.element_size() for w in weights)
