"""Two-batch and single-batch overlap against transformers, on real gloo process groups.

Every layout that takes two-batch overlap (alltoall with either attention, `none` with
attention data-parallel), in three families (Qwen3-MoE; Qwen2-MoE and DeepSeek-V3, whose
shared experts single-batch overlap runs while the combine moves), with a receive budget of 4
rows so that each micro-batch's dispatch runs in admission rounds (2 rows each): the logits of
every chunk's last row within 1e-4 of transformers', as without overlap. The chunks cut the
prefill step in a way the split rule cuts one sequence across the micro-batches, and the decode
steps split at half the batch (`--tbo-min-decode-batch 1`); each rank reports how many steps
it ran split, so the test knows the overlap really ran.

One set of four spawned processes runs every (family, layout) group in turn
(`test_families_layouts.py` does the same without overlap).
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import write_qwen3_moe_checkpoint
from checkpoints_deepseek_v3 import write_deepseek_v3_checkpoint
from checkpoints_families import write_qwen2_moe_checkpoint
from layouts import LAYOUTS, assert_rows_match, run_layouts
from seeds import seeded
from transformers import AutoModelForCausalLM

from safeserve.engine.overlap import decide_split

FAMILIES = {
    "qwen3_moe": write_qwen3_moe_checkpoint,
    "qwen2_moe": write_qwen2_moe_checkpoint,
    "deepseek_v3": write_deepseek_v3_checkpoint,
}
SHARED_EXPERTS = {"qwen2_moe", "deepseek_v3"}
# The layouts two-batch overlap serves (with tensor-parallel attention, backend `none` computes
# every token on every rank: nothing to overlap, refused at start).
TBO_LAYOUTS = ["tp2-ep2-alltoall", "tp2-ep2-alltoall-dp", "tp2-ep1-none-dp", "tp4-ep4-alltoall-dp"]
CHUNKS = [5, 6, 1, 1, 3, 1, 1, 1, 1]  # chunked prefill, then decode steps


# Single-batch overlap alone (no split steps): the shared experts run while every step's last
# combine moves.
SBO_ONLY = ("deepseek_v3", "tp2-ep2-alltoall-dp")


def _server_kw(family: str, sbo_only: bool = False) -> dict:
    return {
        "enable_two_batch_overlap": not sbo_only,
        "tbo_min_decode_batch": 1,
        "dispatch_budget_tokens": 4,
        "enable_single_batch_overlap": family in SHARED_EXPERTS,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory):
    """{(family, layout): ({(seq, position): logits row}, {rank: split steps}, error)}, the
    sequences and transformers' logits by family."""
    gen = seeded(5)
    seqs = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (14, 9, 20)]
    ckpts, ref = {}, {}
    for family, write in FAMILIES.items():
        ckpts[family] = write(tmp_path_factory.mktemp(family), seed=2)
        hf = AutoModelForCausalLM.from_pretrained(ckpts[family], dtype=torch.float32).eval()
        with torch.no_grad():
            ref[family] = {i: hf(torch.tensor([s])).logits[0] for i, s in enumerate(seqs)}
    groups: dict[tuple, tuple] = {
        (f, name): (ckpts[f], name, _server_kw(f)) for f in FAMILIES for name in TBO_LAYOUTS
    }
    family, name = SBO_ONLY
    groups[(*SBO_ONLY, "sbo-only")] = (ckpts[family], name, _server_kw(family, sbo_only=True))
    return run_layouts(groups, seqs, CHUNKS), seqs, ref


def _expected_splits(layout: tuple, seqs: list[list[int]]) -> int:
    """The steps the split rule runs as two micro-batches for these chunks and this layout."""
    tp, _, _, dp = layout
    ranks = tp if dp else 1
    pos, count = 0, 0
    for n in CHUNKS:
        per_rank: list[list[int]] = [[] for _ in range(ranks)]
        for i, ids in enumerate(seqs):
            if pos < len(ids):
                per_rank[i % ranks].append(len(ids[pos : pos + n]))
        count += decide_split(per_rank, 0.48, 1)[0] is not None
        pos += n
    return count


@pytest.mark.parametrize("name", TBO_LAYOUTS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_overlap_logits_match_transformers(results, family: str, name: str) -> None:
    out, seqs, ref = results
    got, splits, error = out[(family, name)]
    assert error is None, error
    # the overlap ran: every rank ran the same split steps, and at least the prefill step
    tp = LAYOUTS[name][0]
    expected = _expected_splits(LAYOUTS[name], seqs)
    assert expected >= 1
    assert splits == {r: expected for r in range(tp)}
    assert_rows_match(got, seqs, ref[family], CHUNKS, name)


def test_single_batch_overlap_alone_matches_transformers(results) -> None:
    out, seqs, ref = results
    got, splits, error = out[(*SBO_ONLY, "sbo-only")]
    assert error is None, error
    assert splits == {0: 0, 1: 0}  # no step ran split
    assert_rows_match(got, seqs, ref[SBO_ONLY[0]], CHUNKS, "sbo-only")
