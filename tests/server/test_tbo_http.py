"""Two-batch overlap through the HTTP API, in every layout that takes it, token for token
against transformers (what the same layouts serve without it: test_layouts_http.py): chunked
prefill of 8 tokens cuts the prompts so that the split rule cuts sequences across the
micro-batches, a receive budget of 4 rows makes every micro-batch's dispatch run in admission
rounds (2 rows each), and decode steps split too (`--tbo-min-decode-batch 1`)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from layouts import layout_args
from serving import LAYOUT_PROMPTS, concurrent_completions, hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

TBO_LAYOUTS = ["tp2-ep2-alltoall", "tp2-ep2-alltoall-dp", "tp2-ep1-none-dp", "tp4-ep4-alltoall-dp"]
TBO_ARGS = [
    "--enable-two-batch-overlap",
    "--tbo-min-decode-batch",
    "1",
    "--dispatch-budget-tokens",
    "4",
    "--chunked-prefill-size",
    "8",
]


@pytest.fixture(scope="module")
def hf(checkpoint: Path):
    return AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32
    ).eval(), AutoTokenizer.from_pretrained(checkpoint)


@pytest.mark.parametrize("name", TBO_LAYOUTS)
def test_overlap_serves_transformers_greedy(
    server_factory, checkpoint: Path, hf, name: str
) -> None:
    s = server_factory(["--model", str(checkpoint), *TBO_ARGS, *layout_args(name)])
    model, tok = hf
    results = concurrent_completions(s, str(checkpoint), LAYOUT_PROMPTS, 24)
    for p, res in zip(LAYOUT_PROMPTS, results, strict=True):
        ref = hf_greedy(model, tok, tok(p)["input_ids"], 24)
        assert res.choices[0].model_extra["token_ids"] == ref, p
    # the steps really ran split, a sequence cut across the halves among them (8-token chunks
    # of prompts of other lengths), and the operator sees the rule that decided it
    assert _labelled(s, "split_cut") > 0
    assert _labelled(s, "split") + _labelled(s, "split_cut") > 0
    overlap = httpx.get(s.admin_url + "/admin/config").json()["overlap"]
    assert overlap["enable_two_batch_overlap"] is True
    assert overlap["tbo_min_decode_batch"] == 1


def _labelled(s, decision: str) -> float:  # type: ignore[no-untyped-def]
    """safeserve:tbo_steps_total summed over the groups, for one decision."""
    total = 0.0
    for line in httpx.get(s.url + "/metrics").text.splitlines():
        if line.startswith("safeserve:tbo_steps_total{") and f'decision="{decision}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
