from __future__ import annotations

import torch

from safeserve.engine.sampler import sample
from safeserve.messages import SamplingParams


def test_greedy_picks_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0]) == [1, 0]


def test_top_k_and_top_p_restrict_support() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen_k, seen_p = set(), set()
    for seed in range(200):
        seen_k |= set(sample(logits, [SamplingParams(temperature=1.0, top_k=2, seed=seed)], [0]))
        seen_p |= set(sample(logits, [SamplingParams(temperature=1.0, top_p=0.7, seed=seed)], [0]))
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7 stops there


def test_seed_and_position_determine_the_draw() -> None:
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=7)
    assert sample(logits, [p], [3]) == sample(logits, [p], [3])
    draws = {sample(logits, [p], [i])[0] for i in range(20)}
    assert len(draws) > 10
