"""`safeserve plan` against real servers on CPU ranks: what it predicts a rank allocates (KV
blocks, dispatch budget and buffers, prefill chunk) is what `serve` allocates with the same flags,
and the preset it writes (`--write-policy`) serves with the same values."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from plan_cli import plan
from serving import admin_groups, wait_all_ready

pytestmark = pytest.mark.slow

SIZING = ["--kv-cache-memory-gb", "0.004", "--dispatch-memory-gb", "0.0005"]
WORK = ["--concurrency", "2,6", "--input-len", "20", "--output-len", "10"]


def plan_json(*args: str) -> dict:
    r = plan(*args, "-o", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def layout(result: dict, name: str) -> dict:
    return next(lp for lp in result["layouts"] if lp["name"] == name)


def kv_blocks_of(s) -> list[int]:  # type: ignore[no-untyped-def]
    """Each group's KV blocks (over its attention ranks), once every group has reported."""
    deadline = time.monotonic() + 30
    while True:
        blocks = [g["kv_blocks_total"] for g in admin_groups(s)]
        if all(blocks) or time.monotonic() > deadline:
            return blocks
        time.sleep(0.2)


def test_a_rank_allocates_what_the_plan_predicts(server_factory) -> None:
    extra = ["--max-running-requests", "7", "--max-num-batched-tokens", "256"]
    result = plan_json(
        "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", *WORK, *SIZING, *extra
    )
    want = layout(result, "1x EP2 DP-attn")
    s = server_factory(["--model", "tiny", *want["flags"].split(), *SIZING, *extra], timeout=180)
    sizing = want["sizing"]
    assert kv_blocks_of(s) == [sizing["kv_blocks"] * want["attention_groups"]]
    guards = httpx.get(s.admin_url + "/admin/config", timeout=10).json()["guards"]["0"]
    assert guards["dispatch_budget_tokens"] == sizing["dispatch_budget"]
    assert guards["dispatch_buffer_bytes"] == sizing["dispatch_buffer_bytes"]
    # /admin/config's row: the buffers' bytes per row of the budget
    assert (
        guards["bytes_per_recv_row"] * sizing["dispatch_budget"] == sizing["dispatch_buffer_bytes"]
    )
    assert guards["prefill"] == sizing["prefill"]


def test_the_written_policy_serves_with_the_same_values(server_factory, tmp_path: Path) -> None:
    preset = tmp_path / "guards" / "tiny.toml"
    r = plan(
        "--model",
        "tiny",
        "--gpu",
        "cpu",
        "--gpus-per-node",
        "2",
        *WORK,
        *SIZING,
        "--write-policy",
        str(preset),
        "-o",
        "json",
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    rec = layout(result, result["recommended"])
    import tomllib

    values = {
        k: v for table in tomllib.loads(preset.read_text()).values() for k, v in table.items()
    }
    assert values["max_running_requests"] == 3  # 6 requests over the 2 groups it recommends
    s = server_factory(
        ["--model", "tiny", *rec["flags"].split(), "--guard-policy", str(preset)], timeout=180
    )
    wait_all_ready(s)
    config = httpx.get(s.admin_url + "/admin/config", timeout=10).json()
    for name, value in values.items():
        assert config["args"][name] == value, name
    for group in config["guards"].values():
        assert group["dispatch_budget_tokens"] == values["dispatch_budget_tokens"]
        assert group["prefill"]["chunk"] == values["chunked_prefill_size"]
    header = preset.read_text().splitlines()
    assert header[0].startswith("# Written by: safeserve plan --model tiny --gpu cpu")
    # the header's sizes (sized again at the preset's --max-running-requests) are the server's
    (line,) = [h for h in header if h.startswith("# Per rank: ")]
    m = re.search(r"KV cache ([\d,]+) tokens, dispatch budget (\d+) rows", line)
    assert m is not None, line
    tokens, budget = int(m.group(1).replace(",", "")), int(m.group(2))
    assert budget == values["dispatch_budget_tokens"]
    groups = config["args"]["num_groups"]
    assert kv_blocks_of(s) == [tokens // config["args"]["block_size"]] * groups
