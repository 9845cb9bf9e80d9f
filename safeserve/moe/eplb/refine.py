"""Refining a placement for how the routers actually spread tokens over replicas.

DeepSeek's placement (`algorithm.py`) assumes that every replica of an expert takes an equal
share of its tokens. The routers do not spread that way (`ExpertMap.candidates`): a source (an
EP rank routing its own tokens) keeps its tokens of an expert on its own replicas where it holds
any, and only the sources holding none spread theirs over every replica. So a rank holding one of
an expert's replicas takes all of its own tokens of that expert whatever the replica count, and
a replica only non-holders reach takes less than an equal share. When hot experts have replicas
on several ranks (few ranks, or many redundant slots) the placement's predicted max load and the
load the routers produce differ widely.

`refine_placement` starts from a placement and improves it by local search under the routers'
own rule, given who routed the tokens (per source, tokens per logical expert): per MoE layer, it
repeatedly takes the most loaded rank and applies the best single move that lowers the layer's
(max rank load, sum of squared rank loads): swapping one of that rank's slots with a slot of
another rank, or giving one of its slots (of an expert with more than one replica) to another
expert. Every move strictly lowers that pair, so the search ends; it is also capped at
`num_physical` moves per layer. Only the two experts a move touches are re-spread, so a move is
evaluated in O(sources + ranks). Deterministic: ties go to the first move in slot order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from safeserve.moe.eplb.balancedness import layer_balancedness
from safeserve.moe.expert_map import ExpertMap

# (EP rank that routed the tokens, or None: tokens every rank routes alike, spread over every
# replica; tokens per (layer, logical expert)), as `engine/eplb.py`'s Sources.
Sources = Sequence[tuple[int | None, torch.Tensor]]

# A layer is refined only where the routers' spread predicts a balancedness this far below the
# equal shares per replica that DeepSeek's placement assumes (`refine_placement`).
MIN_GAP = 0.01
# Move evaluations per refinement, all layers together (each O(sources + ranks) in Python: about
# 1-2 s at most for hundreds of slots over tens of ranks).
MAX_EVALUATIONS = 50_000
_REL_EPS = 1e-9  # a move must lower the max (or, at an equal max, the sum of squares) by this


def expert_rank_loads(
    held: Sequence[int], source_counts: Sequence[tuple[int | None, float]]
) -> list[float]:
    """Per EP rank, the tokens of one expert it computes: `held[g]` replicas on rank g,
    `source_counts` the expert's tokens per source. A source holding a replica keeps its tokens;
    any other spreads them over every replica, equally."""
    loads = [0.0] * len(held)
    spread = 0.0
    for source, n in source_counts:
        if source is not None and held[source] > 0:
            loads[source] += n
        else:
            spread += n
    if spread:
        total = sum(held)
        for g, k in enumerate(held):
            if k:
                loads[g] += spread * k / total
    return loads


def layer_rank_loads(
    row: Sequence[int],
    num_logical: int,
    ep_size: int,
    sources: list[list[tuple[int | None, float]]],
) -> list[float]:
    """Per EP rank, the tokens of one layer it computes under placement `row` (`phy2log`);
    `sources[e]`: expert e's tokens per source."""
    per_rank = len(row) // ep_size
    held = [[0] * ep_size for _ in range(num_logical)]
    for p, e in enumerate(row):
        held[e][p // per_rank] += 1
    loads = [0.0] * ep_size
    for e in range(num_logical):
        for g, x in enumerate(expert_rank_loads(held[e], sources[e])):
            loads[g] += x
    return loads


def _key(loads: Sequence[float]) -> tuple[float, float]:
    return max(loads), sum(x * x for x in loads)


def _better(new: tuple[float, float], old: tuple[float, float]) -> bool:
    scale = max(abs(old[0]), 1.0)
    if new[0] < old[0] - _REL_EPS * scale:
        return True
    return new[0] <= old[0] + _REL_EPS * scale and new[1] < old[1] - _REL_EPS * scale * scale


def refine_row(
    row: Sequence[int],
    num_logical: int,
    ep_size: int,
    sources: list[list[tuple[int | None, float]]],
    max_moves: int | None = None,
    budget: list[int] | None = None,
) -> list[int]:
    """One layer's placement `row` improved by local search (the module's docstring);
    `sources[e]`: expert e's tokens per source. At most `max_moves` moves (default: the slot
    count); `budget`, where given, is a one-item list of the move evaluations left, spent here:
    the search stops once it has run out (the scan in progress, one hottest rank's moves, is
    finished and its best move applied)."""
    row = list(row)
    num_physical = len(row)
    per_rank = num_physical // ep_size
    held = [[0] * ep_size for _ in range(num_logical)]
    for p, e in enumerate(row):
        held[e][p // per_rank] += 1
    contrib = [expert_rank_loads(held[e], sources[e]) for e in range(num_logical)]
    loads = [sum(c[g] for c in contrib) for g in range(ep_size)]
    limit = num_physical if max_moves is None else max_moves

    def moved(changes: list[tuple[int, int, int]]) -> tuple[list[float], dict[int, list[float]]]:
        """Loads after (expert, rank, +-1) replica changes, and the touched experts' spreads."""
        touched: dict[int, list[int]] = {}
        for e, g, d in changes:
            h = touched.setdefault(e, list(held[e]))
            h[g] += d
        new = list(loads)
        spreads = {}
        for e, h in touched.items():
            c = expert_rank_loads(h, sources[e])
            spreads[e] = c
            for g in range(ep_size):
                new[g] += c[g] - contrib[e][g]
        return new, spreads

    left = budget[0] if budget is not None else None
    for _ in range(limit):
        if left is not None and left <= 0:
            break
        evaluations = 0
        hot = max(range(ep_size), key=lambda g: (loads[g], -g))
        best_key = _key(loads)
        best: tuple[list[tuple[int, int]], list[float], dict[int, list[float]]] | None = None
        for i in range(hot * per_rank, (hot + 1) * per_rank):
            a = row[i]
            for j in range(num_physical):
                b, other = row[j], j // per_rank
                if other == hot or b == a:
                    continue
                evaluations += 1
                new, spreads = moved([(a, hot, -1), (a, other, 1), (b, other, -1), (b, hot, 1)])
                k = _key(new)
                if _better(k, best_key):
                    best_key, best = k, ([(i, b), (j, a)], new, spreads)
            if sum(held[a]) > 1:
                for b in range(num_logical):
                    if b == a:
                        continue
                    evaluations += 1
                    new, spreads = moved([(a, hot, -1), (b, hot, 1)])
                    k = _key(new)
                    if _better(k, best_key):
                        best_key, best = k, ([(i, b)], new, spreads)
        if left is not None:
            left -= evaluations
            budget[0] = left  # type: ignore[index]
        if best is None:
            break
        for slot, e in best[0]:
            held[row[slot]][slot // per_rank] -= 1
            held[e][slot // per_rank] += 1
            row[slot] = e
        loads = best[1]
        for e, c in best[2].items():
            contrib[e] = c
    return row


def source_rows(sources: Sources, num_layers: int, num_logical: int) -> list:
    """`[L][E]`: per layer and expert, its tokens per source (sources with none left out)."""
    tables = [(s, torch.as_tensor(c).to(torch.float64).tolist()) for s, c in sources]
    return [
        [[(s, t[layer][e]) for s, t in tables if t[layer][e]] for e in range(num_logical)]
        for layer in range(num_layers)
    ]


def equal_share_loads(
    row: Sequence[int], num_logical: int, ep_size: int, expert_load: Sequence[float]
) -> list[float]:
    """Per EP rank, one layer's load under DeepSeek's assumption: every replica of an expert
    takes an equal share of its tokens (`expert_load[e]`)."""
    per_rank = len(row) // ep_size
    count = [0] * num_logical
    for e in row:
        count[e] += 1
    loads = [0.0] * ep_size
    for p, e in enumerate(row):
        loads[p // per_rank] += expert_load[e] / count[e]
    return loads


def refine_placement(
    expert_map: ExpertMap,
    sources: Sources,
    min_gap: float = MIN_GAP,
    max_evaluations: int = MAX_EVALUATIONS,
) -> ExpertMap:
    """`expert_map` with each layer's placement refined for the routers' spread of the tokens of
    `sources` (the module's docstring); the same map where nothing improves. A layer is searched
    only where the routers' spread predicts a balancedness at least `min_gap` below the equal
    shares the placement was made for (where the two agree, as with many ranks and few replicas
    per expert, there is little to gain), the layers of the widest gap first, until
    `max_evaluations` moves have been evaluated in all (the check runs between two model
    steps: the search must not stall the group)."""
    m = expert_map
    per_layer = source_rows(sources, m.num_layers, m.num_logical)
    gaps = []
    for layer in range(m.num_layers):
        row, spread = m.phy2log[layer], per_layer[layer]
        expert_load = [sum(n for _, n in spread[e]) for e in range(m.num_logical)]
        assumed = layer_balancedness(equal_share_loads(row, m.num_logical, m.ep_size, expert_load))
        routed = layer_balancedness(layer_rank_loads(row, m.num_logical, m.ep_size, spread))
        if assumed - routed >= min_gap:
            gaps.append((-(assumed - routed), layer))
    rows = [list(r) for r in m.phy2log]
    budget = [max_evaluations]
    for _, layer in sorted(gaps):
        if budget[0] <= 0:
            break
        rows[layer] = refine_row(
            rows[layer], m.num_logical, m.ep_size, per_layer[layer], budget=budget
        )
    if all(tuple(r) == old for r, old in zip(rows, m.phy2log, strict=True)):
        return m
    return ExpertMap.from_phy2log(rows, m.num_logical, m.ep_size, m.seed)
