"""Expert distribution recording: exact counts, passes, windows of balancedness, logical counts."""

from __future__ import annotations

import pytest
import torch

from safeserve.kernels.expert_count import count_experts
from safeserve.moe.eplb.balancedness import layer_balancedness
from safeserve.moe.eplb.recorder import ExpertDistributionRecorder, physical_to_logical_counts


def _route(rec: ExpertDistributionRecorder, layer: int, ids: torch.Tensor) -> None:
    """Counts `ids` into the open pass as a MoE layer's router does."""
    count_experts(ids, rec.pass_row(layer))


def test_counts_are_a_scatter_add_of_the_routed_ids() -> None:
    rec = ExpertDistributionRecorder(num_layers=2, num_physical_experts=4, slots_per_rank=2)
    _route(rec, 0, torch.tensor([[0, 1], [1, 3], [1, -1]]))  # -1: a slot routed nowhere
    _route(rec, 1, torch.tensor([[2, 2], [-1, -1]], dtype=torch.int32))
    rec.end_pass()
    assert rec.dump().tolist() == [[1, 3, 0, 1], [0, 0, 2, 0]]
    _route(rec, 0, torch.tensor([3, 3]))
    _route(rec, 0, torch.tensor([0]))  # a layer recorded twice in a pass adds up
    rec.end_pass()
    assert rec.passes == 2
    assert rec.dump().tolist() == [[2, 3, 0, 3], [0, 0, 2, 0]]


def test_passes_closed_while_disabled_or_discarded_are_not_counted() -> None:
    rec = ExpertDistributionRecorder(1, 2, 1, enabled=False)
    _route(rec, 0, torch.tensor([0, 0, 1]))  # warm-up
    rec.end_pass()
    assert rec.passes == 0 and rec.dump().tolist() == [[0, 0]] and rec.window_means() == {}
    rec.enabled = True
    _route(rec, 0, torch.tensor([1]))
    rec.discard_pass()
    _route(rec, 0, torch.tensor([0, 1]))
    rec.end_pass()
    assert rec.passes == 1 and rec.dump().tolist() == [[1, 1]]
    assert rec.window_means() == {10: 1.0, 100: 1.0, 1000: 1.0}


def test_balancedness_is_per_rank_loads_averaged_over_layers() -> None:
    # 4 slots on 2 ranks. Layer 0: rank loads [3, 1]; layer 1: [2, 2].
    rec = ExpertDistributionRecorder(2, 4, 2)
    _route(rec, 0, torch.tensor([0, 1, 1, 2]))
    _route(rec, 1, torch.tensor([0, 3, 2, 1]))
    rec.end_pass()
    expected = (layer_balancedness([3, 1]) + layer_balancedness([2, 2])) / 2
    assert rec.window_means()[10] == pytest.approx(expected)


def _one_rank_pass(rec: ExpertDistributionRecorder) -> None:
    _route(rec, 0, torch.tensor([0]))  # everything on rank 0 of 2: balancedness ~0.5
    rec.end_pass()


def _even_pass(rec: ExpertDistributionRecorder) -> None:
    _route(rec, 0, torch.tensor([0, 1]))  # balancedness 1
    rec.end_pass()


def test_windows_roll_over_the_last_passes() -> None:
    rec = ExpertDistributionRecorder(1, 2, 1)
    half = layer_balancedness([1, 0])
    _one_rank_pass(rec)
    for _ in range(10):
        _even_pass(rec)
    means = rec.window_means()  # 11 passes: the 10-window leaves out the first
    assert means[10] == pytest.approx(1.0)
    assert means[100] == pytest.approx((half + 10) / 11) and means[1000] == means[100]
    # read in pieces or at once, the windows are the same
    for _ in range(5):
        _one_rank_pass(rec)
    assert rec.window_means()[10] == pytest.approx((5 * half + 5) / 10)
    for _ in range(1200):  # more passes than the longest window between two reads
        _even_pass(rec)
    _one_rank_pass(rec)
    assert rec.passes == 1217
    means = rec.window_means()
    assert means[10] == pytest.approx((half + 9) / 10)
    assert means[1000] == pytest.approx((half + 999) / 1000)


def test_reset_forgets_every_pass() -> None:
    rec = ExpertDistributionRecorder(1, 2, 1)
    _one_rank_pass(rec)
    rec.window_means()
    _one_rank_pass(rec)
    _route(rec, 0, torch.tensor([1, 1]))  # left open
    rec.reset()
    assert rec.passes == 0 and rec.window_means() == {} and rec.dump().tolist() == [[0, 0]]
    _even_pass(rec)
    assert rec.dump().tolist() == [[1, 1]] and rec.window_means()[10] == pytest.approx(1.0)


def test_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="6 physical experts cannot be split into ranks of 4"):
        ExpertDistributionRecorder(1, 6, 4)
    with pytest.raises(ValueError, match="need >= 1 layer"):
        ExpertDistributionRecorder(0, 4, 2)


def test_physical_counts_become_logical_counts_summed_over_replicas() -> None:
    physical = torch.tensor([[5, 1, 2, 7, 3, 0], [1, 1, 1, 1, 1, 1]])
    phy2log = torch.tensor([[0, 2, 1, 0, 2, 3], [3, 2, 1, 0, 0, 0]])
    logical = physical_to_logical_counts(physical, phy2log, 4)
    assert logical.tolist() == [[12, 2, 4, 0], [3, 1, 1, 1]]
    assert logical.dtype == torch.int64
    with pytest.raises(ValueError, match="must both be"):
        physical_to_logical_counts(physical, phy2log[:1], 4)
