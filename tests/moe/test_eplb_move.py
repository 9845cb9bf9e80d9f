"""Expert-weight moves between placements: the transfers one layer needs (hand-computed cases),
carried out on a real 3-rank gloo group (each slot ends up holding its new expert's weights),
and the starting placement read from --init-expert-location files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from safeserve.moe.eplb.distribution import write_expert_distribution
from safeserve.moe.eplb.location import (
    LocationError,
    initial_expert_map,
    write_map_file,
)
from safeserve.moe.eplb.move import Transfer, layer_transfers
from safeserve.moe.expert_map import ExpertMap
from safeserve.spawn import run_ranks


def test_transfers_prefer_the_own_rank_and_spread_over_holders() -> None:
    # 2 ranks x 3 slots; old: rank 0 holds 0 1 2, rank 1 holds 3 0 1
    old = [0, 1, 2, 3, 0, 1]
    new = [0, 0, 2, 3, 1, 2]
    assert layer_transfers(old, new, 3) == [
        Transfer(0, 0, 0, 1),  # slot 1 <- expert 0, held on its own rank (slot 0)
        Transfer(1, 2, 1, 1),  # slot 4 <- expert 1, on its own rank (local slot 2)
        Transfer(0, 2, 1, 2),  # slot 5 <- expert 2, only on rank 0
    ]
    assert layer_transfers(old, old, 3) == []


def test_remote_requests_for_one_expert_take_its_holders_in_turn() -> None:
    old = [0, 0, 1, 2, 3, 4]  # expert 0 twice on rank 0 (slots 0, 1)
    new = [1, 2, 3, 0, 0, 4]  # ranks 0's slots get 1 2 3 (rank 1), rank 1's get 0 0
    got = layer_transfers(old, new, 3)
    assert [t for t in got if t.dst_rank == 1 and t.src_rank == 0] == [
        Transfer(0, 0, 1, 0),
        Transfer(0, 1, 1, 1),
    ]
    with pytest.raises(ValueError, match="held by no slot"):
        layer_transfers([0, 0, 1, 1], [0, 2, 1, 1], 2)


def _weights(row: list[int], rank: int, spr: int) -> list[torch.Tensor]:
    """Slot weights that name their expert: w13[slot] filled with e, w2 with -e."""
    mine = row[rank * spr : (rank + 1) * spr]
    w13 = torch.stack([torch.full((4, 3), float(e)) for e in mine])
    w2 = torch.stack([torch.full((3, 2), -float(e)) for e in mine])
    return [w13, w2]


def _move_rank(rank: int, world: int, init: str, old: list, new: list) -> tuple[list, int]:
    from safeserve.moe.eplb.move import move_layer
    from safeserve.parallel.comm import Comm
    from safeserve.parallel.layout import Layout

    comm = Comm(Layout(rank, world, world, False), torch.device("cpu"))
    comm.init(init)
    spr = len(old) // world
    weights = _weights(old, rank, spr)
    sent = move_layer(weights, layer_transfers(old, new, spr), rank, comm)
    comm.shutdown()
    return [w.tolist() for w in weights], sent


def test_a_move_on_three_ranks_leaves_every_slot_with_its_new_expert() -> None:
    old = [0, 1, 2, 3, 4, 5, 0, 1, 2]
    new = [5, 1, 5, 0, 2, 4, 3, 3, 0]
    got = run_ranks(_move_rank, 3, (old, new), timeout=60)
    total_sent = 0
    for rank, (weights, sent) in enumerate(got):
        want = _weights(new, rank, 3)
        assert weights == [w.tolist() for w in want], f"rank {rank}"
        total_sent += sent
    slot = (4 * 3 + 3 * 2) * 4  # float32 bytes of one slot's w13 and w2
    remote = sum(t.remote for t in layer_transfers(old, new, 3))
    assert total_sent == remote * slot


def _fp8_experts(row: list[int], rank: int, spr: int):  # type: ignore[no-untyped-def]
    """A rank's FP8 experts (`ExpertRunner.use_fp8`) whose weights and scales name their
    expert: w13 filled with e, w2 with -e, the scales with e + 0.5."""
    from types import SimpleNamespace

    from safeserve.moe.runner import ExpertRunner

    runner = ExpertRunner(spr, 4, 3)
    runner.use_fp8((128, 128))
    with torch.no_grad():
        for slot, e in enumerate(row[rank * spr : (rank + 1) * spr]):
            runner.w13[slot] = float(e)
            runner.w2[slot] = -float(e)
            runner.w13_scale_inv[slot] = e + 0.5
            runner.w2_scale_inv[slot] = e + 0.5
    return SimpleNamespace(experts=runner)


def _move_fp8_rank(rank: int, world: int, init: str, old: list, new: list) -> list:
    from safeserve.engine.rank_eplb import expert_weights
    from safeserve.moe.eplb.move import move_layer
    from safeserve.parallel.comm import Comm
    from safeserve.parallel.layout import Layout

    comm = Comm(Layout(rank, world, world, False), torch.device("cpu"))
    comm.init(init)
    spr = len(old) // world
    layer = _fp8_experts(old, rank, spr)
    move_layer(expert_weights(layer), layer_transfers(old, new, spr), rank, comm)  # type: ignore[arg-type]
    comm.shutdown()
    return [p.float().tolist() for p in layer.experts.parameters()]


def test_fp8_experts_move_with_their_scales() -> None:
    old, new = [0, 1, 2, 3], [3, 1, 0, 0]
    got = run_ranks(_move_fp8_rank, 2, (old, new), timeout=60)
    for rank, params in enumerate(got):
        want = [p.float().tolist() for p in _fp8_experts(new, rank, 2).experts.parameters()]
        assert params == want, f"rank {rank}"


def test_location_files(tmp_path: Path) -> None:
    trivial = initial_expert_map("trivial", 8, 2, 4, redundant=4)
    assert trivial.num_physical == 12 and trivial.phy2log[0][8:] == (0, 1, 2, 3)
    counts = torch.tensor([[90, 5, 5, 5, 5, 5, 5, 80]] * 2)
    dist = tmp_path / "dist.json"
    write_expert_distribution(dist, counts)
    placed = initial_expert_map(str(dist), 8, 2, 4, redundant=4)
    assert placed.replica_count(0, 0) >= 2 and placed.replica_count(0, 7) >= 2
    path = tmp_path / "map.json"
    write_map_file(path, placed)
    assert initial_expert_map(str(path), 8, 2, 4, redundant=4) == placed
    for location, args, message in [
        (str(dist), (8, 3, 4, 4), "num_layers is 2, the model has 3"),
        (str(path), (8, 2, 4, 0), "has 12 slots, this server has 8"),
        (str(path), (16, 2, 4, 4), "num_logical_experts is 8, the model has 16"),
        (str(tmp_path / "none.json"), (8, 2, 4, 0), "cannot read it"),
        ("trivial", (8, 2, 4, 3), "cannot be split evenly over 4"),
    ]:
        with pytest.raises(LocationError, match=message):
            initial_expert_map(location, *args)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "nope"}))
    with pytest.raises(LocationError, match="format must be"):
        initial_expert_map(str(bad), 8, 2, 4)
    assert isinstance(placed, ExpertMap)
