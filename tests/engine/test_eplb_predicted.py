"""The rebalance check's predicted balancedness spreads every source's tokens as the routers do
(equally over `ExpertMap.candidates`: a rank's own replicas, else every replica), not an equal
share to every replica of an expert."""

from __future__ import annotations

import pytest
import torch

from safeserve.engine.eplb import predicted_balancedness
from safeserve.moe.expert_map import ExpertMap

# 4 experts in 6 slots on 2 ranks: expert 0 twice on rank 0 (slots 0, 1) and once on rank 1.
MAP = ExpertMap.from_phy2log([[0, 0, 1, 0, 2, 3]], num_logical=4, ep_size=2, seed=5)


def _counts(*row: int) -> torch.Tensor:
    return torch.tensor([row], dtype=torch.int64)


def test_each_rank_keeps_its_tokens_on_its_own_replicas() -> None:
    # Attention data-parallel: each rank's expert-0 tokens stay on it (rank 0 spreads its own
    # over its two replicas there); an equal share per replica would put 2/3 on rank 0: 0.75.
    sources = [(0, _counts(60, 0, 0, 0)), (1, _counts(60, 0, 0, 0))]
    assert predicted_balancedness(MAP, sources) == pytest.approx(1.0)


def test_no_source_rank_spreads_over_every_replica() -> None:
    # expert 0's 120 tokens over its three replicas: 80 on rank 0, 40 on rank 1
    assert predicted_balancedness(MAP, [(None, _counts(120, 0, 0, 0))]) == pytest.approx(0.75)


def test_a_rank_without_a_replica_spreads_over_all_of_them() -> None:
    m = ExpertMap.from_phy2log([[0, 1, 0, 2, 3, 1]], num_logical=4, ep_size=2)
    # expert 2 lives on rank 1 only: rank 0's tokens of it go there too
    sources = [(0, _counts(0, 0, 30, 0)), (1, _counts(0, 0, 30, 0))]
    assert predicted_balancedness(m, sources) == pytest.approx(0.5)
    assert predicted_balancedness(m, [(0, _counts(10, 10, 0, 0))]) == pytest.approx(0.5)
    # expert 1 stays on each rank, rank 1's expert-0 tokens go to rank 0's two replicas: 30, 10
    sources = [(0, _counts(10, 10, 0, 0)), (1, _counts(10, 10, 0, 0))]
    assert predicted_balancedness(m, sources) == pytest.approx(20 / 30)
    # expert 3 lives on rank 1 only, expert 1 on both: rank 0's expert-3 tokens all go to rank 1
    m2 = ExpertMap.from_phy2log([[0, 1, 2, 3, 1, 0]], num_logical=4, ep_size=2)
    sources = [(0, _counts(0, 0, 0, 40))]
    assert predicted_balancedness(m2, sources) == pytest.approx(0.5)
