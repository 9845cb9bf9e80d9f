"""`safeserve oncall` against a real server: tables, describe with events and verdicts, server-side
dry runs that change nothing, refusals with their exit codes, and the runbook a dead rank
points to."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from serving import KV_PRESSURE, preempts_and_loses_nothing, two_groups

ROOT = Path(__file__).resolve().parents[2]
SERVER = two_groups("--max-model-len", "256")


def oncall(admin_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "safeserve.cli", "oncall", "--admin-url", admin_url, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def _state(admin_url: str, group: int) -> str:
    groups = httpx.get(admin_url + "/admin/groups").json()["groups"]
    return next(g["state"] for g in groups if g["id"] == group)


def _wait(admin_url: str, group: int, state: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _state(admin_url, group) != state:
        assert time.monotonic() < deadline, f"group {group} not {state}"
        time.sleep(0.2)


def test_oncall_views_actions_and_runbooks(server_factory) -> None:
    s = server_factory(SERVER)
    a = s.admin_url
    for g in (0, 1):  # /ready answers once one group is up
        _wait(a, g, "READY")
    deadline = time.monotonic() + 10  # a group's first stats follow its READY (heartbeat period)
    while not all(g["kv_blocks_total"] for g in httpx.get(a + "/admin/groups").json()["groups"]):
        assert time.monotonic() < deadline, "no KV report from a READY group"
        time.sleep(0.1)

    r = oncall(a, "get", "groups")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["GROUP", "STATE", "RANKS"]
    assert [ln.split()[:3] for ln in lines[1:]] == [["0", "READY", "2"], ["1", "READY", "2"]]
    assert lines[0].split()[6:8] == ["KV-USED", "PREEMPTED"]
    groups = json.loads(oncall(a, "get", "groups", "-o", "json").stdout)
    for g in groups:  # idle: an empty cache of the blocks the engine reported at start
        assert g["kv_blocks_total"] > 0 and g["kv_blocks_used"] == 0 and g["preemptions"] == 0
        assert g["kv_block_size"] == 16
    assert [ln.split()[6:8] for ln in lines[1:]] == [["0%", "0"], ["0%", "0"]]
    pids = {g["id"]: [rk["pid"] for rk in g["ranks"]] for g in groups}
    ranks = oncall(a, "get", "ranks").stdout.splitlines()
    assert len(ranks) == 1 + 4 and ranks[1].split()[:2] == ["0/0", str(pids[0][0])]
    assert "RECV-PEAK/BUDGET" in ranks[0] and ranks[0].endswith("GRAPHS(DECODE/PIECEWISE)")
    assert all(ln.split()[-1] == "-" for ln in ranks[1:])  # CPU ranks capture no CUDA graphs

    # A dry run asks the server and changes nothing; a refused one exits 1 with one line.
    r = oncall(a, "drain", "group", "0", "--dry-run")
    assert r.returncode == 0 and "would drain" in r.stdout and "other READY groups: 1" in r.stdout
    assert _state(a, 0) == "READY"
    r = oncall(a, "undrain", "group", "0", "--dry-run")
    assert r.returncode == 1 and "409" in r.stderr and "not DRAINING" in r.stderr
    assert r.stderr.count("\n") == 1
    assert oncall(a, "describe", "group", "9").returncode == 1

    assert oncall(a, "drain", "group", "0").returncode == 0
    _wait(a, 0, "DRAINED")
    desc = oncall(a, "describe", "group", "0").stdout
    events = desc.split("Events:")[1].split("Runbooks:")[0]
    assert [ln.split()[-1] for ln in events.strip().splitlines()][-3:] == [
        "READY",
        "DRAINING",
        "DRAINED",
    ]
    assert oncall(a, "undrain", "group", "0").returncode == 0
    assert _state(a, 0) == "READY"

    # A dead rank: the group restarts; describe shows the verdict and points to the runbook.
    os.kill(pids[1][1], signal.SIGKILL)
    deadline = time.monotonic() + 90
    while True:
        g1 = json.loads(oncall(a, "describe", "group", "1", "-o", "json").stdout)
        if g1["state"] == "READY" and g1["restarts"] == 1:
            break
        assert time.monotonic() < deadline, g1
        time.sleep(0.5)
    desc = oncall(a, "describe", "group", "1").stdout
    assert "dead" in desc.split("Verdicts:")[1] and f"pid {pids[1][1]}" in desc
    assert "rank-dead" in desc.split("Runbooks:")[1]
    assert "FAILED" in desc.split("Events:")[1]
    book = oncall(a, "runbook", "rank-dead")
    assert book.returncode == 0 and book.stdout.startswith("# A rank died")
    row = oncall(a, "get", "groups").stdout.splitlines()[2]
    assert row.split()[:2] == ["1", "READY"] and "dead rank 1" in row


def test_oncall_unreachable_and_unknown_runbook() -> None:
    r = oncall("http://127.0.0.1:9", "get", "groups")
    assert r.returncode == 3 and "no admin API at http://127.0.0.1:9" in r.stderr
    r = oncall("http://127.0.0.1:9", "runbook", "no-such-thing")
    assert r.returncode == 2 and "rank-dead" in r.stderr
    listing = oncall("http://127.0.0.1:9", "runbook").stdout
    assert {ln.split()[0] for ln in listing.splitlines()[1:]} == {
        p.stem for p in (ROOT / "runbooks").glob("*.md")
    }


def test_ranks_table_shows_graph_replays_where_a_rank_has_graphs() -> None:
    from safeserve.oncall.views import ranks_table

    def rank(i: int, **extra: object) -> dict:
        base = {"rank": i, "pid": 100 + i, "device": f"cuda:{i}", "step": 7, "phase": "idle"}
        return base | {"heartbeat_age_s": 0.1, "utilization": 0.5, "memory_bytes": 2**30} | extra

    group = {
        "id": 0,
        "ranks": [
            rank(0, cuda_graph_replays=120, piecewise_graph_replays=7),
            rank(1, cuda_graph_replays=None, piecewise_graph_replays=3),
            rank(2),
        ],
    }
    lines = ranks_table([group]).splitlines()
    assert [ln.split()[-1] for ln in lines] == ["GRAPHS(DECODE/PIECEWISE)", "120/7", "-/3", "-"]


def test_kv_columns_and_the_kv_pressure_runbook() -> None:
    from safeserve.oncall.views import describe_group, groups_table, runbooks_for

    def group(used: int, waiting: int, preemptions: int, total: int = 1000) -> dict:
        return {
            "id": 0,
            "state": "READY",
            "ranks": [],
            "running": 8,
            "waiting": waiting,
            "in_flight": 8 + waiting,
            "kv_blocks_used": used,
            "kv_blocks_total": total,
            "kv_block_size": 16,
            "preemptions": preemptions,
            "failures": 0,
            "restarts": 0,
        }

    def books(g: dict) -> dict:
        return dict(runbooks_for(g, [g], now=0.0))

    row = groups_table([group(935, 3, 2)], now=0.0).splitlines()[1].split()
    assert row[6:8] == ["94%", "2"]
    assert "kv-pressure" not in books(group(500, 3, 0))  # room left
    assert "kv-pressure" not in books(group(950, 0, 0))  # full, but nobody waits
    assert books(group(950, 4, 0))["kv-pressure"] == "KV cache 95% used with 4 requests waiting"
    assert "3 requests preempted" in books(group(100, 0, 3))["kv-pressure"]
    desc = describe_group(group(250, 0, 0), [], now=0.0)
    assert "KV cache:     250 of 1000 blocks used (25%; 16000 tokens in all)" in desc
    # a group whose engine has not reported yet: no share, no runbook
    fresh = group(0, 0, 0, total=0)
    assert groups_table([fresh], now=0.0).splitlines()[1].split()[6] == "-"
    assert "kv-pressure" not in books(fresh) and "no report" in describe_group(fresh, [], now=0.0)


def test_kv_pressure_preempts_loses_nothing_and_points_to_its_runbook(server_factory) -> None:
    """A real server with a KV cache too small for its concurrent requests: they are preempted
    and recomputed, every one ends with the tokens it gets when it runs alone, and the on-call
    view counts the preemptions and names the kv-pressure runbook."""
    s = server_factory(KV_PRESSURE)
    g = preempts_and_loses_nothing(s)
    assert g["kv_blocks_total"] == 12
    desc = oncall(s.admin_url, "describe", "group", "0").stdout
    assert "kv-pressure" in desc.split("Runbooks:")[1]
    assert f"{g['preemptions']} requests preempted" in desc
    assert oncall(s.admin_url, "runbook", "kv-pressure").stdout.startswith("# The KV cache is full")


def test_an_action_still_under_way_is_not_reported_done() -> None:
    """drain/restart answer at once, often before the group got where they take it: the line
    says "under way" and how to follow it while the group drains or restarts, "done" only once
    it is there, "would" on a dry run."""
    from safeserve.oncall.cli import _act_line

    r = {"group": 0, "state": "DRAINING", "in_flight": 3, "other_ready_groups": [1]}
    line = _act_line("restart", False, r)
    assert line.startswith("group 0 restart: under way (now DRAINING, 3 in flight;")
    assert "safeserve oncall get groups" in line and "done" not in line
    r = {**r, "state": "DRAINED", "in_flight": 0}
    assert _act_line("drain", False, r).startswith("group 0 drain: done (now DRAINED, 0 in")
    assert _act_line("drain", True, {**r, "state": "READY"}).startswith("group 0 would drain")
    r = {"group": 2, "state": "RESTARTING", "in_flight": 0, "other_ready_groups": []}
    assert "under way" in _act_line("restart", False, r)
    assert "other READY groups: none" in _act_line("restart", False, r)


def test_a_restart_says_the_group_is_starting_not_failed() -> None:
    """`restart group N` of a FAILED group: the server answers RESTARTING (the new incarnation
    is on its way); the line says so and how to follow it, also from a server that answered
    FAILED before it moved on."""
    from safeserve.oncall.cli import _act_line

    for state in ("RESTARTING", "FAILED"):
        r = {"group": 1, "state": state, "in_flight": 0, "other_ready_groups": [0]}
        line = _act_line("restart", False, r)
        assert line.startswith(f"group 1 restart: under way (now {state}, 0 in flight;")
        assert "a new incarnation is starting; it takes requests again once READY" in line
        assert "safeserve oncall describe group 1" in line and "done" not in line
    r = {"group": 0, "state": "DRAINING", "in_flight": 2, "other_ready_groups": [1]}
    assert "it restarts once its in-flight requests finish" in _act_line("restart", False, r)


def test_quarantine_views_and_the_runbook_a_crash_points_to() -> None:
    from safeserve.oncall.views import (
        describe_group,
        lift_lines,
        quarantine_table,
        runbooks_for,
        suspects_table,
    )

    q = {"fingerprint": "ab12", "rid": "cmpl-9", "groups": [0, 1], "at": 0.0}
    q |= {"expires_in_s": 540.0, "refused": 20}
    s = {"rid": "cmpl-3", "fingerprint": "cd34", "failed_group": 1, "group": 0, "since": 0.0}
    rows = quarantine_table({"quarantined": [q]}, now=60.0).splitlines()
    assert rows[0].split() == [
        "FINGERPRINT",
        "RID",
        "GROUPS",
        "QUARANTINED",
        "EXPIRES-IN",
        "REFUSED",
    ]
    assert rows[1].split() == ["ab12", "cmpl-9", "0,1", "60s", "ago", "540s", "20"]
    assert suspects_table({"suspects": [s]}, now=5.0).splitlines()[1].split()[:4] == [
        "cmpl-3",
        "cd34",
        "1",
        "0",
    ]
    g = {"id": 0, "state": "READY", "ranks": [], "running": 1, "waiting": 0, "in_flight": 1}
    g |= {"failures": 1, "restarts": 1, "suspects": [s], "quarantined": [q]}
    crashed = {"kind": "crashed", "rank": 1, "reason": "rank 1 crashed: E: x", "at": 0.0}
    g["verdicts"] = [crashed]
    books = dict(runbooks_for(g, [g], now=10.0))
    assert "query-of-death" in books and "ab12" in books["query-of-death"]
    assert "watchdog verdict crashed on rank 1" in dict(
        runbooks_for({**g, "quarantined": []}, [g], now=10.0)
    ).get("query-of-death", "")
    desc = describe_group(g, [g], now=10.0)
    assert "cmpl-3  fingerprint cd34, was on group 1" in desc.split("Suspects:")[1]
    assert "ab12  cmpl-9 crashed groups 0 and 1" in desc.split("Quarantined:")[1]
    assert lift_lines({"dry_run": True, "lifted": [q]}) == "would lift 1 quarantine(s): ab12"
    assert lift_lines({"dry_run": False, "lifted": []}).startswith("lifted 0 quarantine(s): none")


def test_describe_shows_the_last_rebalance_and_points_to_the_skew_runbook() -> None:
    from dataclasses import asdict

    from safeserve.messages import EplbCheck, EplbStatus
    from safeserve.oncall.views import describe_group, runbooks_for

    done = EplbCheck(90.0, 6, 0.41, "rebalanced", "3 of 4 MoE layers move", 0.93, 0.52)
    done.layers_moved, done.moved_bytes, done.duration_s, done.longest_pause_s = (
        3,
        3 << 20,
        0.2,
        0.05,
    )
    skipped = EplbCheck(99.0, 6, 0.95, "skipped", "balancedness 0.950 over 6 passes is above x")
    status = EplbStatus(True, 8, 12, 3, 2, 6, 2, 1.0, 1, 1, 3 << 20, 0.2, 0, skipped, done)

    def group(eplb: dict | None, balance: float) -> dict:
        return {
            "id": 0,
            "state": "READY",
            "ranks": [],
            "running": 0,
            "waiting": 0,
            "in_flight": 0,
            "failures": 0,
            "restarts": 0,
            "eplb_balancedness": {"10": balance},
            "eplb": eplb,
        }

    summary = {**asdict(status), "overdue": False}
    desc = describe_group(group(summary, 0.5), [], now=100.0)
    assert "1 rebalances, 1 skipped, every 6 passes (2 since the last check)" in desc
    assert "12 slots for 8 experts" in desc
    assert "last rebalance 10s ago: 3 layers, 3.0 MiB in 0.20 s (longest step 50 ms)" in desc
    assert "balancedness 0.41 before, 0.52 since" in desc
    assert "last check 1s ago: skipped: balancedness 0.950" in desc
    why = dict(runbooks_for(group(summary, 0.5), [], now=100.0))["dispatch-skew"]
    assert "it stays low after EPLB's rebalances" in why
    # balanced: no runbook; an overdue check points to it whatever the balance
    assert "dispatch-skew" not in dict(runbooks_for(group(summary, 0.9), [], now=100.0))
    overdue = {**summary, "passes_since_check": 20, "overdue": True}
    assert "OVERDUE" in describe_group(group(overdue, 0.9), [], now=100.0)
    why = dict(runbooks_for(group(overdue, 0.9), [], now=100.0))["dispatch-skew"]
    assert "an EPLB rebalance check was due and did not run" in why
    assert "EPLB:         off" in describe_group(group({"enabled": False}, 0.9), [], now=0.0)


def test_a_corrupt_verdict_names_the_group_and_its_runbook() -> None:
    from safeserve.oncall.views import describe_group, groups_table, runbooks_for

    verdict = {"kind": "corrupt", "rank": None, "reason": "the canary answered wrong", "at": 95.0}
    g = {
        "id": 1,
        "state": "READY",
        "ranks": [],
        "running": 0,
        "waiting": 0,
        "in_flight": 0,
        "failures": 1,
        "restarts": 1,
        "verdicts": [verdict],
    }
    assert "corrupt group 5s ago" in groups_table([g], now=100.0)
    assert "corrupt  group: the canary answered wrong" in describe_group(g, [g], now=100.0)
    why = dict(runbooks_for(g, [g], now=100.0))["rank-corrupt"]
    assert why == "watchdog verdict corrupt on group 5s ago"
