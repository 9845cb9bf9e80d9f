from __future__ import annotations

import random

import pytest
import torch

from safeserve.guards.admission import DispatchBuffers, plan_rounds, plan_token_rounds


@pytest.mark.parametrize("seed", range(20))
def test_plan_rounds_fits_budget_and_covers_every_row_once(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(1, 5)
    budget = rng.randint(1, 40)
    counts = [[rng.choice([0, rng.randint(0, 60)]) for _ in range(world)] for _ in range(world)]
    rounds = plan_rounds(counts, budget)
    col = [sum(counts[s][d] for s in range(world)) for d in range(world)]
    assert len(rounds) == max([1] + [(c + budget - 1) // budget for c in col])
    for d in range(world):
        for plan in rounds:
            assert sum(plan[s][d][1] - plan[s][d][0] for s in range(world)) <= budget
        for s in range(world):
            pieces = [plan[s][d] for plan in rounds if plan[s][d][1] > plan[s][d][0]]
            # contiguous, in order, exactly the pair's rows
            pos = 0
            for lo, hi in pieces:
                assert lo == pos
                pos = hi
            assert pos == counts[s][d]


def test_plan_token_rounds() -> None:
    rounds = plan_token_rounds([5, 0, 7], 4)
    assert len(rounds) == 3
    taken = [[hi - lo for lo, hi in r] for r in rounds]
    assert [sum(t) for t in taken] == [4, 4, 4]
    assert [sum(t[s] for t in taken) for s in range(3)] == [5, 0, 7]
    assert plan_token_rounds([0, 0], 4) == [[(0, 0), (0, 0)]]


def test_buffers_refuse_rounds_over_budget() -> None:
    bufs = DispatchBuffers.allocate(8, 16, 4, 2, torch.float32, torch.device("cpu"))
    assert bufs.hidden.shape == (8, 16) and bufs.work_gate_up.shape == (8, 8)
    bufs.record_round(8)
    assert bufs.stats.recv_peak == 8 and bufs.stats.buffer_peak_bytes <= bufs.stats.buffer_bytes
    with pytest.raises(RuntimeError, match="admission violated"):
        bufs.record_round(9)
