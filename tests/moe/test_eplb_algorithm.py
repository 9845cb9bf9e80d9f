"""EPLB placement: hand-worked replication and packing, and properties over random loads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from seeds import seeded

from safeserve.moe.eplb.algorithm import (
    balanced_packing,
    logical_to_physical_map,
    rebalance_experts,
    replicate_experts,
)
from safeserve.moe.eplb.balancedness import layer_balancedness


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, count: torch.Tensor, num_gpus: int):
    """[L, G] load per GPU; a replicated expert's tokens split evenly over its replicas."""
    share = (weight.double() / count.double()).gather(1, phy2log)
    return share.view(weight.size(0), num_gpus, -1).sum(-1)


def balancedness(loads: torch.Tensor) -> float:
    rows = loads.tolist()
    return sum(layer_balancedness(r) for r in rows) / len(rows)


def test_replicate_gives_each_extra_slot_to_the_largest_load_per_replica() -> None:
    # loads/replica: [10,2,6,2] -> e0 (10) -> [5,2,6,2] -> e2 (6) -> [5,2,3,2] -> e0 (5)
    slots, replica, count = replicate_experts(torch.tensor([10, 2, 6, 2]), 7)
    assert slots.tolist() == [0, 1, 2, 3, 0, 2, 0]
    assert replica.tolist() == [0, 0, 0, 0, 1, 1, 2]
    assert count.tolist() == [3, 1, 2, 1]


def test_replicate_ties_go_to_fewer_replicas_then_the_lower_index() -> None:
    # [4,2]: e0 (4) -> [2,2] tied -> e1 has fewer replicas -> [2,1] -> e0
    slots, _, count = replicate_experts(torch.tensor([[4, 2]]), 5)
    assert slots.tolist() == [[0, 1, 0, 1, 0]] and count.tolist() == [[3, 2]]
    # no load at all: the extra slots spread, lowest index first
    slots, _, count = replicate_experts(torch.zeros(1, 4), 7)
    assert slots.tolist() == [[0, 1, 2, 3, 0, 1, 2]] and count.tolist() == [[2, 2, 2, 1]]


def test_balanced_packing_heaviest_first_into_the_lightest_pack_with_room() -> None:
    # sorted: 5(i0) 5(i4) 3(i2) 3(i5) 2(i1) 2(i3); packs of 3
    # i0->A(5) i4->B(5) i2->A(8, tie->lower) i5->B(8) i1->A(10, full) i3->B(10)
    pack, rank = balanced_packing(torch.tensor([5, 2, 3, 2, 5, 3]), 2)
    assert pack.tolist() == [0, 0, 0, 1, 1, 1]
    assert rank.tolist() == [0, 2, 1, 2, 0, 1]
    # a full pack takes no more items, however light: 9(i0)->A, 1(i1)->B, 1(i2)->B (full),
    # 1(i3)->A
    pack, rank = balanced_packing(torch.tensor([[9, 1, 1, 1]]), 2)
    assert pack.tolist() == [[0, 1, 1, 0]] and rank.tolist() == [[0, 0, 1, 1]]
    # one item per pack: nothing to balance, nothing moves
    pack, rank = balanced_packing(torch.tensor([1, 7, 3]), 3)
    assert pack.tolist() == [0, 1, 2] and rank.tolist() == [0, 0, 0]


def test_global_policy_worked_example() -> None:
    # E=4, P=6, 2 GPUs. Replicas: e0 and e2 twice -> slot loads [5,2,3,2 | 5,3] (see the
    # packing example above): GPU0 = e0, e2, e1 and GPU1 = e0, e2, e3, 10 tokens each.
    weight = torch.tensor([[10, 2, 6, 2]])
    phy2log, log2phy, count = rebalance_experts(weight, 6, num_groups=1, num_nodes=1, num_gpus=2)
    assert phy2log.tolist() == [[0, 2, 1, 0, 2, 3]]
    assert count.tolist() == [[2, 1, 2, 1]]
    assert log2phy.tolist() == [[[0, 3, -1], [2, -1, -1], [1, 4, -1], [5, -1, -1]]]
    assert gpu_loads(weight, phy2log, count, 2).tolist() == [[10.0, 10.0]]
    # the trivial placement (no replicas) would have given [12, 8]
    assert weight.view(2, 2).sum(1).tolist() == [12, 8]


