"""DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing with correction biases,
shared experts) in every parallel layout against transformers, on real gloo process groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints_deepseek_v3 import write_deepseek_v3_checkpoint
from layouts import LAYOUTS, run_layout
from serving import free_port
from transformers import AutoModelForCausalLM

CHUNKS = [5, 6, 1, 1, 3, 1, 1, 1, 1]  # chunked prefill, then decode steps


@pytest.fixture(scope="module")
def ds_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_deepseek_v3_checkpoint(tmp_path_factory.mktemp("dsv3"), seed=0)


@pytest.fixture(scope="module")
def reference(ds_checkpoint: Path):
    hf = AutoModelForCausalLM.from_pretrained(ds_checkpoint, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    # Three sequences of different lengths: with 4 attention ranks one rank has none.
    seqs = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (14, 9, 20)]
    with torch.no_grad():
        ref = {i: hf(torch.tensor([s])).logits[0] for i, s in enumerate(seqs)}
    return seqs, ref


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_logits_match_transformers(ds_checkpoint: Path, reference, name: str) -> None:
    seqs, ref = reference
    got = run_layout(ds_checkpoint, name, seqs, CHUNKS, free_port())
    starts = [sum(CHUNKS[:k]) for k in range(len(CHUNKS))]
    expected = {
        (i, min(start + n, len(s)) - 1)
        for i, s in enumerate(seqs)
        for start, n in zip(starts, CHUNKS, strict=True)
        if start < len(s)
    }
    assert set(got) == expected
    for (i, pos), row in got.items():
        torch.testing.assert_close(
            row,
            ref[i][pos],
            atol=1e-4,
            rtol=0,
            msg=lambda m, i=i, pos=pos: f"{name}: seq {i} pos {pos}: {m}",
        )
