"""Expert-load balancedness: the formula, its windows, and the metric of a real group whose
routing is skewed by fault injection (both all-to-all backends that move tokens by rank)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from layouts import layout_args

from safeserve.messages import RankStats
from safeserve.moe.eplb.balancedness import (
    WINDOWS,
    BalancednessRecorder,
    group_balancedness,
    layer_balancedness,
)
from safeserve.oncall.views import describe_group, groups_table


def test_layer_balancedness_is_mean_over_max() -> None:
    assert layer_balancedness([5, 5, 5, 5]) == pytest.approx(1.0)
    assert layer_balancedness([8, 0, 0, 0]) == pytest.approx(0.25, abs=1e-5)
    assert layer_balancedness([3, 1]) == pytest.approx(2 / 3, abs=1e-5)
    assert layer_balancedness([0, 0]) == pytest.approx(1.0)  # no work: nothing is unbalanced
    with pytest.raises(ValueError):
        layer_balancedness([])


def test_recorder_averages_layers_then_windows_of_passes() -> None:
    rec = BalancednessRecorder()
    assert rec.end_pass() is None and rec.window_means() == {}  # a pass without MoE layers
    rec.record_layer([1, 1])  # 1.0
    rec.record_layer([2, 0])  # 0.5
    assert rec.end_pass() == pytest.approx(0.75, abs=1e-5)
    for _ in range(14):
        rec.record_layer([4, 0])
        rec.end_pass()
    means = rec.window_means()
    assert set(means) == set(WINDOWS)
    assert means[10] == pytest.approx(0.5, abs=1e-5)  # the last 10 passes were all 0.5
    assert means[100] == pytest.approx((0.75 + 14 * 0.5) / 15, abs=1e-5)
    assert means[1000] == means[100]
    for _ in range(1000):
        rec.record_layer([1, 1])
        rec.end_pass()
    assert rec.passes == 1000 and rec.window_means()[1000] == pytest.approx(1.0)


def test_clear_forgets_every_pass() -> None:
    rec = BalancednessRecorder()
    rec.record_layer([4, 0])
    rec.end_pass()
    rec.record_layer([1, 0])  # a pass left open is dropped too
    rec.clear()
    assert rec.passes == 0 and rec.window_means() == {} and rec.end_pass() is None
    rec.record_layer([2, 2])
    assert rec.end_pass() == pytest.approx(1.0)


def test_group_balancedness_takes_the_first_rank_that_has_it() -> None:
    stats = [RankStats(device="cpu"), RankStats(balancedness={10: 0.5, 100: 0.7})]
    assert group_balancedness(stats) == {10: 0.5, 100: 0.7}
    assert group_balancedness([RankStats(), RankStats()]) == {}


def _balancedness(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        m = re.match(r'safeserve:eplb_balancedness\{group="0",window="(\d+)"\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _wait_serving(server, restarts: int) -> None:
    """Until group 0 (its incarnation after `restarts` restarts) is READY and both its ranks
    report idle: a heartbeat taken after the group began serving."""
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        g = httpx.get(server.admin_url + "/admin/groups").json()["groups"][0]
        ranks = [r["phase"] for r in g["ranks"]]
        if g["restarts"] == restarts and g["state"] == "READY" and ranks == ["idle", "idle"]:
            return
        time.sleep(0.2)
    raise AssertionError(f"group 0 not serving: {g}")


def _generate(server, model: str, prompts: list[str]) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    async def run():
        await asyncio.gather(
            *(
                client.completions.create(
                    model=model, prompt=p, max_tokens=12, extra_body={"ignore_eos": True}
                )
                for p in prompts
            )
        )

    asyncio.run(run())
    time.sleep(1.0)  # a heartbeat carries the rank's numbers to the frontend


@pytest.mark.parametrize(
    "layout,skewed",
    [
        # 8 experts, top-2: the skew sends every token to experts 0 and 1, both on rank 0.
        ("tp2-ep2-alltoall-dp", 0.5),
        ("tp2-ep2-none", 0.5),
    ],
)
def test_skewed_routing_shows_in_balancedness(
    server_factory, checkpoint: Path, layout: str, skewed: float
) -> None:
    s = server_factory(
        ["--model", str(checkpoint), *layout_args(layout), "--enable-fault-injection"]
    )
    # The start-up warm-up ran MoE passes, but they are not traffic: once both ranks report
    # idle (a beat taken after the group began serving), no value until a request.
    _wait_serving(s, restarts=0)
    assert _balancedness(s) == {}
    prompts = [f"Request {i}: experts share the work of a batch of tokens." for i in range(4)]
    _generate(s, str(checkpoint), prompts)
    even = _balancedness(s)
    assert set(even) == {str(w) for w in WINDOWS}
    # Random routing over 2 ranks: both get pairs, so strictly above the all-on-one value.
    assert skewed + 1e-3 < even["10"] <= 1.0

    r = httpx.post(s.admin_url + "/admin/faults", json={"kind": "route_skew", "expert": 0})
    assert r.status_code == 200, r.text
    _generate(s, str(checkpoint), prompts)
    after = _balancedness(s)
    assert after["10"] == pytest.approx(skewed, abs=1e-4)  # the last 10 passes: all skewed
    assert skewed < after["1000"] < even["1000"]  # the long window still holds even passes

    groups = httpx.get(s.admin_url + "/admin/groups").json()["groups"]
    assert groups[0]["eplb_balancedness"]["10"] == pytest.approx(skewed, abs=1e-4)
    header, row = groups_table(groups).splitlines()[:2]
    assert row[header.index("BALANCE") :].split()[0] == "0.50"
    text = describe_group(groups[0], groups)
    assert "Balance:      0.50 last 10" in text
    assert "dispatch-skew" in text and "expert load balancedness 0.50" in text

    if layout != "tp2-ep2-none":
        return  # the restart check is the frontend's, the same for every backend: run it once
    # A restarted group starts a new record: no series (the old incarnation's would be stale)
    # until its first request, in /metrics as in /admin/groups.
    r = httpx.post(s.admin_url + "/admin/groups/0/restart")
    assert r.status_code == 200, r.text
    _wait_serving(s, restarts=1)
    assert _balancedness(s) == {}
    assert httpx.get(s.admin_url + "/admin/groups").json()["groups"][0]["eplb_balancedness"] == {}


def test_one_expert_parallel_rank_reports_no_balancedness(server_factory, checkpoint: Path):
    s = server_factory(["--model", str(checkpoint)])
    _generate(s, str(checkpoint), ["one rank holds every expert"])
    assert _balancedness(s) == {}
    groups = httpx.get(s.admin_url + "/admin/groups").json()["groups"]
    assert groups[0]["eplb_balancedness"] == {}
    assert "Balance:      -" in describe_group(groups[0], groups)