def test_hierarchical_policy_worked_example() -> None:
    # E=8 in 4 groups of 2, 2 nodes of 2 GPUs, P=12 (6 per node, 3 per GPU).
    weight = torch.tensor([[9, 1, 2, 2, 4, 4, 1, 1]])
    # groups g0={e0,e1}=10 g1={e2,e3}=4 g2={e4,e5}=8 g3={e6,e7}=2 -> nodes (2 groups each):
    # g0->N0, g2->N1, g1->N1 (12), g3->N0 (12).
    # N0 = [e0 e1 e6 e7] = [9,1,1,1]: e0 gets both extra slots (9, then 4.5) -> slot loads
    #   [3,1,1,1,3,3]: GPU0 = e0,e0,e7 (7), GPU1 = e0,e1,e6 (5).
    # N1 = [e4 e5 e2 e3] = [4,4,2,2]: e4 then e5 -> all slots 2: GPU2 = e4,e2,e4, GPU3 = e5,e3,e5.
    phy2log, log2phy, count = rebalance_experts(weight, 12, num_groups=4, num_nodes=2, num_gpus=4)
    assert phy2log.tolist() == [[0, 0, 7, 0, 1, 6, 4, 2, 4, 5, 3, 5]]
    assert count.tolist() == [[3, 1, 1, 1, 2, 2, 1, 1]]
    assert log2phy[0, 0].tolist() == [0, 1, 3, -1, -1]
    assert log2phy[0, 4].tolist() == [6, 8, -1, -1, -1]
    assert log2phy[0, 7].tolist() == [2, -1, -1, -1, -1]
    assert gpu_loads(weight, phy2log, count, 4).tolist() == [[7.0, 5.0, 6.0, 6.0]]
    # one group over two nodes: the global policy, free to spread e0 over both nodes.
    # Same replicas; slot loads [3,1,2,2,2,2,1,1 | 3,3,2,2] packed over 4 GPUs of 3 slots.
    phy2log, _, count = rebalance_experts(weight, 12, num_groups=1, num_nodes=2, num_gpus=4)
    assert count.tolist() == [[3, 1, 1, 1, 2, 2, 1, 1]]
    assert phy2log.tolist() == [[0, 4, 1, 0, 5, 6, 0, 4, 7, 2, 3, 5]]
    assert gpu_loads(weight, phy2log, count, 4).tolist() == [[6.0, 6.0, 6.0, 6.0]]


@pytest.mark.parametrize(
    ("shape", "args", "message"),
    [
        ((2, 8), (10, 1, 1, 4), "split evenly over 4 GPUs"),
        ((2, 8), (6, 1, 1, 2), "< 8 logical experts"),
        ((2, 8), (8, 3, 1, 2), "into 3 groups"),
        ((2, 8), (8, 2, 2, 3), "multiple of num_nodes"),
        ((2, 8), (8, 1, 0, 2), "num_nodes must be >= 1"),
        ((8,), (8, 1, 1, 2), "num_layers, num_experts"),
    ],
)
def test_bad_sizes_are_refused(shape, args, message) -> None:
    with pytest.raises(ValueError, match=message):
        rebalance_experts(torch.ones(shape), *args)


def test_bad_loads_are_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        rebalance_experts(torch.tensor([[1.0, -1.0]]), 2, 1, 1, 2)
    with pytest.raises(ValueError, match="finite"):
        rebalance_experts(torch.tensor([[1.0, float("nan")]]), 2, 1, 1, 2)
    with pytest.raises(ValueError, match="evenly into 2 packs"):
        balanced_packing(torch.ones(3), 2)


@st.composite
def problems(draw):
    """(weight[L, E], P, groups, nodes, gpus): hierarchical and global topologies."""
    num_nodes = draw(st.sampled_from([1, 2]))
    num_gpus = num_nodes * draw(st.sampled_from([1, 2, 4]))
    num_groups = draw(st.sampled_from([1, 2, 3, 4]))
    num_experts = num_groups * num_gpus * draw(st.sampled_from([1, 2]))
    num_physical = num_experts + num_gpus * draw(st.integers(0, 3))
    layers = draw(st.integers(1, 3))
    # loads from a seed (drawing every count through hypothesis is slow); often with ties
    gen = seeded(draw(st.integers(0, 2**32 - 1)))
    high = draw(st.sampled_from([2, 1000]))
    weight = torch.randint(0, high, (layers, num_experts), generator=gen)
    return weight, num_physical, num_groups, num_nodes, num_gpus


