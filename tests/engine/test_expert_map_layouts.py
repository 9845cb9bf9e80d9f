"""Every reader of the expert map uses it: on real 2-rank gloo groups, experts shuffled across
the ranks (and with replicas on both ranks) give the trivial map's logits, and transformers'.
With tensor-parallel attention the ranks share one send table (`none` computes every rank's
slots over every token: two ranks choosing different replicas would count a token twice); with
attention data-parallel each rank sends to its own replicas first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from layouts import CHUNKS, layout_reference, run_layout
from serving import free_port

# MoE-layer rows of the default checkpoint (8 experts; layers 0 and 2 are MoE layers)
PERMUTED = [[5, 2, 7, 0, 3, 6, 1, 4], [1, 0, 4, 6, 7, 2, 5, 3]]  # no redundancy, shuffled
# 10 slots, 5 per rank: experts 5 and 1 have a replica on each rank, expert 2 two on rank 1
REDUNDANT = [[5, 0, 4, 1, 7, 2, 3, 5, 6, 1], [1, 6, 0, 3, 2, 7, 5, 2, 4, 1]]


def _run(model: Path, name: str, phy2log: list[list[int]] | None, seqs: list[list[int]]) -> dict:
    return run_layout(model, name, seqs, CHUNKS, free_port(), phy2log=phy2log)


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
