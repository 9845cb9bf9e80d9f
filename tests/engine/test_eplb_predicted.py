"""The rebalance check's predicted balancedness sends every source's tokens where the routers
send them (`ExpertMap.send_to`), not an equal share to every replica."""

from __future__ import annotations

import pytest
import torch

from safeserve.engine.eplb import predicted_balancedness
from safeserve.moe.expert_map import ExpertMap

# 4 experts in 6 slots on 2 ranks: expert 0 twice on rank 0 (slots 0, 1) and once on rank 1.
MAP = ExpertMap.from_phy2log([[0, 0, 1, 0, 2, 3]], num_logical=4, ep_size=2, seed=5)


def _counts(*row: int) -> torch.Tensor:
    return torch.tensor([row], dtype=torch.int64)


def test_each_rank_sends_to_its_own_replica() -> None:
    # Attention data-parallel: each rank's expert-0 tokens stay on it; the second replica on
    # rank 0 takes none (an equal share would put 2/3 of them on rank 0: 0.75).
    sources = [(0, _counts(60, 0, 0, 0)), (1, _counts(60, 0, 0, 0))]
    assert predicted_balancedness(MAP, sources) == pytest.approx(1.0)


def test_a_shared_choice_sends_an_expert_to_one_replica() -> None:
    # Tensor-parallel attention: one replica takes all of expert 0's tokens.
    assert predicted_balancedness(MAP, [(None, _counts(120, 0, 0, 0))]) == pytest.approx(0.5)


def test_a_rank_without_a_replica_sends_to_one_of_them() -> None:
    m = ExpertMap.from_phy2log([[0, 1, 0, 2, 3, 1]], num_logical=4, ep_size=2)
    # expert 2 lives on rank 1 only: rank 0's tokens of it go there too
    sources = [(0, _counts(0, 0, 30, 0)), (1, _counts(0, 0, 30, 0))]
    assert predicted_balancedness(m, sources) == pytest.approx(0.5)
    assert predicted_balancedness(m, [(0, _counts(10, 10, 0, 0))]) == pytest.approx(0.5)
    # expert 1 stays on each rank, rank 1's expert-0 tokens go to rank 0: 30 and 10
    sources = [(0, _counts(10, 10, 0, 0)), (1, _counts(10, 10, 0, 0))]
    assert predicted_balancedness(m, sources) == pytest.approx(20 / 30)
