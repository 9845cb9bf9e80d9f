"""The canary: a device that computes wrong results is caught and its group fenced.

- `compare` on hand-made answers: equal, a near-tie flip, a real flip, a moved logprob.
- A real server (two groups of the tiny model, the canary every second): `corrupt` fault
  injection damages one group's weights in place; the canary's `corrupt` verdict fences that group
  within two intervals, it restarts and answers right again, streams running meanwhile all
  complete, and `GET /health/generate` answers through the canary. With the canary off the same
  fault goes unnoticed: the group stays READY and serves wrong tokens.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from serving import (
    Server,
    admin_groups,
    metric,
    start_server,
    stop_server,
    stream_completion,
    wait_all_ready,
)

from safeserve.guards.canary import MAX_TOKENS as CANARY_TOKENS
from safeserve.guards.canary import CanaryAnswer, compare
from safeserve.messages import TokenLogprob

PROMPTS = [[5 + i, 17, 33 + 2 * i, 9] for i in range(6)]
MAX_TOKENS = 24


def _answer(*steps: tuple[int, float, float]) -> CanaryAnswer:
    """(token, its logprob, the runner-up's logprob) per position."""
    lps = [TokenLogprob(t, lp, [(t, lp), (t + 1, second)]) for t, lp, second in steps]
    return CanaryAnswer([t for t, _, _ in steps], lps)


def test_compare() -> None:
    ref = _answer((7, -0.1, -3.0), (9, -0.5, -0.6), (4, -0.2, -4.0))
    assert compare(ref, _answer((7, -0.12, -3.0), (9, -0.52, -0.6), (4, -0.2, -4.0))) is None
    # position 1 was a near tie (0.1 nats): another token there, and anything after, is healthy
    assert compare(ref, _answer((7, -0.1, -3.0), (10, -0.55, -0.6), (1, -2.0, -3.0))) is None
    why = compare(ref, _answer((8, -0.1, -3.0), (9, -0.5, -0.6), (4, -0.2, -4.0)))
    assert why is not None and "token 0 is 8, the reference's is 7" in why  # not a near tie
    # a near tie, but not to the runner-up (11), or the runner-up with another logprob
    assert compare(ref, _answer((7, -0.1, -3.0), (11, -0.55, -0.6), (4, -0.2, -4.0)))
    assert compare(ref, _answer((7, -0.1, -3.0), (10, -2.0, -2.1), (4, -0.2, -4.0)))
    why = compare(ref, _answer((7, -1.4, -3.0), (9, -0.5, -0.6), (4, -0.2, -4.0)))
    assert why is not None and "logprob -1.400" in why
    assert "2 tokens" in (compare(ref, _answer((7, -0.1, -3.0), (9, -0.5, -0.6))) or "")


def test_compare_with_logits_digests_is_exact() -> None:
    """Deterministic mode on CUDA: answers carry a digest of each logits row, and any change
    of one is a mismatch, even a logprob change far inside the tolerance."""
    ref = _answer((7, -0.1, -3.0), (9, -0.5, -0.6))
    for i, lp in enumerate(ref.logprobs):
        lp.digest = f"{i:016x}"
    same = _answer((7, -0.1, -3.0), (9, -0.5, -0.6))
    for i, lp in enumerate(same.logprobs):
        lp.digest = f"{i:016x}"
    assert compare(ref, same) is None
    same.logprobs[1].digest = "ffffffffffffffff"  # logprobs equal, one logit elsewhere moved
    why = compare(ref, same)
    assert why is not None and "token 1 (9) has logits digest ffffffffffffffff" in why
    # the near-tie rule does not apply: a flip is a different computation
    flip = _answer((7, -0.1, -3.0), (10, -0.55, -0.6))
    for i, lp in enumerate(flip.logprobs):
        lp.digest = f"{i:016x}"
    assert compare(ref, flip) is not None


def _complete(s: Server, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _corrupt(s: Server, group: int) -> None:
    r = httpx.post(
        s.admin_url + "/admin/faults", json={"kind": "corrupt", "group": group, "rank": 0}
    )
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_the_canary_fences_a_group_that_computes_wrong_results(tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = ["--model", "tiny", "--num-groups", "2", "--enable-fault-injection"]
    args += ["--canary-interval-s", "1", "--restart-backoff-s", "0.5", "--max-model-len", "512"]
    s = start_server(args, tmp_path / "canary.log")
    try:
        wait_all_ready(s)
        r = httpx.get(s.url + "/health/generate?group=1", timeout=60)
        assert r.status_code == 200 and r.json()["group"] == 1, r.text
        assert len(r.json()["tokens"]) == CANARY_TOKENS
        assert httpx.get(s.url + "/health/generate?group=5").status_code == 400
        want = [_complete(s, p) for p in PROMPTS]
        streams: dict[int, tuple[list[int], str | None]] = {}

        def one(i: int) -> None:
            streams[i] = stream_completion(s, PROMPTS[i % len(PROMPTS)], 200)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        _corrupt(s, 0)
        fenced_at = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            (g0, _) = admin_groups(s)
            if any(v["kind"] == "corrupt" for v in g0["verdicts"]):
                fenced_at = time.monotonic()
                break
            time.sleep(0.1)
        canary = [ln for ln in httpx.get(s.url + "/metrics").text.splitlines() if "canary" in ln]
        assert fenced_at is not None, "\n".join(canary)
        (g0, _) = admin_groups(s)
        (verdict,) = [v for v in g0["verdicts"] if v["kind"] == "corrupt"]
        assert verdict["rank"] is None and "the canary answered wrong twice" in verdict["reason"]
        for t in threads:
            t.join(timeout=120)
        assert sorted(streams) == list(range(8))
        for i, (ids, error) in streams.items():  # nothing lost: each continued elsewhere
            assert error is None and len(ids) == 200, (i, error, len(ids))
        deadline = time.monotonic() + 60
        while any(g["state"] != "READY" for g in admin_groups(s)):
            assert time.monotonic() < deadline, admin_groups(s)
            time.sleep(0.2)
        # the restarted group loaded its weights again: right answers on both groups
        for g in (0, 1):
            r = httpx.get(s.url + f"/health/generate?group={g}", timeout=60)
            assert r.status_code == 200, r.text
        assert [_complete(s, p) for p in PROMPTS] == want
        assert metric(s, 'safeserve:canary_runs_total{group="0",result="corrupt"}') == 1
        assert metric(s, 'safeserve:watchdog_verdicts_total{group="0",verdict="corrupt"}') == 1
        assert metric(s, "safeserve:requests_lost_total") == 0
    finally:
        stop_server(s.proc)


@pytest.mark.slow
def test_without_the_canary_the_same_fault_goes_unnoticed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = start_server(["--model", "tiny", "--enable-fault-injection"], tmp_path / "off.log")
    try:
        want = [_complete(s, p) for p in PROMPTS]
        _corrupt(s, 0)
        got = [_complete(s, p) for p in PROMPTS]
        time.sleep(2)
        (g,) = admin_groups(s)
        assert g["state"] == "READY" and g["verdicts"] == []
        assert got != want  # wrong tokens, served as if nothing happened
        # on demand, the canary's first answer is only a reference: it cannot know either
        r = httpx.get(s.url + "/health/generate", timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "ok"
    finally:
        stop_server(s.proc)
