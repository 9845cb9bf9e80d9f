"""Faults that come in through the front door, on two groups of two ranks (CPU, gloo): a request
that makes the ranks raise, and one whose temperature overflows the logits, cost no group and
end only themselves while 16 streams on both groups complete exactly; a request that makes a
rank exit hard costs at most two group failures, is quarantined, and identical requests after it
are refused at the edge without touching a group, while /health stays 200 and some group is
READY or restarting at every moment."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving import (
    Server,
    admin_groups,
    metric,
    oncall,
    start_server,
    stop_server,
    stream_completion,
    two_groups,
    wait_all_ready,
)

pytestmark = pytest.mark.slow

STREAMS = 16
MAX_TOKENS = 24
PROMPTS = [[5 + (11 * i + 3 * j) % 240 for j in range(6 + i % 5)] for i in range(STREAMS)]
# States in which a group serves or is on its way back by itself.
SERVING_OR_RECOVERING = {"READY", "RESTARTING", "STARTING"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("front-door") / "server.log"
    s = start_server(two_groups("--enable-fault-injection", "--quarantine-s", "600"), log)
    yield s
    stop_server(s.proc)


def _stream(s: Server, prompt: list[int], **extra: object) -> tuple[list[int], str | None]:
    return stream_completion(s, prompt, MAX_TOKENS, **extra)


def _streams(s: Server) -> list[tuple[list[int], str | None]]:
    with ThreadPoolExecutor(STREAMS) as pool:
        return list(pool.map(lambda p: _stream(s, p), PROMPTS))


@pytest.fixture(scope="module")
def reference(server: Server) -> list[list[int]]:
    """Every stream's tokens in a round with no fault."""
    out = _streams(server)
    assert all(err is None and len(ids) == MAX_TOKENS for ids, err in out), out
    return [ids for ids, _ in out]


def test_raising_and_overflowing_requests_cost_no_group(
    server: Server, reference: list[list[int]]
) -> None:
    """While 16 streams run on both groups: `temperature: 1e-300` is answered (greedily), and a
    request that makes every rank of its group raise fails alone with `internal_error`; no
    group fails and every stream equals its fault-free run token for token."""
    with ThreadPoolExecutor(STREAMS + 4) as pool:
        streams = [pool.submit(_stream, server, p) for p in PROMPTS]
        time.sleep(0.5)  # the streams are decoding on both groups
        tiny_t = [pool.submit(_stream, server, PROMPTS[i], temperature=1e-300) for i in (0, 1)]
        raising = [
            pool.submit(_stream, server, PROMPTS[i], safeserve_fault="raise") for i in (2, 3)
        ]
        results = [f.result() for f in streams]
        assert [f.result() for f in tiny_t] == [(reference[0], None), (reference[1], None)]
        for f in raising:
            assert f.result()[1] == "internal_error"
    assert [ids for ids, _ in results] == reference
    assert all(err is None for _, err in results)
    # Not streamed too: the same answer as a 500 in the error shape.
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "safeserve_fault": "raise"}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
    # Streamed, it fails before its first token: still a status, not a 200 with an error event
    # (a client's retry logic sees it), for completions and chat alike.
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    for path, b in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        r = httpx.post(
            server.url + path, json={**b, "stream": True, "safeserve_fault": "raise"}, timeout=60
        )
        assert r.status_code == 500, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["code"] == "internal_error"
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 1e-300}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert metric(server, "safeserve:group_failures_total") == 0
    assert all(g["state"] == "READY" for g in admin_groups(server))


class _Monitor(threading.Thread):
    """Polls /health and the groups' states; records every moment that breaks the promise."""

    def __init__(self, s: Server) -> None:
        super().__init__(daemon=True)
        self.s, self.stop, self.bad, self.polls = s, threading.Event(), [], 0

    def run(self) -> None:
        while not self.stop.is_set():
            health = httpx.get(self.s.url + "/health", timeout=10).status_code
            states = [g["state"] for g in admin_groups(self.s)]
            self.polls += 1
            if health != 200 or not SERVING_OR_RECOVERING & set(states):
                self.bad.append((health, states))
            time.sleep(0.05)


