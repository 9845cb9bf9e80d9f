"""Every reader of the expert map uses it: on real 2-rank gloo groups, experts shuffled across
the ranks (and with replicas on both ranks) give the trivial map's logits, and transformers'.
With tensor-parallel attention the ranks share one send table (`none` computes every rank's
slots over every token: two ranks choosing different replicas would count a token twice); with
attention data-parallel each rank sends to its own replicas first."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from layouts import CHUNKS, LAYOUTS, layout_reference, layout_server_args

from safeserve.spawn import spawn_ranks

pytestmark = pytest.mark.slow  # starts rank processes

# MoE-layer rows of the default checkpoint (8 experts; layers 0 and 2 are MoE layers)
PERMUTED = [[5, 2, 7, 0, 3, 6, 1, 4], [1, 0, 4, 6, 7, 2, 5, 3]]  # no redundancy, shuffled
# 10 slots, 5 per rank: experts 5 and 1 have a replica on each rank, expert 2 two on rank 1
REDUNDANT = [[5, 0, 4, 1, 7, 2, 3, 5, 6, 1], [1, 6, 0, 3, 2, 7, 5, 2, 4, 1]]


def _rank_main(
    model: str,
    layout: tuple,
    phy2log: list[list[int]] | None,
    rank: int,
    init: str,
    seqs: list[list[int]],
    queue: mp.Queue,
) -> None:
    """One rank of `_run` (spawned by safeserve.spawn, which reports it if it raises)."""
    from safeserve.engine.model_runner import ModelRunner
    from safeserve.engine.plan import SeqPlan, StepPlan
    from safeserve.messages import SamplingParams
    from safeserve.moe.expert_map import ExpertMap

    tp, ep, _, dp = layout
    args = layout_server_args(model, layout, num_kv_blocks=64, block_size=4, device="cpu")
    m = None if phy2log is None else ExpertMap.from_phy2log(phy2log, 8, ep, seed=7)
    runner = ModelRunner(args, rank, init, expert_map=m)
    assert runner.expert_map is not None
    local = runner.expert_map.slots_per_rank
    for layer in runner.model.layers:
        if layer.is_moe:
            assert layer.mlp.experts.w13.shape[0] == local
    dp_size = tp if dp else 1
    tables = {
        i: list(range(16 * (i // dp_size), 16 * (i // dp_size) + 16)) for i in range(len(seqs))
    }
    pos, step = 0, 0
    for n in CHUNKS:
        per_rank: list[list[SeqPlan]] = [[] for _ in range(dp_size)]
        owners = []
        for i, ids in enumerate(seqs):
            if pos >= len(ids):
                continue
            piece = ids[pos : pos + n]
            per_rank[i % dp_size].append(
                SeqPlan(piece, pos, tables[i], SamplingParams(temperature=0.0), 0)
            )
            owners.append((i % dp_size, i, pos + len(piece) - 1))
        step += 1
        logits, _ = runner.run_plan(StepPlan(step, per_rank))
        if logits is not None:
            mine = [(i, p) for r, i, p in owners if r == (rank if dp else 0)]
            for (i, p), row in zip(mine, logits, strict=True):
                queue.put((i, p, row.float().cpu().tolist()))
        pos += n
    queue.put(("done", rank, None))
    runner.comm.shutdown()


def _run(model: Path, name: str, phy2log: list[list[int]] | None, seqs: list[list[int]]) -> dict:
    layout = LAYOUTS[name]
    out, done = {}, 0
    with spawn_ranks(
        layout[0],
        _rank_main,
        lambda r, init, q: (str(model), layout, phy2log, r, init, seqs, q),
    ) as ranks:
        while done < layout[0]:
            a, b, c = ranks.get(timeout=180)
            if a == "done":
                done += 1
                continue
            out[(a, b)] = torch.tensor(c)
    return out


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    return layout_reference(checkpoint)


def test_shuffled_experts_give_the_trivial_maps_logits(checkpoint: Path, reference) -> None:
    seqs, _ = reference
    want = _run(checkpoint, "tp2-ep2-alltoall", None, seqs)
    got = _run(checkpoint, "tp2-ep2-alltoall", PERMUTED, seqs)
    assert set(got) == set(want) and got
    for key, row in got.items():
        torch.testing.assert_close(
            row, want[key], atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}"
        )


@pytest.mark.parametrize(
    ("name", "phy2log"),
    [("tp2-ep2-none", PERMUTED), ("tp2-ep2-none", REDUNDANT), ("tp2-ep2-alltoall-dp", REDUNDANT)],
)
def test_placed_experts_match_transformers(
    checkpoint: Path, reference, name: str, phy2log: list[list[int]]
) -> None:
    seqs, ref = reference
    got = _run(checkpoint, name, phy2log, seqs)
    assert got
    for (i, pos), row in got.items():
        torch.testing.assert_close(
            row, ref[i][pos], atol=1e-4, rtol=0, msg=lambda m, i=i, pos=pos: f"{i}@{pos}: {m}"
        )
