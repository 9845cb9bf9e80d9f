"""Logits of every parallel layout against transformers, on real gloo process groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from layouts import LAYOUTS, run_layout
from serving import free_port
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    # Three sequences of different lengths: with 4 attention ranks one rank has none.
    seqs = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (14, 9, 20)]
    with torch.no_grad():
        ref = {i: hf(torch.tensor([s])).logits[0] for i, s in enumerate(seqs)}
    return seqs, ref


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_logits_match_transformers(checkpoint: Path, reference, name: str) -> None:
    seqs, ref = reference
    chunks = [5, 6, 1, 1, 3, 1, 1, 1, 1]  # chunked prefill, then decode steps
    got = run_layout(checkpoint, name, seqs, chunks, free_port())
    expected_rows = sum(
        len(
            {
                min(sum(chunks[: k + 1]), len(s)) - 1
                for k in range(len(chunks))
                if sum(chunks[:k]) < len(s)
            }
        )
        for s in seqs
    )
    assert len(got) == expected_rows
    for (i, pos), row in got.items():
        torch.testing.assert_close(
            row,
            ref[i][pos],
            atol=1e-4,
            rtol=0,
            msg=lambda m, i=i, pos=pos: f"seq {i} pos {pos}: {m}",
        )


def test_alltoall_graph_steps_dispatch_as_none_with_the_same_result() -> None:
    """A step a CUDA graph captures cannot read the all-to-all's split sizes on the host: the
    alltoall backend dispatches it as `none` does (no host sync, fixed shapes; with attention
    data-parallel every rank's rows padded to one bucket, the padding's routing dropped). On a
    real 2-rank gloo group both ways give every rank its correct rows and the same expert
    loads (balancedness), with tensor-parallel and data-parallel attention."""
    from layouts import run_alltoall_both_ways

    for _rank, results, _ in run_alltoall_both_ways(2, free_port()):
        for layout in ("tp", "dp"):
            want = torch.tensor(results[layout])
            (eager, m_eager, b_eager), (graph, m_graph, b_graph) = (
                results[(layout, False)],
                results[(layout, True)],
            )
            torch.testing.assert_close(torch.tensor(eager), want, msg=f"{layout} eager")
            torch.testing.assert_close(torch.tensor(graph), want, msg=f"{layout} graph")
            # padding rows (dp) count in no load: the same balancedness both ways
            assert b_graph == pytest.approx(b_eager) and 0 < b_eager <= 1
            # alltoall counts rows per (source, destination); `none` sends every token to
            # every rank: one row per source, its (padded) token count for each rank
            assert len(m_eager) == 2
            assert m_graph == ([[7, 7]] if layout == "tp" else [[6, 6], [6, 6]])
