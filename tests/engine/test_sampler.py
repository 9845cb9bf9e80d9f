from __future__ import annotations

import torch
from seeds import seeded

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


def test_tiny_temperature_is_greedy_and_equals_temperature_zero() -> None:
    gen = seeded(3)
    logits = torch.randn(4, 50, generator=gen) * 10
    greedy = sample(logits, [SamplingParams(temperature=0.0)] * 4, [0] * 4)
    for t in (1e-300, 1e-6, 0.0):
        assert sample(logits, [SamplingParams(temperature=t, seed=1)] * 4, [0] * 4) == greedy
    assert greedy == torch.argmax(logits, dim=-1).tolist()


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=10, seed=-3),
        SamplingParams(temperature=2.0, seed=2**70),
    ]


def test_a_non_finite_row_fails_alone() -> None:
    gen = seeded(4)
    logits = torch.randn(4, 64, generator=gen)
    params = _mixed_params()
    clean = sample(logits, params, [1, 2, 3, 4])
    assert all(isinstance(t, int) for t in clean)
    for bad_row, bad in [
        (0, float("nan")),
        (1, float("inf")),
        (2, float("-inf")),
        (3, float("nan")),
    ]:
        x = logits.clone()
        x[bad_row, 7] = bad
        got = sample(x, params, [1, 2, 3, 4])
        assert isinstance(got[bad_row], str) and got[bad_row].startswith("sample: ")
        assert "NaN or inf" in got[bad_row]
        assert [t for i, t in enumerate(got) if i != bad_row] == [
            t for i, t in enumerate(clean) if i != bad_row
        ]


def test_nan_temperature_fails_its_row_only() -> None:
    logits = torch.randn(2, 16, generator=seeded(0))
    got = sample(
        logits,
        [SamplingParams(temperature=float("nan"), seed=1), SamplingParams(temperature=0)],
        [0, 0],
    )
    assert isinstance(got[0], str) and "not a distribution" in got[0]
    assert got[1] == int(torch.argmax(logits[1]))


def test_edge_values_are_handled() -> None:
    gen = seeded(9)
    logits = torch.randn(1, 32, generator=gen)
    best = int(torch.argmax(logits))
    cases = [
        SamplingParams(temperature=1.0, top_k=10**6, seed=1),  # top_k past the vocabulary
        SamplingParams(temperature=1.0, top_p=1e-300, seed=1),  # 0 in float32: keeps the first
        SamplingParams(temperature=1.0, top_p=0.0, seed=1),
        SamplingParams(temperature=2.0, seed=1),
        SamplingParams(temperature=1.0, seed=-1),
        SamplingParams(temperature=1.0, seed=2**64 + 17),
        SamplingParams(temperature=1.0, seed=-(2**100)),
        SamplingParams(temperature=1e-5, seed=3),  # just above greedy: huge logits, no overflow
    ]
    for p in cases:
        (tok,) = sample(logits, [p], [10**12])
        assert isinstance(tok, int) and 0 <= tok < 32, p
    for p in cases[1:3]:
        assert sample(logits, [p], [0]) == [best]
    # extreme (finite) logits with a temperature just above the greedy cut-off
    huge = torch.tensor([[3e38, -3e38, 1e38, 0.0]])
    assert sample(huge, [SamplingParams(temperature=1.5e-5, seed=1)], [0]) == [0]
