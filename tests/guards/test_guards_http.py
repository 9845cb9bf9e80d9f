"""The guards end to end: real ranks, real signals, real HTTP."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from serving import concurrent_completions

PROMPTS = [
    "Experts route tokens; the router picks the top k experts for every token in the batch. " * 2,
    "A paged key value cache stores attention keys in fixed size blocks, block after block. " * 2,
    "Mixture of experts models serve many requests at once on many GPUs. " * 3,
    "The quick brown fox jumps over the lazy dog, again and again and again. " * 2,
    "0123456789 + - * / = ( ) [ ] { } < > , ; : ! ? " * 3,
    "Héllo wörld, naïve café — unicode text with accents and emoji 🙂. " * 2,
]


def _metrics(server) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        m = re.match(r"(safeserve:\w+)\{(.*)\} (\S+)", line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def _per_rank(metrics: dict, name: str) -> dict[int, float]:
    return {
        int(re.search(r'rank="(\d+)"', labels).group(1)): v
        for (n, labels), v in metrics.items()
        if n == name
    }


def _greedy_all(server, model: str) -> list[list[int]]:
    results = concurrent_completions(server, model, PROMPTS, 10, timeout=300, ignore_eos=True)
    return [r.choices[0].model_extra["token_ids"] for r in results]


def _fault(server, body: dict) -> None:
    r = httpx.post(server.admin_url + "/admin/faults", json=body)
    assert r.status_code == 200, r.text


def test_the_incident_small(server_factory, checkpoint: Path) -> None:
    """4 ranks, DP attention, alltoall, every token routed to rank 0, prompts far over budget."""
    common = [
        "--model",
        str(checkpoint),
        "--tp-size",
        "4",
        "--enable-dp-attention",
        "--moe-a2a-backend",
        "alltoall",
        "--enable-fault-injection",
        "--chunked-prefill-size",
        "64",
    ]
    budget = 16
    guarded = server_factory([*common, "--dispatch-budget-tokens", str(budget)])
    warnings = [
        ln
        for ln in guarded.output().splitlines()
        if "WARNING" in ln and "chunked-prefill-size" in ln
    ]
    assert len(warnings) == 1 and "above the safe size 4" in warnings[0]
    config = httpx.get(guarded.admin_url + "/admin/config").json()["guards"]["0"]
    assert config["dispatch_budget_tokens"] == budget and config["prefill"]["safe_step_tokens"] == 4
    _fault(guarded, {"kind": "route_skew", "expert": 0})
    assert sum(len(p) for p in PROMPTS) > 20 * budget
    got = _greedy_all(guarded, str(checkpoint))
    time.sleep(1.0)  # let a heartbeat carry the last counters
    m = _metrics(guarded)
    peak = _per_rank(m, "safeserve:dispatch_recv_tokens_peak")
    assert len(peak) == 4 and max(peak.values()) <= budget
    assert peak[0] == budget  # the skew really sent everything to rank 0, and it was cut
    assert _per_rank(m, "safeserve:dispatch_cut_total")[0] > 0
    assert _per_rank(m, "safeserve:dispatch_rounds_total")[0] > 0
    buf, used = (
        _per_rank(m, "safeserve:dispatch_buffer_bytes"),
        _per_rank(m, "safeserve:dispatch_buffer_peak_bytes"),
    )
    assert all(used[r] <= buf[r] for r in buf)
    # Experts 0 and 1 (the skew's top-2) both live on rank 0 of 4: balancedness 1/4.
    assert m[("safeserve:eplb_balancedness", 'group="0",window="10"')] == pytest.approx(
        0.25, abs=1e-4
    )
    assert httpx.get(guarded.url + "/ready").status_code == 200  # nothing crashed

    unlimited = server_factory([*common, "--dispatch-budget-tokens", "0"])
    _fault(unlimited, {"kind": "route_skew", "expert": 0})
    assert _greedy_all(unlimited, str(checkpoint)) == got


def _load(server, results: list, n: int = 4, max_tokens: int = 3000) -> list[threading.Thread]:
    """n long requests (half streamed); each records (outcome, time it ended)."""

    def one(i: int) -> None:
        body = {
            "model": "tiny",
            "prompt": f"load {i}",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        try:
            if i % 2:
                with httpx.stream(
                    "POST",
                    server.url + "/v1/completions",
                    json={**body, "stream": True},
                    timeout=60,
                ) as r:
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                outcome = (
                    "error-event"
                    if any('"error"' in ln for ln in lines)
                    else f"stream-{r.status_code}"
                )
            else:
                r = httpx.post(server.url + "/v1/completions", json=body, timeout=180)
                outcome = f"{r.status_code}" + (
                    "+retry-after" if "retry-after" in r.headers else ""
                )
        except Exception as e:  # noqa: BLE001
            outcome = f"exception {type(e).__name__}"
        results.append((outcome, time.monotonic()))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _rank_pids(server) -> dict[int, int]:
    g = httpx.get(server.admin_url + "/admin/groups").json()["groups"][0]
    return {r["rank"]: r["pid"] for r in g["ranks"]}


def _wait_generating(server, n: int, timeout: float = 60.0) -> None:
    """Until group 0 runs n requests and has generated tokens: the load is decoding."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _metrics(server)
        running = m.get(("safeserve:num_requests_running", 'group="0"'), 0)
        tokens = m.get(("safeserve:generation_tokens_total", 'group="0"'), 0)
        if running == n and tokens >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} requests not generating within {timeout} s")


