"""The expert map: hand-worked trivial and redundant placements, its validation, the replica each
rank sends a token to, and that the readers (specs, loader, routers) follow a non-trivial map."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from seeds import seeded

from safeserve.kernels.expert_count import count_experts
from safeserve.kernels.replica_spread import spread_ids
from safeserve.moe.eplb.algorithm import logical_to_physical_map, rebalance_experts
from safeserve.moe.eplb.recorder import ExpertDistributionRecorder
from safeserve.moe.expert_map import ExpertMap
from safeserve.moe.placement import ExpertPlacement


def test_trivial_map_is_the_contiguous_blocks() -> None:
    m = ExpertMap.trivial(4, ep_size=2, num_layers=2)
    assert (m.num_logical, m.num_physical, m.slots_per_rank, m.num_layers) == (4, 4, 2, 2)
    assert m.phy2log == ((0, 1, 2, 3), (0, 1, 2, 3)) and m.is_trivial
    assert [m.rank_of(p) for p in range(4)] == [0, 0, 1, 1]
    assert m.local_slots(1) == range(2, 4) and m.local_logical(1, 1) == (2, 3)
    assert [m.local_slot(p) for p in range(4)] == [0, 1, 0, 1]
    assert m.logical_of(0, 3) == 3 and m.replicas(1, 2) == (2,) and m.replica_count(0, 0) == 1
    for rank in (0, 1):  # every rank sends expert e to slot e
        assert m.send_table(rank).tolist() == [[0, 1, 2, 3]] * 2
    assert m.log2phy_tensor().tolist() == [[[0], [1], [2], [3]]] * 2
    assert m.logcnt_tensor().tolist() == [[1, 1, 1, 1]] * 2
    assert m.phy2log_tensor().shape == (2, 4)


def test_redundant_trivial_map_hand_worked() -> None:
    # 4 experts, 2 redundant slots, 2 ranks of 3 slots: rank 0 holds experts 0 1 2, rank 1
    # holds 3 0 1 (the extra slots go to experts 0, 1, as equal loads replicate them)
    m = ExpertMap.trivial(4, ep_size=2, num_layers=1, redundant=2)
    assert (m.num_physical, m.slots_per_rank, m.num_redundant, m.max_replicas) == (6, 3, 2, 3)
    assert m.phy2log == ((0, 1, 2, 3, 0, 1),) and not m.is_trivial
    assert m.local_logical(0, 0) == (0, 1, 2) and m.local_logical(0, 1) == (3, 0, 1)
    assert m.replicas(0, 0) == (0, 4) and m.replicas(0, 3) == (3,)
    assert m.log2phy_tensor().tolist() == [[[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]]]
    assert m.logcnt_tensor().tolist() == [[2, 2, 1, 1]]
    # own rank's replica first; experts a rank does not hold go to their one replica
    assert m.send_table(0).tolist() == [[0, 1, 2, 3]]
    assert m.send_table(1).tolist() == [[4, 5, 2, 3]]
    # the same format as the EPLB algorithm's
    assert torch.equal(m.log2phy_tensor(), logical_to_physical_map(m.phy2log_tensor(), 4))


def test_from_phy2log_matches_rebalance_experts() -> None:
    gen = seeded(0)
    weight = torch.randint(0, 100, (3, 8), generator=gen).float()
    phy2log, log2phy, logcnt = rebalance_experts(weight, 12, 1, 1, 4)
    m = ExpertMap.from_phy2log(phy2log, num_logical=8, ep_size=4)
    assert (m.num_physical, m.slots_per_rank, m.num_layers) == (12, 3, 3)
    assert torch.equal(m.phy2log_tensor(), phy2log)
    assert torch.equal(m.log2phy_tensor(), log2phy)
    assert torch.equal(m.logcnt_tensor(), logcnt)
    assert ExpertMap.from_phy2log(phy2log.tolist(), 8, 4) == m  # nested lists alike


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ExpertMap.trivial(3, ep_size=2), "3 physical experts cannot be split evenly"),
        (lambda: ExpertMap.from_phy2log([[0, 0, 1, 1]], 3, 2), "expert 2 has no physical replica"),
        (lambda: ExpertMap.from_phy2log([[0, 1, 5, 2]], 4, 2), "slot 2 holds expert 5"),
        (lambda: ExpertMap(4, 4, 2, ((0, 1, 2, 3), (0, 1, 2))), "layer 1: 3 physical slots"),
        (lambda: ExpertMap.from_phy2log([[0, 1]], 3, 1), "2 physical slots cannot hold 3"),
        (lambda: ExpertMap.from_phy2log([], 3, 1), "no layers"),
        (lambda: ExpertMap.trivial(4, redundant=-1), "redundant experts must be >= 0"),
        (lambda: ExpertMap.trivial(4, ep_size=2).local_slots(2), "EP rank 2 not in [0, 2)"),
    ],
)
def test_invalid_maps_raise_one_line(build, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")) as e:
        build()
    assert "\n" not in str(e.value)


def _random_map(seed: int, num_logical: int, ep_size: int, slots: int, layers: int) -> ExpertMap:
    rng = random.Random(seed)
    num_physical = ep_size * slots
    rows = []
    for _ in range(layers):
        row = list(range(num_logical)) + [
            rng.randrange(num_logical) for _ in range(num_physical - num_logical)
        ]
        rng.shuffle(row)
        rows.append(row)
    return ExpertMap.from_phy2log(rows, num_logical, ep_size, seed=seed)


@pytest.mark.parametrize("seed", range(20))
def test_send_to_own_rank_first_then_a_fair_spread(seed: int) -> None:
    m = _random_map(seed, num_logical=6, ep_size=8, slots=2, layers=3)  # 10 redundant slots
    tables = [m.send_rows(r) for r in range(m.ep_size)]
    for layer in range(m.num_layers):
        for e in range(m.num_logical):
            reps = m.replicas(layer, e)
            holders = {m.rank_of(p) for p in reps}
            spread: Counter[int] = Counter()
            for r in range(m.ep_size):
                p = tables[r][layer][e]
                assert m.logical_of(layer, p) == e  # always a replica of the expert chosen
                if r in holders:  # the first replica on the own rank
                    assert p == min(q for q in reps if m.rank_of(q) == r)
                else:
                    spread[p] += 1
            # the ranks holding none: every replica within 1 of an equal share
            n = m.ep_size - len(holders)
            for p in reps:
                assert n // len(reps) <= spread[p] <= -(-n // len(reps))
            assert m.send_to(layer, e, 3) == tables[3][layer][e]


def test_the_shared_send_table_picks_one_replica_per_expert() -> None:
    """Tokens on every rank (tensor-parallel attention): one table for all, the seeded pick."""
    m = _random_map(4, num_logical=6, ep_size=4, slots=3, layers=2)
    shared = m.send_rows(None)
    for layer in range(m.num_layers):
        for e in range(m.num_logical):
            assert shared[layer][e] in m.replicas(layer, e)
    assert m.send_table(None).tolist() == [list(r) for r in shared]
    trivial = ExpertMap.trivial(4, ep_size=2, num_layers=1)
    assert trivial.send_rows(None) == ((0, 1, 2, 3),)
    picks = Counter(  # over many seeds, a two-replica expert's pick is either replica
        ExpertMap.from_phy2log([[0, 1, 0, 2]], 3, 2, seed=s).send_to(0, 0, None) for s in range(40)
    )
    assert set(picks) == {0, 2}


def test_send_spread_is_deterministic_per_seed() -> None:
    rows = [[0, 1, 2, 3, 0, 0, 1, 1]]  # experts 0 and 1 on 3 slots each; 8 ranks of 1 slot
    a = ExpertMap.from_phy2log(rows, 4, 8, seed=1)
    b = ExpertMap.from_phy2log(rows, 4, 8, seed=1)
    assert [a.send_rows(r) for r in range(8)] == [b.send_rows(r) for r in range(8)]
    tables = {
        tuple(ExpertMap.from_phy2log(rows, 4, 8, seed=s).send_rows(r) for r in range(8))
        for s in range(10)
    }
    assert len(tables) > 1  # the seed moves the spread


def test_placement_is_a_rank_view_of_the_map() -> None:
    p = ExpertPlacement(8, 2, 1)  # the old constructor: the trivial map
    assert (p.experts_per_rank, p.local_start, p.local_experts) == (4, 4, range(4, 8))
    assert p.rank_of(5) == 1 and p.rank_of(torch.tensor([0, 7])).tolist() == [0, 1]
    ids = torch.tensor([[-1, 3], [4, 7]])
    assert p.to_local_ids(ids).tolist() == [[-1, -1], [0, 3]]
    assert p.local_slot(torch.tensor([4, 6])).tolist() == [0, 2]
    assert p.map_for(8, 3) == ExpertMap.trivial(8, 2, 3)
    m = ExpertMap.trivial(4, 2, 2, redundant=2)
    q = ExpertPlacement.of(m, 1)
    assert (q.num_physical_experts, q.experts_per_rank, q.local_experts) == (6, 3, range(3, 6))
    assert q.map_for(4, 2) is m
    with pytest.raises(ValueError, match="does not fit"):
        q.map_for(4, 3)
    with pytest.raises(ValueError, match="cannot place"):
        ExpertPlacement(6, 2, 0).map_for(4, 1)
    with pytest.raises(ValueError, match="is not a placement"):
        ExpertPlacement(8, 2, 0, m)


def test_recorder_for_a_map_counts_its_ranks_blocks() -> None:
    m = ExpertMap.trivial(4, ep_size=2, num_layers=1, redundant=2)
    rec = ExpertDistributionRecorder.for_map(m)
    assert (rec.num_layers, rec.num_physical_experts, rec.num_ranks) == (1, 6, 2)
    # rank 1's tokens: slots 4 5 2, counted as its router counts them
    count_experts(m.send_table(1)[0][torch.tensor([0, 1, 2])], rec.pass_row(0))
    rec.end_pass()
    assert rec.dump().tolist() == [[0, 0, 1, 0, 1, 1]]


# -- the readers follow the map ------------------------------------------------------------------


def _permuted(num_experts: int, ep_size: int, layers: int, seed: int) -> ExpertMap:
    gen = seeded(seed)
    rows = [torch.randperm(num_experts, generator=gen).tolist() for _ in range(layers)]
    return ExpertMap.from_phy2log(rows, num_experts, ep_size)


def test_weight_specs_put_each_slots_logical_expert() -> None:
    from safeserve.model.registry import parse_config, weight_specs
    from safeserve.parallel.layout import Layout

    cfg = parse_config(
        dict(
            model_type="qwen3_moe",
            vocab_size=10,
            hidden_size=8,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=4,
            mlp_only_layers=[1],
        )
    )
    layout = Layout(1, 2, 2)
    trivial = weight_specs(cfg, layout)
    assert trivial["layers.2.mlp.experts.w13"].piece.experts == (2, 3)
    m = ExpertMap.from_phy2log([[3, 1, 0, 2], [1, 2, 3, 0]], 4, 2)  # rows: MoE layers 0 and 2
    specs = weight_specs(cfg, layout, m)
    assert specs["layers.0.mlp.experts.w13"].piece.experts == (0, 2)
    assert specs["layers.2.mlp.experts.w2"].piece.experts == (3, 0)
    assert "layers.1.mlp.experts.w13" not in specs
    full = torch.arange(4 * 8 * 8, dtype=torch.float32).view(4, 8, 8)
    piece = specs["layers.2.mlp.experts.w13"].piece
    assert torch.equal(piece.apply(full), full[[3, 0]])  # both ranks' halves of width 4 are 8


def _logits(ckpt: Path, placement: ExpertPlacement) -> torch.Tensor:
    from model_checks import TABLE, paged_logits

    from safeserve.model.loader import build_model
    from safeserve.moe.dispatch import LocalDispatcher

    net = build_model(str(ckpt), "auto", "float32", "cpu", LocalDispatcher(placement))
    ids = torch.randint(0, net.config.vocab_size, (12,), generator=seeded(2))
    return paged_logits(net, ids.tolist(), [7, 1, 1, 1, 1, 1], block_size=4, table=TABLE)


def test_a_permuted_or_redundant_map_gives_the_trivial_maps_logits(checkpoint: Path) -> None:
    """One rank: slots holding experts in shuffled order, or extra replicas, load those
    experts' weights and the routers send each token to them: the same logits."""
    want = _logits(checkpoint, ExpertPlacement(8))
    permuted = _permuted(8, 1, 2, seed=3)
    assert not permuted.is_trivial
    got = _logits(checkpoint, ExpertPlacement.of(permuted, 0))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    redundant = ExpertMap.from_phy2log([[5, 0, 1, 2, 3, 4, 5, 6, 7, 1]] * 2, 8, 1)
    got = _logits(checkpoint, ExpertPlacement.of(redundant, 0))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


