"""The planner's formulas on cases computed by hand (or by enumeration), and the calibration fit
recovering the parameters of steps made from known ones."""

from __future__ import annotations

import itertools
import math

import pytest

from safeserve.plan.arithmetic import (
    a2a_bytes,
    a2a_seconds,
    expected_union,
    fit_calibration,
    in_node_share,
    predicted_step_s,
    ranks_reached,
    selection_probs,
    union_uniform,
)


def test_union_of_experts_by_hand() -> None:
    assert union_uniform(8, 2, 1) == pytest.approx(2.0)  # one token reads its k experts
    assert union_uniform(4, 1, 2) == pytest.approx(4 * (1 - 0.75**2))  # 1.75
    assert union_uniform(128, 8, 64) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 64))
    assert union_uniform(8, 2, 0) == 0.0
    assert union_uniform(8, 8, 3) == pytest.approx(8.0)  # every token reads every expert


def test_union_from_a_recorded_distribution() -> None:
    # two experts take every choice of a top-2 model: 2 experts whatever the batch
    probs = selection_probs([50, 50, 0, 0], 2)
    assert probs == [1.0, 1.0, 0.0, 0.0]
    assert expected_union(probs, 10) == pytest.approx(2.0)
    # a token chooses expert 0 with p = 0.5, expert 1 with 0.25, expert 2 with 0.25 (top-1)
    probs = selection_probs([2, 1, 1], 1)
    assert expected_union(probs, 2) == pytest.approx((1 - 0.25) + 2 * (1 - 0.75**2))
    with pytest.raises(ValueError):
        selection_probs([0, 0], 1)


@pytest.mark.parametrize("experts,ranks,k", [(4, 2, 2), (8, 4, 2), (8, 2, 3), (6, 3, 1)])
def test_ranks_reached_equals_enumeration(experts: int, ranks: int, k: int) -> None:
    per = experts // ranks
    combos = list(itertools.combinations(range(experts), k))
    mean = sum(len({e // per for e in c}) for c in combos) / len(combos)
    assert ranks_reached(ranks, experts, k) == pytest.approx(mean)
    assert ranks_reached(1, experts, k) == 1.0


def test_a2a_bytes_counts_rows_to_other_ranks() -> None:
    # 4 experts on 2 ranks, top-2: a token reaches 5/3 ranks on average, its own in 5/6 of
    # cases (C(2,2)/C(4,2) = 1/6 misses it), so 5/3 - 5/6 = 5/6 rows leave per token
    assert a2a_bytes(6, 2, 4, 2, hidden=10, itemsize=2) == pytest.approx(6 * 5 / 6 * 20)
    assert a2a_bytes(6, 1, 4, 2, hidden=10, itemsize=2) == 0.0


def test_in_node_share_and_link_times() -> None:
    assert in_node_share(16, 8) == 0.5  # "about half stays on NVLink at EP16"
    assert in_node_share(32, 8) == 0.25  # "a quarter at EP32"
    assert in_node_share(4, 8) == 1.0
    # EP8 in one node: all 7 other GPUs over NVLink
    assert a2a_seconds(7e9, 8, 8, 100.0, 10.0) == pytest.approx(7e9 / 100e9)
    # EP16 over two nodes: 7 of the 15 other GPUs in the node, 8 across
    t = a2a_seconds(15e9, 16, 8, 100.0, 10.0)
    assert t == pytest.approx(7e9 / 100e9 + 8e9 / 10e9)
    assert a2a_seconds(1e9, 1, 8, 100.0, 10.0) == 0.0


def test_the_fit_recovers_known_parameters() -> None:
    eff, layer_us, ceiling, layers = 0.9, 30.0, 4000.0, 48
    points = [(b, predicted_step_s(b, layers, ceiling, eff, layer_us)) for b in (6e9, 2e10, 6e10)]
    got_eff, got_us = fit_calibration(points, layers, ceiling)
    assert got_eff == pytest.approx(eff)
    assert got_us == pytest.approx(layer_us)
    with pytest.raises(ValueError):
        fit_calibration(points[:1], layers, ceiling)
    assert math.isclose(predicted_step_s(4e9, 10, 4000.0, 1.0, 100.0), 1e-3 + 1e-3)


@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_union_equals_sampled_uniform_routing(tokens: int) -> None:
    """Independent tokens, each choosing 8 distinct experts of 128 at random."""
    import random

    rng = random.Random(tokens)
    trials = 2000
    seen = sum(
        len({e for _ in range(tokens) for e in rng.sample(range(128), 8)}) for _ in range(trials)
    )
    assert seen / trials == pytest.approx(union_uniform(128, 8, tokens), rel=0.01)


def test_fp8_bytes_by_hand() -> None:
    from safeserve.model.checkpoint import load_model_config
    from safeserve.model.spec import ExpertSlice, ExpertSource, Slice, WeightSpec
    from safeserve.parallel.layout import Layout
    from safeserve.plan.model import ModelFacts, fp8_bytes

    # one float32 scale per 128 x 128 block; the last blocks partial
    matrix = WeightSpec((256, 384), Slice(), "w", linear=True)
    assert fp8_bytes(matrix) == 256 * 384 + 4 * (2 * 3)
    # 2 experts' gate|up [2 x 192, 129]: gate and up tiled each on its own, 2 x 2 row blocks
    # (not 3, as one 384-row matrix would have), 2 column blocks
    source = ExpertSource(None, ("g{e}", "u{e}"))
    w13 = WeightSpec((2, 384, 129), ExpertSlice((0, 1), 0, 192, 192, True), source, linear=True)
    assert fp8_bytes(w13) == 2 * (384 * 129 + 4 * (4 * 2))
    cfg = load_model_config("kernels/configs/qwen3-30b-a3b")
    bf16 = ModelFacts(cfg, 2).rank_bytes(Layout())
    fp8 = ModelFacts(cfg, 2, "fp8", 1).rank_bytes(Layout())
    # one expert: gate|up [1536, 2048] and down [2048, 768], each with its 128 x 128 scales
    assert fp8.expert == 1536 * 2048 + 4 * 12 * 16 + 2048 * 768 + 4 * 16 * 6
    assert bf16.expert == 2 * (1536 * 2048 + 2048 * 768)
    assert fp8.embed_row == bf16.embed_row  # the embedding stays in the model's dtype
    assert fp8.kv_token == bf16.kv_token // 2
    # the LM head and the routers stay bf16 too: what the dense part loses is the projections'
    lm_head = 151936 * 2048 * 2
    assert lm_head < fp8.dense < bf16.dense
