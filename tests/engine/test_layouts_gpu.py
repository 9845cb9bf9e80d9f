"""The multi-rank layouts on CUDA with NCCL, against transformers on the CPU (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from layouts import LAYOUTS, run_layout
from seeds import seeded
from serving import free_port
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.gpu

TWO_GPU_LAYOUTS = sorted(n for n, (tp, *_) in LAYOUTS.items() if tp == 2)


@pytest.mark.parametrize("name", TWO_GPU_LAYOUTS)
def test_layout_logits_on_gpus(checkpoint: Path, name: str) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    gen = seeded(9)
    seqs = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (11, 6, 15)]
    with torch.no_grad():
        ref = {i: hf(torch.tensor([s])).logits[0] for i, s in enumerate(seqs)}
    replays: dict = {}
    chunks = [4, 5, 1, 1, 1, 3, 1]  # the one-token steps are decode steps
    got = run_layout(checkpoint, name, seqs, chunks, free_port(), device="cuda", replays=replays)
    assert got
    # Every layout runs its steps through CUDA graphs on every rank (NCCL inside the graph; the
    # alltoall backend dispatches there as `none` does): the decode steps at positions 9, 10
    # and 11 as decode graphs, the chunks of 4, 5 and 3 as piecewise graphs (the last, empty
    # step eagerly). With DP attention rank 1's sequence ends after the second chunk: it
    # replays the same graphs as rank 0 from then on, all padding.
    assert replays == {0: (3, 3), 1: (3, 3)}
    for (i, pos), row in got.items():
        torch.testing.assert_close(row, ref[i][pos], atol=1e-4, rtol=0)