def test_query_of_death_is_quarantined_after_at_most_two_group_failures(
    server: Server, reference: list[list[int]]
) -> None:
    wait_all_ready(server)
    failures_before = metric(server, "safeserve:group_failures_total")
    monitor = _Monitor(server)
    monitor.start()
    try:
        with ThreadPoolExecutor(9) as pool:
            others = [pool.submit(_stream, server, p) for p in PROMPTS[:8]]
            time.sleep(0.3)
            deadly = _stream(server, PROMPTS[8], safeserve_fault="exit")
            survivors = [f.result() for f in others]
        assert deadly[1] == "request_quarantined", deadly
        # The other streams were in flight on the failed groups: they continued elsewhere and
        # lost nothing.
        assert survivors == [(ref, None) for ref in reference[:8]]
        # The client retries: each retry is refused at the edge and costs no group.
        failures = metric(server, "safeserve:group_failures_total")
        body = {"model": "tiny", "prompt": PROMPTS[8], "max_tokens": MAX_TOKENS}
        body |= {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True}
        for _ in range(20):  # a client's retry loop: refused at admission, no group is touched
            again = httpx.post(
                server.url + "/v1/completions", json={**body, "safeserve_fault": "exit"}, timeout=60
            )
            assert again.status_code == 422, again.text
            assert again.json()["error"]["code"] == "request_quarantined"
            assert int(again.headers["retry-after"]) > 500
        assert metric(server, "safeserve:group_failures_total") == failures
        assert 1 <= failures - failures_before <= 2
        assert metric(server, "safeserve:requests_quarantined_total") == 1
        assert metric(server, "safeserve:quarantine_refusals_total") == 20
        assert metric(server, "safeserve:quarantine_fingerprints") == 1
        assert metric(server, "safeserve:requests_lost_total") == 0
        wait_all_ready(server)
    finally:
        monitor.stop.set()
        monitor.join()
    assert monitor.polls > 10 and monitor.bad == [], monitor.bad
    groups = admin_groups(server)
    assert not any(g["crash_loop"] for g in groups)
    # A silent os._exit(1): `dead` with its exit code, never `crashed`.
    assert {v["kind"] for g in groups for v in g["verdicts"]} <= {"dead"}
    # The on-call view of it, and lifting it.
    rows = oncall(server, "get", "quarantine").stdout.splitlines()
    assert rows[0].split()[:3] == ["FINGERPRINT", "RID", "GROUPS"] and len(rows) == 2
    fp = rows[1].split()[0]
    involved = [g for g in groups if g["quarantined"]]
    assert involved
    assert "query-of-death" in oncall(server, "describe", "group", str(involved[0]["id"])).stdout
    dry = oncall(server, "lift", "quarantine", "--all", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.startswith(f"would lift 1 quarantine(s): {fp}")
    assert metric(server, "safeserve:quarantine_fingerprints") == 1
    lifted = oncall(server, "lift", "quarantine", fp)
    assert lifted.returncode == 0 and lifted.stdout.startswith(f"lifted 1 quarantine(s): {fp}")
    assert metric(server, "safeserve:quarantine_fingerprints") == 0
    assert oncall(server, "lift", "quarantine", fp).returncode == 1  # 404: none held
    # Another request is still served by both groups.
    assert _streams(server) == [(ref, None) for ref in reference]


def test_quarantined_request_without_fault_field_is_served(server: Server) -> None:
    """The fingerprint covers the sampling fields: the same prompt without the deadly field is
    an ordinary request."""
    ids, err = _stream(server, PROMPTS[8])
    assert err is None and len(ids) == MAX_TOKENS
