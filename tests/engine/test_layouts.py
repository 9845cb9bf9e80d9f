"""Logits of every parallel layout against transformers, on real gloo process groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from layouts import LAYOUTS, assert_layout_matches, layout_reference
from serving import free_port


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    return layout_reference(checkpoint)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_logits_match_transformers(checkpoint: Path, reference, name: str) -> None:
    assert_layout_matches(checkpoint, name, reference, free_port())


def test_alltoall_graph_steps_dispatch_as_none_with_the_same_result() -> None:
    """A step a CUDA graph captures cannot read the all-to-all's split sizes on the host: the
    alltoall backend dispatches it as `none` does (no host sync, fixed shapes; with attention
    data-parallel every rank's rows padded to one bucket, the padding's routing dropped). On a
    real 2-rank gloo group both ways give every rank its correct rows and the same expert
    loads (balancedness), with tensor-parallel and data-parallel attention."""
    from layouts import run_alltoall_both_ways

    for results in run_alltoall_both_ways(2, free_port()):
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
