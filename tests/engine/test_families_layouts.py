"""Mixtral and Qwen2-MoE in every parallel layout against transformers, on real gloo process
groups: every layout's logits (chunked prefill, then decode) within 1e-4 of transformers'.

One set of four spawned processes runs every (family, layout) group in turn, each with its own
rendezvous (`layouts.run_layouts`; the ranks beyond a layout's size wait it out): spawning and
importing torch once instead of for every group is most of this file's time on a small host.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints_families import write_mixtral_checkpoint, write_qwen2_moe_checkpoint
from layouts import LAYOUTS, assert_rows_match, run_layouts
from seeds import seeded
from transformers import AutoModelForCausalLM

FAMILIES = {"mixtral": write_mixtral_checkpoint, "qwen2_moe": write_qwen2_moe_checkpoint}
CHUNKS = [5, 6, 1, 1, 3, 1, 1, 1, 1]  # chunked prefill, then decode steps


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory):
    """{(family, layout): ({(seq, position): logits row}, splits, error or None)}, the
    sequences and transformers' logits by family."""
    gen = seeded(5)
    # Three sequences of different lengths: with 4 attention ranks one rank has none.
    seqs = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (14, 9, 20)]
    ckpts, ref = {}, {}
    for family, write in FAMILIES.items():
        ckpts[family] = write(tmp_path_factory.mktemp(family), seed=2)
        hf = AutoModelForCausalLM.from_pretrained(ckpts[family], dtype=torch.float32).eval()
        with torch.no_grad():
            ref[family] = {i: hf(torch.tensor([s])).logits[0] for i, s in enumerate(seqs)}
    groups = {(f, name): (ckpts[f], name, None) for f in FAMILIES for name in sorted(LAYOUTS)}
    return run_layouts(groups, seqs, CHUNKS, timeout=180), seqs, ref


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layout_logits_match_transformers(results, family: str, name: str) -> None:
    out, seqs, ref = results
    got, _, error = out[(family, name)]
    assert error is None, error
    assert_rows_match(got, seqs, ref[family], CHUNKS, name)