def _wait_verdict(server, kind: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = httpx.get(server.admin_url + "/admin/groups").json()["groups"][0]
        found = [v for v in g["verdicts"] if v["kind"] == kind]
        if found:
            return {**found[0], "state": g["state"]}
        time.sleep(0.05)
    raise AssertionError(f"no {kind} verdict within {timeout} s")


@pytest.mark.parametrize(
    "sig,kind,limit", [(signal.SIGSTOP, "stalled", 3.0 + 2.0), (signal.SIGKILL, "dead", 2.0)]
)
def test_stopped_or_killed_rank_is_named_and_fenced(
    server_factory, sig, kind: str, limit: float
) -> None:
    s = server_factory(
        [
            "--tp-size",
            "2",
            "--moe-a2a-backend",
            "alltoall",
            "--max-model-len",
            "4096",
            "--watchdog-stall-timeout",
            "3",
            # One group, no migration and no restart: the fence itself is what is checked here
            # (failover is tested in tests/server/test_failover.py).
            "--max-request-attempts",
            "1",
            "--crash-loop-failures",
            "1",
        ]
    )
    pids = _rank_pids(s)
    results: list = []
    threads = _load(s, results)
    _wait_generating(s, 4)
    t0 = time.monotonic()
    os.kill(pids[1], sig)
    verdict = _wait_verdict(s, kind, limit + 1.0)
    detected = verdict["at"] - (time.time() - (time.monotonic() - t0))  # verdict time - signal time
    assert detected <= limit, detected
    assert verdict["rank"] == 1 and verdict["state"] == "FAILED"
    for t in threads:
        t.join(timeout=15)
    assert len(results) == 4
    assert all(o in ("503+retry-after", "error-event") for o, _ in results), results
    assert max(at for _, at in results) - t0 < limit + 3.0
    # Fenced: every rank process of the group is gone; the frontend still answers.
    time.sleep(0.5)
    assert not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        for p in pids.values()
    )
    r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 503 and "retry-after" in r.headers
    assert httpx.get(s.url + "/ready").status_code == 503
    assert _metrics(s)[("safeserve:watchdog_verdicts_total", f'group="0",verdict="{kind}"')] == 1


def test_slow_rank_is_reported_not_fenced(server_factory) -> None:
    s = server_factory(
        [
            "--tp-size",
            "2",
            "--moe-a2a-backend",
            "alltoall",
            "--max-model-len",
            "4096",
            "--enable-fault-injection",
            "--watchdog-slow-window-s",
            "1.5",
        ]
    )
    results: list = []
    # Each of the slow steps takes a second: the requests outlast the verdict by far.
    threads = _load(s, results, n=2, max_tokens=150)
    _wait_generating(s, 2)
    _fault(s, {"kind": "slow_rank", "group": 0, "rank": 1, "delay_s": 1.0})
    verdict = _wait_verdict(s, "slow", 20.0)
    assert verdict["rank"] == 1 and verdict["state"] == "READY"
    _fault(s, {"kind": "clear"})
    for t in threads:
        t.join(timeout=180)
    assert [o for o, _ in results] == ["200", "stream-200"] or sorted(o for o, _ in results) == [
        "200",
        "stream-200",
    ]
    assert httpx.get(s.url + "/ready").status_code == 200


def test_fault_endpoint_needs_the_flag_and_admin_key(server_factory) -> None:
    s = server_factory(["--admin-api-key", "adm"])
    assert (
        httpx.post(
            s.admin_url + "/admin/faults",
            json={"kind": "clear"},
            headers={"Authorization": "Bearer adm"},
        ).status_code
        == 404
    )
    assert httpx.get(s.admin_url + "/admin/groups").status_code == 401
    g = httpx.get(s.admin_url + "/admin/groups", headers={"Authorization": "Bearer adm"}).json()[
        "groups"
    ][0]
    rank = g["ranks"][0]
    assert g["state"] == "READY" and set(rank) >= {
        "rank",
        "pid",
        "device",
        "step",
        "phase",
        "heartbeat_age_s",
        "utilization",
        "memory_bytes",
    }
    assert httpx.get(s.url + "/admin/groups").status_code == 404  # not on the public port
    # Bound to loopback only (checked on the listening socket; no traffic leaves the machine).
    admin_port = int(s.admin_url.rsplit(":", 1)[1])
    listening = [
        c.laddr
        for c in psutil.Process(s.proc.pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert [a.ip for a in listening if a.port == admin_port] == ["127.0.0.1"]