@settings(max_examples=100, deadline=None, derandomize=True)
@given(problems())
def test_placements_are_complete_and_consistent(problem) -> None:
    weight, num_physical, num_groups, num_nodes, num_gpus = problem
    phy2log, log2phy, count = rebalance_experts(weight, *problem[1:])
    num_layers, num_logical = weight.shape
    assert phy2log.shape == (num_layers, num_physical)
    assert log2phy.shape == (num_layers, num_logical, num_physical - num_logical + 1)
    assert (count >= 1).all() and (count.sum(1) == num_physical).all()
    assert ((phy2log >= 0) & (phy2log < num_logical)).all()
    counted = torch.zeros_like(count).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    assert torch.equal(counted, count)
    held = log2phy >= 0
    replica = torch.arange(log2phy.size(2))
    assert torch.equal(held, replica < count.unsqueeze(-1))  # the first count entries, then -1
    experts = torch.arange(num_logical).view(1, -1, 1).expand_as(log2phy)
    holder = phy2log.gather(1, log2phy.clamp(min=0).flatten(1)).view_as(log2phy)
    assert torch.equal(holder[held], experts[held])  # every listed slot holds its expert
    assert (log2phy[..., 1:][held[..., 1:]] > log2phy[..., :-1][held[..., 1:]]).all()  # ascending
    # deterministic, and the inverse map is the one the forward map implies
    again = rebalance_experts(weight, *problem[1:])
    assert all(torch.equal(a, b) for a, b in zip((phy2log, log2phy, count), again, strict=True))
    assert torch.equal(log2phy, logical_to_physical_map(phy2log, num_logical))
    if num_groups % num_nodes == 0:  # hierarchical: a group's replicas all stay on one node
        group_size = num_logical // num_groups
        node_of_slot = torch.arange(num_physical) // (num_physical // num_nodes)
        for layer in range(num_layers):
            group_of_slot = phy2log[layer] // group_size
            for group in range(num_groups):
                assert node_of_slot[group_of_slot == group].unique().numel() == 1


@st.composite
def skewed(draw):
    """A few hot experts (up to half the GPUs) over cold ones, anywhere, global topology."""
    num_gpus = draw(st.sampled_from([2, 4, 8]))
    num_experts = num_gpus * draw(st.sampled_from([1, 2, 4, 8]))
    cold = draw(st.lists(st.integers(10, 20), min_size=num_experts, max_size=num_experts))
    hot = draw(
        st.lists(
            st.tuples(st.integers(0, num_experts - 1), st.integers(80, 500)),
            min_size=1,
            max_size=max(1, num_gpus // 2),
            unique_by=lambda t: t[0],
        )
    )
    for expert, load in hot:
        cold[expert] = load
    redundant = num_gpus * draw(st.integers(0, 2))
    return torch.tensor([cold]), num_experts + redundant, num_gpus


@settings(max_examples=150, deadline=None, derandomize=True)
@given(skewed())
def test_skewed_loads_end_no_worse_than_the_trivial_placement(problem) -> None:
    weight, num_physical, num_gpus = problem
    phy2log, _, count = rebalance_experts(weight, num_physical, 1, 1, num_gpus)
    trivial = weight.double().view(1, num_gpus, -1).sum(-1)
    assert gpu_loads(weight, phy2log, count, num_gpus).max() <= trivial.max()


def test_zipf_loads_with_redundant_slots_are_well_balanced() -> None:
    # 8 layers, 64 experts with Zipf(1) loads in random order, 8 GPUs, 16 redundant slots
    gen = seeded(0)
    layers = [10_000 / (torch.randperm(64, generator=gen) + 1).double() for _ in range(8)]
    weight = torch.stack(layers).round().long()
    phy2log, _, count = rebalance_experts(weight, 80, num_groups=1, num_nodes=1, num_gpus=8)
    trivial = weight.double().view(8, 8, 8).sum(-1)
    assert balancedness(trivial) < 0.6
    assert balancedness(gpu_loads(weight, phy2log, count, 8)) >= 0.9
