"""EP-group isolation: a failed group costs its own processes, never a request."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest
from serving import sse_chunk, two_groups

GROUPS = two_groups("--max-model-len", "1024")
N, TOKENS = 32, 64


def _prompts() -> list[str]:
    return [f"request {i}: " + "abcdefg"[: i % 7] for i in range(N)]


def _body(prompt: str, stream: bool) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


async def _reference(url: str) -> list[tuple[list[int], str]]:
    async with httpx.AsyncClient(timeout=300) as c:
        rs = await asyncio.gather(
            *(c.post(url + "/v1/completions", json=_body(p, False)) for p in _prompts())
        )
    out = []
    for r in rs:
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        out.append((ch["token_ids"], ch["text"]))
    return out


async def _stream_all(url: str, on_started) -> list[dict]:  # type: ignore[no-untyped-def]
    results: list[dict] = [{} for _ in range(N)]
    started = asyncio.Event()
    count = {"chunks": 0}

    async def one(i: int, c: httpx.AsyncClient) -> None:
        ids, text, times, errors = [], [], [], []
        async with c.stream("POST", url + "/v1/completions", json=_body(_prompts()[i], True)) as r:
            group = int(r.headers.get("x-safeserve-group", -1))
            if r.status_code != 200:  # refused before its first token: a status, no stream
                errors.append(json.loads(await r.aread())["error"])
            async for line in r.aiter_lines():
                chunk = sse_chunk(line, errors)
                if chunk is None:
                    continue
                times.append(time.monotonic())
                ch = chunk["choices"][0]
                ids.extend(ch.get("token_ids") or [])
                text.append(ch["text"])
                count["chunks"] += 1
                if count["chunks"] >= 4 * N:
                    started.set()
        results[i] = {
            "group": group,
            "ids": ids,
            "text": "".join(text),
            "times": times,
            "errors": errors,
        }

    async with httpx.AsyncClient(timeout=300) as c:
        tasks = [asyncio.create_task(one(i, c)) for i in range(N)]
        await started.wait()
        fault_at = await on_started()
        await asyncio.gather(*tasks)
    for r in results:
        r["fault_at"] = fault_at
    return results


def _metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _groups(server) -> dict[int, dict]:
    return {g["id"]: g for g in httpx.get(server.admin_url + "/admin/groups").json()["groups"]}


def _wait_state(server, group: int, state: str, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _groups(server)[group]["state"] == state:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"group {group} not {state} within {timeout} s: {_groups(server)[group]}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_failed_rank_costs_its_group_only_and_no_request(server_factory, sig) -> None:
    s = server_factory(GROUPS)
    ref = asyncio.run(_reference(s.url))
    victim = _groups(s)[0]["ranks"][1]["pid"]

    async def fault() -> float:
        os.kill(victim, sig)
        return time.monotonic()

    results = asyncio.run(_stream_all(s.url, fault))
    on0 = [r for r in results if r["group"] == 0]
    on1 = [r for r in results if r["group"] == 1]
    assert on0 and on1
    for (ids, text), r in zip(ref, results, strict=True):
        assert not r["errors"], r["errors"]
        assert r["ids"] == ids  # nothing lost, nothing repeated
        assert r["text"] == text
    # Group 1's streams never waited on group 0: a survivor held up by the failed group would
    # stall for at least the 3 s stall timeout. (On 2 shared CPU cores, group 0's restart --
    # importing torch in two processes -- can delay group 1's steps by about a second: CPU
    # contention, not a wait; CI saw 1.09 s once. The GPU chaos run measures the real TPOT.)
    gaps = [b - a for r in on1 for a, b in zip(r["times"], r["times"][1:], strict=False)]
    assert max(gaps) < 2.0, max(gaps)
    assert _wait_state(s, 0, "READY", 60.0) < 60.0
    g0 = _groups(s)[0]
    assert g0["failures"] == 1 and g0["restarts"] == 1
    assert _metric(s.url, "safeserve:group_failures_total", '{group="0"}') == 1
    assert _metric(s.url, "safeserve:group_restarts_total", '{group="0"}') == 1
    assert _metric(s.url, "safeserve:group_failures_total", '{group="1"}') == 0
    moved = _metric(s.url, "safeserve:request_migrations_total")
    assert moved >= 1
    # each of group 0's requests was a suspect, moved once and cleared when it finished
    assert _metric(s.url, "safeserve:requests_suspect_cleared_total") == moved
    assert _metric(s.url, "safeserve:requests_quarantined_total") == 0
    assert _metric(s.url, "safeserve:requests_lost_total") == 0
    if sig == signal.SIGSTOP:
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            pass  # fenced: already killed


def test_drain_under_load_then_undrain(server_factory) -> None:
    s = server_factory(GROUPS)
    hdr = {}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as c:
            first = [
                asyncio.create_task(c.post(s.url + "/v1/completions", json=_body(p, False)))
                for p in _prompts()[:8]
            ]
            await asyncio.sleep(1.0)
            r = await c.post(s.admin_url + "/admin/groups/0/drain", headers=hdr)
            assert r.status_code == 200, r.text
            assert r.json()["state"] in ("DRAINING", "DRAINED")
            later = [
                await c.post(s.url + "/v1/completions", json=_body(p, False))
                for p in _prompts()[8:12]
            ]
            return [await t for t in first] + later

    rs = asyncio.run(run())
    assert all(r.status_code == 200 for r in rs)
    assert all(r.headers["x-safeserve-group"] == "1" for r in rs[8:])  # none to the drained group
    assert _wait_state(s, 0, "DRAINED", 30.0) < 30.0
    assert httpx.post(s.admin_url + "/admin/groups/0/undrain").json()["state"] == "READY"
    assert httpx.post(s.admin_url + "/admin/groups/9/drain").status_code == 404


def test_crash_loop_stays_failed_while_the_other_group_serves(server_factory) -> None:
    s = server_factory(
        [
            *GROUPS,
            "--enable-fault-injection",
            "--fault-fail-start-group",
            "1",
            "--crash-loop-failures",
            "2",
        ]
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        g1 = _groups(s)[1]
        if g1["crash_loop"]:
            break
        time.sleep(0.2)
    assert (
        g1["state"] == "FAILED" and g1["crash_loop"] and g1["restarts"] == 1 and g1["failures"] == 2
    )
    r = httpx.post(s.url + "/v1/completions", json=_body("still serving", False))
    assert r.status_code == 200 and r.headers["x-safeserve-group"] == "0"
    assert httpx.get(s.url + "/ready").json()["groups_ready"] == 1
    assert _metric(s.url, "safeserve:group_state", '{group="1",state="FAILED"}') == 1


def test_second_fault_during_restart_hits_the_other_group(server_factory) -> None:
    """Group 0 dies; while it restarts, group 1 dies too: requests wait or retry, none is lost.
    Group 0's requests are suspects, moved one per group: the one in flight on group 1 when it
    dies crashed two groups to the frontend's eyes, and is quarantined (an error event with
    `request_quarantined`); every other request finishes with every token."""
    s = server_factory(GROUPS)
    ref = asyncio.run(_reference(s.url))
    first = _groups(s)[0]["ranks"][1]["pid"]

    async def faults() -> float:
        os.kill(first, signal.SIGKILL)
        t = time.monotonic()
        while _groups(s)[0]["state"] not in ("RESTARTING", "STARTING"):
            await asyncio.sleep(0.05)
        os.kill(_groups(s)[1]["ranks"][0]["pid"], signal.SIGKILL)
        return t

    results = asyncio.run(_stream_all(s.url, faults))
    quarantined = [r for r in results if r["errors"]]
    assert len(quarantined) <= 1
    for r in quarantined:
        assert [e["code"] for e in r["errors"]] == ["request_quarantined"], r["errors"]
    for (ids, text), r in zip(ref, results, strict=True):
        if not r["errors"]:
            assert r["ids"] == ids and r["text"] == text
    for g in (0, 1):
        _wait_state(s, g, "READY", 60.0)
        assert _groups(s)[g]["failures"] == 1 and _groups(s)[g]["restarts"] == 1
    assert _metric(s.url, "safeserve:requests_quarantined_total") == len(quarantined)
    assert _metric(s.url, "safeserve:requests_suspect") == 0
    assert _metric(s.url, "safeserve:requests_lost_total") == 0
    assert _metric(s.url, "safeserve:requests_failed_after_retries_total") == 0


def test_restart_backoff_doubles_per_failure_in_the_window_from_the_base() -> None:
    from safeserve.server.supervisor import restart_delay

    assert [restart_delay(0.5, n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    # a lost node agent's failure is not counted in the window: the base backoff, not half
    assert restart_delay(0.5, 0) == 0.5