class _FakeCheckpoint:
    """Tensors by name, read as `_Checkpoint` reads them."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get_slice(self, name: str, piece) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return piece.apply(self.tensors[name])


@pytest.mark.parametrize("experts", [(1, 2), (3, 0), (2, 2)])  # a block, shuffled, replicas
@pytest.mark.parametrize("is_w13", [True, False])
def test_loader_reads_each_slots_expert_fused_or_per_expert(experts, is_w13: bool) -> None:  # type: ignore[no-untyped-def]
    from safeserve.model.loader import _load_experts
    from safeserve.model.spec import ExpertSlice, ExpertSource

    e, w, h = 4, 6, 5
    full = torch.randn((e, 2 * w, h) if is_w13 else (e, h, w), generator=torch.Generator())
    piece = ExpertSlice(experts, 2, 5, w, is_w13)  # width [2, 5) of 6
    want = piece.apply(full)
    assert torch.equal(want[0], piece.narrow(full[experts[0] : experts[0] + 1])[0])
    names = ("g{e}", "u{e}") if is_w13 else ("d{e}",)
    per_expert: dict[str, torch.Tensor] = {}
    for x in range(e):
        if is_w13:
            per_expert[f"g{x}"], per_expert[f"u{x}"] = full[x, :w], full[x, w:]
        else:
            per_expert[f"d{x}"] = full[x]
    for tensors in ({"fused": full}, per_expert):
        dst = torch.empty_like(want)
        _load_experts(
            _FakeCheckpoint(tensors), dst, ExpertSource("fused", names), piece, full.shape
        )
        assert torch.equal(dst, want)


class _Moe:  # what write_expert_map reads of an MoE layer
    def __init__(self) -> None:
        from safeserve.moe.topk import Router, RouterConfig

        self.gate = Router(8, 4, RouterConfig(2, True))
        self.gate.reset_buffers("cpu")


def test_router_rows_are_written_in_place() -> None:
    """A new map reaches the routers by `copy_` into the buffers they (and captured CUDA graphs)
    read: the same tensors, new values."""
    from safeserve.moe.layer import write_expert_map

    layers = [_Moe(), _Moe()]
    buffers = [m.gate.logical_to_physical for m in layers]
    m = ExpertMap.from_phy2log([[3, 1, 0, 2], [2, 0, 3, 1]], 4, 2)
    write_expert_map(layers, m, 1)  # type: ignore[arg-type]
    assert all(x.gate.logical_to_physical is b for x, b in zip(layers, buffers, strict=True))
    assert torch.equal(torch.stack(buffers), m.send_table(1))
    assert m.send_table(1)[0].tolist() == [2, 1, 3, 0]
    assert all(x.gate.spread is None for x in layers)  # one replica each: no spreading
    with pytest.raises(ValueError, match="2 MoE layers for a model of 1"):
        write_expert_map(layers[:1], m, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows of shape"):
        layers[0].gate.set_expert_map(torch.zeros(5, dtype=torch.int64))
    # with replicas: candidate buffers, allocated once and then copied into
    r = ExpertMap.from_phy2log([[3, 1, 0, 2, 1, 3], [2, 0, 3, 1, 0, 0]], 4, 2)
    write_expert_map(layers, r, 1)  # type: ignore[arg-type]
    spread = [x.gate.spread for x in layers]
    slots, counts = r.candidate_table(1)
    assert torch.equal(torch.stack(spread)[:, 0], slots)
    assert torch.equal(torch.stack([x.gate.spread_count for x in layers])[:, 0], counts)
    r2 = ExpertMap.from_phy2log([[1, 3, 0, 2, 1, 3], [0, 2, 3, 1, 0, 0]], 4, 2)
    write_expert_map(layers, r2, 1)  # type: ignore[arg-type]
    assert all(x.gate.spread is b for x, b in zip(layers, spread, strict=True))
    assert torch.equal(layers[0].gate.spread[0], r2.candidate_table(1)[0][0])


def test_candidates_own_replicas_first_else_every_replica() -> None:
    # 4 experts in 6 slots on 2 ranks: rank 0 holds 0 1 2, rank 1 holds 3 0 3 (slots 3 4 5)
    m = ExpertMap.from_phy2log([[0, 1, 2, 3, 0, 3]], 4, 2, seed=3)
    assert m.candidates(0, 0, 0) == (0,) and m.candidates(0, 0, 1) == (4,)  # own, no transfer
    assert m.candidates(0, 3, 1) == (3, 5)  # both its own, in turn
    assert sorted(m.candidates(0, 3, 0)) == [3, 5]  # none on rank 0: every replica
    assert sorted(m.candidates(0, 0, None)) == [0, 4]
    assert all(m.send_to(0, e, r) == m.candidates(0, e, r)[0] for e in range(4) for r in (0, 1))
    slots, counts = m.candidate_table(0)
    assert slots.shape == (1, 4, 3) and counts[0].tolist() == [1, 1, 1, 2]
    assert slots[0, 3].tolist() == [*m.candidates(0, 3, 0), m.candidates(0, 3, 0)[0]]


@pytest.mark.parametrize("source", [None, 1])
def test_routing_spreads_an_experts_tokens_over_its_candidates(source: int | None) -> None:
    """With replicas, the n-th pair of a source's tokens choosing e goes to candidate
    `n % count` of its source: this rank's (attention data-parallel), or, where every rank
    routes the same tokens (None), the rank whose contiguous share of the tokens t is in (as the
    all-to-all splits them), counting within that share."""
    from safeserve.moe.layer import write_expert_map

    layers = [_Moe()]
    m = ExpertMap.from_phy2log([[0, 1, 2, 3, 0, 3]], 4, 2, seed=3)
    write_expert_map(layers, m, source)  # type: ignore[arg-type]
    gate = layers[0].gate
    assert gate.logical_to_physical.tolist() == [0, 1, 2, 3]  # the kernels map nothing
    gen = seeded(0)
    with torch.no_grad():  # every token picks experts 0 and 3, in that order: 0's logit leads
        gate.weight.copy_(torch.randn(4, 8, generator=gen))  # by 40 (8 columns of 5) against
        gate.weight[0] += 50.0  # the random rows' spread (std about 4 between two rows)
        gate.weight[3] += 45.0
    hidden = torch.ones(5, 8) + 0.01 * torch.randn(5, 8, generator=gen)
    ids = gate(hidden).topk_ids
    shares = [0, 0, 0, 1, 1]  # 5 tokens over 2 ranks: 3 and 2
    for t in range(5):
        rank = source if source is not None else shares[t]
        n = t if source is not None else t - shares.index(shares[t])  # every token picks e
        for j, e in enumerate((0, 3)):
            cands = m.candidates(0, e, rank)
            assert ids[t, j] == cands[n % len(cands)], (t, e)
    assert set(ids[:, 1].tolist()) == {3, 5}  # expert 3's two replicas both work
    with pytest.raises(ValueError, match="give \\[S, E, M\\] rows"):
        gate.set_expert_map(torch.arange(4))


@pytest.mark.parametrize("source", [None, 1])
def test_an_experts_pairs_take_its_candidates_in_turn_whatever_their_token_index(
    source: int | None,
) -> None:
    """Turns are counted per expert, not by token index: the tokens choosing expert 3 at the
    even indices of a batch split over rank 1's two replicas of it (by index, t % 2, they all
    went to the first),
    and every expert's candidates take equal shares of each share's pairs, within one."""
    from safeserve.moe.layer import write_expert_map

    layers = [_Moe()]
    m = ExpertMap.from_phy2log([[0, 1, 2, 3, 3, 0, 1, 3]], 4, 2, seed=1)
    write_expert_map(layers, m, source)  # type: ignore[arg-type]
    gate = layers[0].gate
    gen = seeded(2)
    logical = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(12)])
    logical[::2, 0] = 3  # expert 3 at every even index, and only there: the turns below count
    logical[::2, 1] = torch.where(logical[::2, 1] == 3, 2, logical[::2, 1])  # its pairs alone
    logical[1::2] = torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(6)])
    ids = spread_ids(logical, gate.spread, gate.spread_count)
    shares = [range(12)] if source is not None else [range(6), range(6, 12)]
    for s, rows in enumerate(shares):
        rank = source if source is not None else s
        for e in range(4):
            cands = m.candidates(0, e, rank)
            got = [int(ids[t, j]) for t in rows for j in range(2) if logical[t, j] == e]
            assert got == [cands[n % len(cands)] for n in range(len(got))], (s, e)
            per = [got.count(c) for c in cands]
            assert max(per) - min(per) <= 1
    # rank 1 holds expert 3 twice (slots 4, 7); rank 0 once (slot 3)
    assert set(ids[::2, 0].tolist()) == ({4, 7} if source == 1 else {3, 4, 7})
