"""The placement refined for the routers' spread (own replicas first, else every replica): its
load model is the check's prediction, it never predicts worse than DeepSeek's placement, it fixes
a case where equal shares per replica are wrong, and it keeps every expert."""

from __future__ import annotations

import random

import pytest
import torch
from seeds import seeded

from safeserve.engine.eplb import predicted_balancedness
from safeserve.moe.eplb.balancedness import layer_balancedness
from safeserve.moe.eplb.location import placement_of_counts
from safeserve.moe.eplb.refine import (
    expert_rank_loads,
    layer_rank_loads,
    refine_placement,
    source_rows,
)
from safeserve.moe.expert_map import ExpertMap


def _random_case(seed: int, layers: int = 3, experts: int = 8, ep: int = 4, redundant: int = 8):
    gen = seeded(seed)
    skew = torch.rand(layers, experts, generator=gen) ** 4 * 100  # a few hot experts
    sources = [(r, torch.poisson(skew, generator=gen).to(torch.int64)) for r in range(ep)]
    total = sum(c for _, c in sources)
    return total, sources, experts + redundant, ep


def test_an_expert_on_its_sources_ranks_stays_there() -> None:
    # ranks 0 and 1 hold it (rank 0 twice): they keep their own tokens; rank 2's spread 2:1
    loads = expert_rank_loads([2, 1, 0], [(0, 10.0), (1, 4.0), (2, 9.0), (None, 3.0)])
    assert loads == pytest.approx([10 + 6 + 2, 4 + 3 + 1, 0])


@pytest.mark.parametrize("seed", range(4))
def test_the_load_model_is_the_checks_prediction(seed: int) -> None:
    total, sources, physical, ep = _random_case(seed)
    rng = random.Random(seed)
    rows = []
    for _ in range(total.shape[0]):
        row = list(range(8)) + [rng.randrange(8) for _ in range(physical - 8)]
        rng.shuffle(row)
        rows.append(row)
    m = ExpertMap.from_phy2log(rows, 8, ep, seed=seed)
    per_layer = source_rows(sources + [(None, total // 3)], m.num_layers, 8)
    mine = [
        layer_balancedness(layer_rank_loads(m.phy2log[i], 8, ep, per_layer[i]))
        for i in range(m.num_layers)
    ]
    want = predicted_balancedness(m, sources + [(None, total // 3)])
    assert sum(mine) / len(mine) == pytest.approx(want)


@pytest.mark.parametrize("seed", range(6))
def test_refining_never_predicts_worse_and_keeps_every_expert(seed: int) -> None:
    total, sources, physical, ep = _random_case(seed)
    base = placement_of_counts(total, physical, ep)
    refined = refine_placement(base, sources)
    assert refined.num_physical == base.num_physical and refined.ep_size == ep
    assert refined.seed == base.seed
    for row in refined.phy2log:
        assert sorted(set(row)) == list(range(8))
    assert predicted_balancedness(refined, sources) >= predicted_balancedness(base, sources) - 1e-9
    assert refine_placement(base, sources).phy2log == refined.phy2log  # deterministic
    assert refine_placement(refined, sources) is refined  # nothing left to improve


def test_a_hot_expert_held_on_every_rank_stays_with_its_sources() -> None:
    """4 experts in 8 slots on 2 ranks, expert 0 80 % of the pairs, both ranks routing alike.
    DeepSeek's placement gives each rank 3 replicas of expert 0 and puts 1 and 2 together (rank
    1: 80 + 20 + 12, rank 0: 80 + 8): 0.89 predicted. Each rank keeps its own expert-0 tokens
    whatever its replica count, so the cold experts decide; refined: 1 beside 0 on rank 0, 2 and
    3 on rank 1, 100 pairs each."""
    sources = [(r, torch.tensor([[80, 10, 6, 4]])) for r in range(2)]
    base = placement_of_counts(sources[0][1] + sources[1][1], 8, 2)
    refined = refine_placement(base, sources)
    assert predicted_balancedness(base, sources) == pytest.approx(100 / 112)
    assert predicted_balancedness(refined, sources) == pytest.approx(1.0)
    # rank 0 routes four times what rank 1 does: 0.64 -> 0.83
    sources = [(0, torch.tensor([[70, 20, 6, 4]])), (1, torch.tensor([[17, 5, 1, 1]]))]
    base = placement_of_counts(sources[0][1] + sources[1][1], 8, 2)
    before = predicted_balancedness(base, sources)
    after = predicted_balancedness(refine_placement(base, sources), sources)
    assert before < 0.65 and after > 0.8


def test_sources_routing_alike_spread_over_every_replica() -> None:
    # None (tensor-parallel attention's shares are per rank; None: every replica): equal shares
    # per replica, DeepSeek's own assumption, so its placement is already balanced
    counts = torch.tensor([[60, 20, 20, 20]])
    base = placement_of_counts(counts, 6, 2)
    assert predicted_balancedness(base, [(None, counts)]) == pytest.approx(1.0)
    assert refine_placement(base, [(None, counts)]) is base
