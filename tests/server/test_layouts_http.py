"""Every parallel layout through the HTTP API, token for token against transformers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from layouts import LAYOUTS, layout_args
from serving import (
    KV_PRESSURE,
    LAYOUT_PROMPTS,
    concurrent_completions,
    hf_greedy,
    preempts_and_loses_nothing,
    rank_processes,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = LAYOUT_PROMPTS


@pytest.fixture(scope="module")
def hf(checkpoint: Path):
    return AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32
    ).eval(), AutoTokenizer.from_pretrained(checkpoint)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_serves_transformers_greedy(server_factory, checkpoint: Path, hf, name: str) -> None:
    # With 2 attention ranks and dp attention, one request leaves a rank idle for the whole run.
    prompts = PROMPTS[:1] if name == "tp2-ep2-alltoall-dp" else PROMPTS
    s = server_factory(
        ["--model", str(checkpoint), "--chunked-prefill-size", "8", *layout_args(name)]
    )
    model, tok = hf
    results = concurrent_completions(s, str(checkpoint), prompts, 24)
    for p, res in zip(prompts, results, strict=True):
        ref = hf_greedy(model, tok, tok(p)["input_ids"], 24)
        assert res.choices[0].model_extra["token_ids"] == ref, p


def test_alltoall_adjusts_ep_with_one_info_line(server_factory, checkpoint: Path) -> None:
    s = server_factory(
        [
            "--model",
            str(checkpoint),
            "--moe-a2a-backend",
            "alltoall",
            "--tp-size",
            "2",
            "--ep-size",
            "1",
        ]
    )
    lines = [ln for ln in s.output().splitlines() if "expert parallel size is adjusted" in ln]
    assert len(lines) == 1 and " INFO " in lines[0] and "ep_size 1 -> 2" in lines[0]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tp-size", "2", "--ep-size", "3"], "--ep-size 3 cannot exceed --tp-size 2"),
        (["--tp-size", "4", "--ep-size", "3"], "--ep-size 3 must divide --tp-size 4"),
        (["--enable-dp-attention"], "--enable-dp-attention needs --tp-size of at least 2"),
        (["--tp-size", "3", "--ep-size", "3"], "--tp-size 3 must divide num_attention_heads 4"),
        (
            ["--tp-size", "3", "--ep-size", "3", "--enable-dp-attention"],
            "must divide the number of experts 8",
        ),
        (["--tp-size", "3", "--ep-size", "1", "--enable-dp-attention"], "moe_intermediate_size"),
        (["--moe-a2a-backend", "deepep"], "deepep is not available yet"),
    ],
)
def test_invalid_layout_exits_before_spawning(
    checkpoint: Path, args: list[str], message: str
) -> None:
    import subprocess
    import sys

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "safeserve.cli",
            "serve",
            "--model",
            str(checkpoint),
            "--port",
            "0",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    children: set[int] = set()
    while proc.poll() is None:  # watch for any child process while it runs
        try:
            children |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    error_lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(error_lines) == 1 and message in error_lines[0], err
    assert not children


def test_ctrl_c_leaves_no_process_behind(server_factory, checkpoint: Path) -> None:
    s = server_factory(["--model", str(checkpoint), *layout_args("tp2-ep2-alltoall")])
    ranks = psutil.Process(s.proc.pid).children(recursive=True)
    titles = sorted(" ".join(r.cmdline()).strip() for r in rank_processes(s.proc.pid))
    assert titles == ["safeserve: group 0 rank 0", "safeserve: group 0 rank 1"]
    os.killpg(s.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    s.proc.wait(timeout=20)
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, alive


@pytest.mark.parametrize("name", ["tp2-ep2-none", "tp2-ep1-none-dp"])
def test_preempting_group_answers_as_alone(server_factory, name: str) -> None:
    """A two-rank group whose KV cache is too small for its concurrent requests: requests are
    preempted and come back under new table ids, finished ones retire theirs, and the other
    rank rebuilds every block table from the leader's differences (engine/plan.py,
    TableSender): each request ends with the tokens it gets when it runs alone."""
    preempts_and_loses_nothing(server_factory([*KV_PRESSURE, *layout_args(name)]))
