"""EPLB through the admin API and /metrics, on real 4-rank groups (EP4, `none` backend, attention
data-parallel) serving a checkpoint whose router favours a few experts:

- a server with redundant experts records the expert distribution, rebalances under traffic
  (outputs, streamed and not, equal transformers' greedy continuations throughout), shows the
  rebalance in GET /admin/eplb, /admin/groups, `oncall describe group` and /metrics, and dumps the
  distribution to a file;
- a server restarted with `--init-expert-location` on that file starts balanced: its measured
  balancedness beats the trivial placement's from its first passes, and with the threshold below
  it every check is skipped, the reason shown in GET /admin/eplb;
- bad admin requests get a clear 4xx and change nothing.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from checkpoints import greedy_continuations, skew_router, write_qwen3_moe_checkpoint
from seeds import seeded
from serving import (
    Server,
    admin_groups,
    concurrent_completions,
    metric,
    oncall,
    start_server,
    stop_server,
    stream_completion,
)

pytestmark = pytest.mark.slow

# Attention data-parallel: each rank routes its own requests' tokens, so an expert's replicas
# share its load (each rank sends to its own replica first).
GROUP = ["--tp-size", "4", "--ep-size", "4", "--moe-a2a-backend", "none", "--enable-dp-attention"]
REDUNDANT = ["--enable-eplb", "--ep-num-redundant-experts", "4"]
MAX_TOKENS = 12
MOE_LAYERS = 2  # the test checkpoint's layers 0 and 2 (layer 1 is dense)


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_moe_checkpoint(
        tmp_path_factory.mktemp("eplb-admin"), seed=4, init=skew_router
    )


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = seeded(seed)
    return [torch.randint(0, 300, (4 + i % 7,), generator=gen).tolist() for i in range(n)]


ROUNDS = {name: _prompts(n, seed) for name, n, seed in (("a", 3, 1), ("b", 8, 2), ("c", 6, 3))}


@pytest.fixture(scope="module")
def reference(skewed: Path) -> dict[str, list[list[int]]]:
    return {k: greedy_continuations(skewed, p, MAX_TOKENS) for k, p in ROUNDS.items()}


def _serve_round(s: Server, prompts: list[list[int]], want: list[list[int]]) -> None:
    """Half the prompts streamed, half not, all at once; each equals its reference."""
    streamed: dict[int, tuple[list[int], str | None]] = {}

    def one(i: int) -> None:
        streamed[i] = stream_completion(s, prompts[i], MAX_TOKENS)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(0, len(prompts), 2)]
    for t in threads:
        t.start()
    plain = concurrent_completions(
        s, "tiny", prompts[1::2], MAX_TOKENS, timeout=180, ignore_eos=True
    )
    for t in threads:
        t.join(timeout=180)
    for i, (ids, error) in streamed.items():
        assert error is None and ids == want[i], f"streamed prompt {i}: {error}"
    for k, r in enumerate(plain):
        i = 2 * k + 1
        assert r.choices[0].token_ids == want[i], f"prompt {i}"


def _eplb(s: Server) -> dict:
    """The group's EPLB status (waiting for the group's first report after READY)."""
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(s.admin_url + "/admin/eplb", timeout=10)
        assert r.status_code == 200, r.text
        (g,) = r.json()["groups"]
        if g["eplb"] is not None or time.monotonic() > deadline:
            return g["eplb"]
        time.sleep(0.1)


def _balance(s: Server) -> float:
    (g,) = admin_groups(s)
    return g["eplb_balancedness"]["100"]


def _post(s: Server, path: str, **kw: object) -> httpx.Response:
    return httpx.post(s.admin_url + path, timeout=60, **kw)  # type: ignore[arg-type]


def test_rebalance_dump_and_a_restart_that_starts_balanced(
    skewed: Path, reference: dict, tmp_path: Path
) -> None:
    dump = tmp_path / "distribution.json"
    args = ["--model", str(skewed), "--served-model-name", "tiny", *GROUP, *REDUNDANT]
    # the first round's passes stay under the interval (3 requests of 12 tokens: 36 passes at the
    # most, one request after another): its balancedness is the trivial placement's
    s = start_server([*args, "--eplb-rebalance-num-iterations", "40"], tmp_path / "a.log")
    try:
        st = _eplb(s)
        assert st["enabled"] and st["num_physical"] == 12 and st["slots_per_rank"] == 3
        assert st["rebalances"] == 0 and st["last"] is None and not st["overdue"]
        # dump before any recording: refused, nothing written
        r = _post(s, "/admin/expert_distribution/dump", json={"path": str(dump)})
        assert r.status_code == 409 and "no recording" in r.json()["error"]["message"]
        assert not dump.exists()
        r = _post(s, "/admin/expert_distribution/start")
        assert r.status_code == 200 and r.json() == {"ok": True, "recording": True, "groups": [0]}

        _serve_round(s, ROUNDS["a"], reference["a"])
        trivial = _balance(s)
        st = _eplb(s)
        assert st["rebalances"] == 0 and st["last"] is None and st["passes_since_check"] > 0
        # rounds until the passes cross the interval and a rebalance has moved experts (how many
        # passes a round takes depends on how its requests' arrivals interleave), then one more
        # on the new placement
        for _ in range(6):
            _serve_round(s, ROUNDS["b"], reference["b"])
            if _eplb(s)["rebalances"] >= 1:
                break
        _serve_round(s, ROUNDS["c"], reference["c"])
        st = _eplb(s)
        assert st["rebalances"] >= 1 and st["moved_bytes_total"] > 0, st
        done = st["last_rebalance"]
        assert done["outcome"] == "rebalanced" and done["layers_moved"] >= 1
        assert done["balancedness_predicted"] > done["balancedness_before"]
        assert metric(s, "safeserve:eplb_rebalances_total") == st["rebalances"]
        assert metric(s, "safeserve:eplb_moved_bytes_total") == st["moved_bytes_total"]
        assert metric(s, "safeserve:eplb_rebalance_interval_passes") == 40
        desc = oncall(s, "describe", "group", "0")
        assert desc.returncode == 0, desc.stderr
        assert f"{st['rebalances']} rebalances" in desc.stdout and "last rebalance" in desc.stdout

        r = httpx.get(s.admin_url + "/admin/eplb/map", timeout=30)
        assert r.status_code == 200, r.text
        placed = r.json()
        assert placed["format"] == "safeserve-expert-map" and len(placed["phy2log"]) == MOE_LAYERS
        assert all(sorted(set(row)) == list(range(8)) for row in placed["phy2log"])

        r = _post(s, "/admin/expert_distribution/dump", json={"path": str(dump)})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["path"] == str(dump) and body["passes"] > 0 and body["recording"]
        counts = body["logical_count"]
        assert len(counts) == MOE_LAYERS and all(len(row) == 8 for row in counts)
        # every routed (token, expert) pair of the rounds: 2 a token, in every MoE layer
        assert len({sum(row) for row in counts}) == 1 and sum(counts[0]) > 0
        assert json.loads(dump.read_text())["logical_count"] == counts
        r = _post(s, "/admin/expert_distribution/stop")
        assert r.status_code == 200 and r.json()["recording"] is False
    finally:
        stop_server(s.proc)
    print(f"balancedness (last 100 passes): trivial placement {trivial:.3f}")

    restarted = [
        *args,
        "--init-expert-location",
        str(dump),
        "--eplb-rebalance-num-iterations",
        "12",
        # below what a balanced placement measures even over a few small passes (a decode pass
        # of one or two requests cannot load four ranks evenly)
        "--eplb-min-rebalancing-utilization-threshold",
        "0.3",
    ]
    s = start_server(restarted, tmp_path / "b.log")
    try:
        _serve_round(s, ROUNDS["a"], reference["a"])  # the workload the trivial value came from
        balanced = _balance(s)
        _serve_round(s, ROUNDS["c"], reference["c"])
        st = _eplb(s)
        assert st["rebalances"] == 0 and st["skipped"] >= 1 and st["moved_bytes_total"] == 0
        assert st["last"]["outcome"] == "skipped"
        assert "above --eplb-min-rebalancing-utilization-threshold 0.3" in st["last"]["reason"]
        assert metric(s, "safeserve:eplb_rebalances_skipped_total") == st["skipped"]
    finally:
        stop_server(s.proc)
    print(f"balancedness (last 100 passes): started from the dump {balanced:.3f}")
    assert balanced > trivial + 0.05 and balanced > 0.5


def test_bad_eplb_admin_requests(server_factory) -> None:  # type: ignore[no-untyped-def]
    """On the tiny model (one EP rank, no EPLB): clear errors, nothing recorded."""
    s = server_factory(["--model", "tiny"])
    r = _post(s, "/admin/expert_distribution/begin")
    assert r.status_code == 404 and "start, stop, dump" in r.json()["error"]["message"]
    r = _post(s, "/admin/expert_distribution/start")
    assert r.status_code == 409 and "--enable-eplb" in r.json()["error"]["message"]
    r = _post(s, "/admin/expert_distribution/dump", json={"path": "relative.json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    r = _post(s, "/admin/expert_distribution/dump", json={"where": "/tmp/x"})
    assert r.status_code == 400
    r = httpx.get(s.admin_url + "/admin/eplb/map?group=7", timeout=10)
    assert r.status_code == 400 and "READY groups [0]" in r.json()["error"]["message"]
    (g,) = httpx.get(s.admin_url + "/admin/eplb", timeout=10).json()["groups"]
    assert g["eplb"]["enabled"] is False and g["eplb"]["rebalances"] == 0
