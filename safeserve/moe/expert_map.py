"""Where every expert of every MoE layer lives: the one placement object of a rank.

There are `num_physical` = `num_logical` + redundant physical slots per MoE layer, split into
`ep_size` contiguous blocks of `slots_per_rank`: slot p lives on EP rank `p // slots_per_rank`
as that rank's local slot `p % slots_per_rank` (the convention of DeepSeek's EPLB,
`eplb/algorithm.py`, whose `rebalance_experts` output this map is built from). What changes
between placements is which logical expert each slot holds, per layer (`phy2log`), hence each
logical expert's replicas (`log2phy`, with their counts `logcnt`) and the replicas a rank spreads
its tokens over (`candidates`: its own rank's replicas where it holds any, else every replica,
one token to each in turn).

Everything is read from here: the routers map logical ids through the rank's send table, the
dispatchers and the expert runner turn physical ids into ranks and local slots, admission sizes
its buffers from the local slots, the loader reads each slot's logical expert, and the load
recorders count per physical slot. Built without torch (the frontend's weight specs read it);
the `*_tensor` / `send_table` views import torch on first use.

MoE layers are numbered among the model's MoE layers only (0 .. num_layers-1, in order), as the
expert-distribution records are.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ExpertMap:
    """The placement of `num_logical` experts in `num_physical` slots per layer, over `ep_size`
    ranks; `phy2log[layer][p]`: the logical expert slot p holds. `seed` picks the spread of the
    ranks that hold no replica of an expert over its replicas (`send_to`)."""

    num_logical: int
    num_physical: int
    ep_size: int
    phy2log: tuple[tuple[int, ...], ...]
    seed: int = 0
    # derived in __post_init__: per layer, per logical expert, its slots ascending
    _log2phy: tuple[tuple[tuple[int, ...], ...], ...] = field(init=False, repr=False, compare=False)
    # candidate rows by (rank, or -1 for every rank alike; layer), computed on first use
    _send: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        e, p, ep = self.num_logical, self.num_physical, self.ep_size
        if e < 1 or ep < 1:
            raise ValueError(f"need >= 1 logical expert and EP rank, got {e} experts, ep_size {ep}")
        if p < e:
            raise ValueError(f"{p} physical slots cannot hold {e} logical experts")
        if p % ep:
            raise ValueError(f"{p} physical experts cannot be split evenly over ep_size {ep}")
        rows = tuple(tuple(int(x) for x in row) for row in self.phy2log)
        object.__setattr__(self, "phy2log", rows)
        log2phy = []
        for layer, row in enumerate(rows):
            if len(row) != p:
                raise ValueError(f"layer {layer}: {len(row)} physical slots, expected {p}")
            slots: list[list[int]] = [[] for _ in range(e)]
            for slot, logical in enumerate(row):
                if not 0 <= logical < e:
                    raise ValueError(
                        f"layer {layer}: slot {slot} holds expert {logical}, not in [0, {e})"
                    )
                slots[logical].append(slot)
            missing = [x for x in range(e) if not slots[x]]
            if missing:
                raise ValueError(
                    f"layer {layer}: logical expert {missing[0]} has no physical replica"
                )
            log2phy.append(tuple(tuple(s) for s in slots))
        object.__setattr__(self, "_log2phy", tuple(log2phy))
        object.__setattr__(self, "_send", {})

    # -- construction ----------------------------------------------------------------------------

    @staticmethod
    def trivial(
        num_logical: int, ep_size: int = 1, num_layers: int = 1, redundant: int = 0, seed: int = 0
    ) -> ExpertMap:
        """Slot p holds expert `p % num_logical`: with `redundant` 0 the contiguous blocks of
        experts per rank (expert e on rank `e // (E / ep_size)`), with redundant slots the extra
        ones hold experts 0, 1, ... (what `replicate_experts` gives equal loads)."""
        return _trivial(num_logical, ep_size, num_layers, redundant, seed)

    @staticmethod
    def from_phy2log(phy2log: Any, num_logical: int, ep_size: int, seed: int = 0) -> ExpertMap:
        """From a `[L, P]` table (a tensor, `rebalance_experts`' first output, or nested
        sequences); ValueError (one line) unless every logical expert has a replica in every
        layer and P divides over `ep_size`."""
        rows = phy2log.tolist() if hasattr(phy2log, "tolist") else phy2log
        rows = [list(r) for r in rows]
        if not rows:
            raise ValueError("phy2log has no layers (use ExpertMap.trivial for a layer count 0)")
        return ExpertMap(num_logical, len(rows[0]), ep_size, tuple(tuple(r) for r in rows), seed)

    # -- sizes and where slots live ----------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.phy2log)

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    @property
    def max_replicas(self) -> int:
        """The last dimension of `log2phy_tensor`: the most replicas any placement of these sizes
        can give one expert (so every placement has the same shape)."""
        return self.num_physical - self.num_logical + 1

    def rank_of(self, physical: Any) -> Any:
        """The EP rank of physical slot(s) `physical` (an int, or a tensor elementwise)."""
        return physical // self.slots_per_rank

    def local_slots(self, rank: int) -> range:
        """The physical slots rank `rank` holds, in local-slot order."""
        self._check_rank(rank)
        s = self.slots_per_rank
        return range(rank * s, (rank + 1) * s)

    def local_slot(self, physical: Any) -> Any:
        """Physical slot(s) (>= 0) -> the index among its rank's slots (int or tensor)."""
        return physical % self.slots_per_rank

    def to_local_ids(self, physical_ids: torch.Tensor, rank: int) -> torch.Tensor:
        """Physical ids -> `rank`'s local slot index, -1 for slots held elsewhere (and for -1)."""
        import torch

        local = physical_ids - rank * self.slots_per_rank
        held = (local >= 0) & (local < self.slots_per_rank)
        return torch.where(held, local, torch.full_like(local, -1))

    # -- logical <-> physical ----------------------------------------------------------------------

    def logical_of(self, layer: int, physical: int) -> int:
        return self.phy2log[layer][physical]

    def replicas(self, layer: int, logical: int) -> tuple[int, ...]:
        """The physical slots holding `logical` in `layer`, ascending."""
        return self._log2phy[layer][logical]

    def log2phy_rows(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """`replicas` of every (layer, logical expert): `[L][E]` ascending slot tuples."""
        return self._log2phy

    def replica_count(self, layer: int, logical: int) -> int:
        return len(self._log2phy[layer][logical])

    def local_logical(self, layer: int, rank: int) -> tuple[int, ...]:
        """Per local slot of `rank`, the logical expert whose weights it holds in `layer`."""
        return tuple(self.phy2log[layer][p] for p in self.local_slots(rank))

    @property
    def is_trivial(self) -> bool:
        """Slot p holds expert p in every layer (no redundancy, nothing moved)."""
        ident = tuple(range(self.num_physical))
        return self.num_physical == self.num_logical and all(r == ident for r in self.phy2log)

    # -- which replica a rank sends a token to ---------------------------------------------------

    def candidates(self, layer: int, logical: int, rank: int | None) -> tuple[int, ...]:
        """The replicas that the tokens of EP rank `rank` choosing `logical` in `layer` are
        spread over, one (token, expert) pair to each in turn (the n-th pair of the batch
        choosing `logical` to candidate n % count, `kernels.replica_spread.spread_ids`): the rank's own
        replicas where it holds any (no transfer), ascending; else every replica, from a
        seeded offset per expert plus this rank's turn among the ranks holding none (so that
        their first tokens go to different replicas). Equal shares per replica, as the EPLB
        placement assumes.

        `rank` None: tokens every rank holds and routes alike: every replica, from the seeded
        offset (the routers then spread each share of the tokens as its rank would)."""
        return self.candidate_row(layer, rank)[logical]

    def send_to(self, layer: int, logical: int, rank: int | None) -> int:
        """The first of `candidates`: where a lone token goes."""
        return self.candidate_row(layer, rank)[logical][0]

    def send_rows(self, rank: int | None) -> tuple[tuple[int, ...], ...]:
        """`send_to` of every (layer, logical expert) for `rank`: `[L][E]` physical slots."""
        return tuple(tuple(c[0] for c in row) for row in self.candidate_rows(rank))

    def candidate_rows(self, rank: int | None) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """`candidates` of every (layer, logical expert) for `rank`: `[L][E]` slot tuples."""
        return tuple(self.candidate_row(layer, rank) for layer in range(self.num_layers))

    def candidate_row(self, layer: int, rank: int | None) -> tuple[tuple[int, ...], ...]:
        """`candidates` of every logical expert of one MoE layer for `rank`: `[E]` slot tuples
        (computed once per map, layer and rank)."""
        if rank is not None:
            self._check_rank(rank)
        key = (-1 if rank is None else rank, layer)
        if key not in self._send:
            self._send[key] = self._candidate_row(layer, rank)
        return self._send[key]

    def _candidate_row(self, layer: int, rank: int | None) -> tuple[tuple[int, ...], ...]:
        # one offset per expert, from a generator of the layer's own: a layer's rows depend on
        # its placement alone, so a move rewrites only the routers of the layers it moved
        rng = random.Random(self.seed * 1_000_003 + layer)
        row = []
        for logical in range(self.num_logical):
            reps = self._log2phy[layer][logical]
            offset = rng.randrange(len(reps))
            own = tuple(p for p in reps if rank is not None and self.rank_of(p) == rank)
            if own:
                row.append(own)
                continue
            turn = 0
            if rank is not None:  # this rank's turn among the ranks holding none
                holders = {self.rank_of(p) for p in reps}
                turn = sum(1 for r in range(rank) if r not in holders)
            start = (offset + turn) % len(reps)
            row.append(reps[start:] + reps[:start])
        return tuple(row)

    # -- tensors (torch imported here) -------------------------------------------------------------

    def phy2log_tensor(self) -> torch.Tensor:
        """[L, P] int64: the logical expert of each slot."""
        import torch

        return torch.tensor(self.phy2log, dtype=torch.int64).view(self.num_layers, -1)

    def log2phy_tensor(self) -> torch.Tensor:
        """[L, E, P - E + 1] int64: each expert's slots ascending, -1 padded (as
        `eplb.algorithm.logical_to_physical_map`)."""
        import torch

        out = torch.full(
            (self.num_layers, self.num_logical, self.max_replicas), -1, dtype=torch.int64
        )
        for layer, experts in enumerate(self._log2phy):
            for logical, slots in enumerate(experts):
                out[layer, logical, : len(slots)] = torch.tensor(slots)
        return out

    def logcnt_tensor(self) -> torch.Tensor:
        """[L, E] int64: replicas per logical expert."""
        import torch

        counts = [[len(s) for s in experts] for experts in self._log2phy]
        return torch.tensor(counts, dtype=torch.int64).view(self.num_layers, self.num_logical)

    def candidate_table(
        self,
        rank: int | None,
        device: torch.device | str = "cpu",
        layers: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`candidates` of `rank` as tensors on `device`: `[L, E, max_replicas]` int64 slots
        (each row's candidates repeated to the width) and `[L, E]` int64 their counts; the n-th
        pair of a batch choosing e takes `slots[layer, e, n % counts[layer, e]]`. `layers`: only
        these MoE layers, in that order (L = len(layers))."""
        import torch

        which = range(self.num_layers) if layers is None else layers
        rows = [self.candidate_row(i, rank) for i in which]
        width = self.max_replicas
        slots = [[[c[i % len(c)] for i in range(width)] for c in row] for row in rows]
        counts = [[len(c) for c in row] for row in rows]
        shape = (len(rows), self.num_logical)
        return (
            torch.tensor(slots, dtype=torch.int64, device=device).view(*shape, width),
            torch.tensor(counts, dtype=torch.int64, device=device).view(*shape),
        )

    def send_table(self, rank: int | None, device: torch.device | str = "cpu") -> torch.Tensor:
        """[L, E] int64 on `device`: the physical slot `rank` sends each (layer, expert) to (the
        routers' logical -> physical rows; copy them into persistent buffers, never rebind)."""
        import torch

        rows = self.send_rows(rank)
        return torch.tensor(rows, dtype=torch.int64, device=device).view(
            self.num_layers, self.num_logical
        )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"EP rank {rank} not in [0, {self.ep_size})")


@lru_cache(maxsize=16)
def _trivial(
    num_logical: int, ep_size: int, num_layers: int, redundant: int, seed: int
) -> ExpertMap:
    if redundant < 0:
        raise ValueError(f"redundant experts must be >= 0, got {redundant}")
    if num_logical < 1:
        raise ValueError(f"need >= 1 logical expert, got {num_logical}")
    p = num_logical + redundant
    row = tuple(s % num_logical for s in range(p))
    return ExpertMap(num_logical, p, ep_size, (row,) * num_layers, seed)
