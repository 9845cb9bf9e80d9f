"""Every new family through the server's fault paths: two groups of two ranks (`alltoall`) with
a dispatch budget of 4 rows (prefill sizing then chunks every prompt so that no rank receives
more in a round); a rank of a group holding streams SIGKILLed while greedy streams run. Every
request ends with exactly transformers' argmax tokens (float32), nothing lost or repeated, and
the group comes back. DeepSeek-V3 with two-batch and single-batch overlap: the killed group was
running split steps."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import torch
from checkpoints_deepseek_v3 import write_deepseek_v3_checkpoint
from checkpoints_families import write_mixtral_checkpoint, write_qwen2_moe_checkpoint
from serving import (
    admin_groups,
    greedy_streams_under_fault,
    metric,
    start_server,
    stop_server,
    two_groups,
)
from transformers import AutoModelForCausalLM

WRITERS = {
    "mixtral": write_mixtral_checkpoint,
    "qwen2_moe": write_qwen2_moe_checkpoint,
    "deepseek_v3": write_deepseek_v3_checkpoint,
}
N, TOKENS = 8, 24


def _greedy(hf, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' argmax continuation, EOS included (the server runs with ignore_eos)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(TOKENS):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-TOKENS:]


def _prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 250 + 3 for j in range(5 + i)]


# Two-batch overlap (every step the rule allows split, decode batches too) with single-batch
# overlap: DeepSeek-V3's shared experts run while its combine moves.
OVERLAP = [
    "--enable-two-batch-overlap",
    "--tbo-min-decode-batch",
    "1",
    "--enable-single-batch-overlap",
]


# DeepSeek-V3 runs once, with overlap: the steps the rule does not split (too few tokens) take
# the plain path, so a run serves both.
@pytest.mark.parametrize(
    "family,overlap",
    [("mixtral", False), ("qwen2_moe", False), ("deepseek_v3", True)],
    ids=["mixtral", "qwen2_moe", "deepseek_v3-overlap"],
)
def test_failover_and_admission_keep_every_token(family: str, overlap: bool, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ckpt = WRITERS[family](tmp_path / "ckpt", seed=8)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ref = [_greedy(hf, _prompt(i)) for i in range(N)]
    args = ["--model", str(ckpt), "--served-model-name", family, "--dtype", "float32"]
    args += two_groups("--dispatch-budget-tokens", "4", "--max-model-len", "256")
    args += OVERLAP if overlap else []
    s = start_server(args, tmp_path / "server.log")
    try:
        pids = {g["id"]: g["ranks"][1]["pid"] for g in admin_groups(s)}
        killed: list[int] = []

        def fault(running: dict[int, int]) -> None:  # a rank of the group most streams run on
            killed.append(max(sorted(running), key=lambda g: running[g]))
            os.kill(pids[killed[0]], signal.SIGKILL)

        results = asyncio.run(
            greedy_streams_under_fault(s.url, family, [_prompt(i) for i in range(N)], TOKENS, fault)
        )
        assert any(r["group"] == killed[0] for r in results)
        for i, r in enumerate(results):
            assert not r["errors"], r["errors"]
            assert r["ids"] == ref[i], i  # nothing lost, nothing repeated, transformers' tokens
        assert metric(s, "safeserve:request_migrations_total") >= 1
        if overlap:  # the groups ran split steps (the surviving one counts its own)
            decisions = httpx.get(s.url + "/metrics").text.splitlines()
            split = [
                float(line.rsplit(" ", 1)[1])
                for line in decisions
                if line.startswith("safeserve:tbo_steps_total{") and 'decision="split' in line
            ]
            assert sum(split) > 0, split
        assert metric(s, "safeserve:requests_lost_total") == 0
        # the ranks' dispatch counters, as their heartbeats report them: rounds ran, none over
        # the budget
        assert metric(s, "safeserve:dispatch_rounds_total") > 0
        peaks = [
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(s.url + "/metrics").text.splitlines()
            if line.startswith("safeserve:dispatch_recv_tokens_peak{")
        ]
        assert peaks and 0 < max(peaks) <= 4, peaks
        deadline = time.monotonic() + 90
        while admin_groups(s)[killed[0]]["state"] != "READY":
            assert time.monotonic() < deadline, admin_groups(s)[killed[0]]
            time.sleep(0.2)
    finally:
        stop_server(s.proc)
