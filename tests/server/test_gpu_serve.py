"""The server on CUDA, decoding through CUDA graphs: one rank, a 2-rank alltoall group with
attention data-parallel, and 2-rank tensor-parallel groups with the `none` and the `alltoall`
backend (alltoall dispatches as `none` inside the graphs)."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "layout",
    [
        [],
        ["--tp-size", "2", "--moe-a2a-backend", "alltoall", "--enable-dp-attention"],
        ["--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "none"],
        ["--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "alltoall"],
    ],
)
def test_serves_on_cuda_and_matches_float32_single_rank(server_factory, checkpoint, layout) -> None:
    if torch.cuda.device_count() < (2 if layout else 1):
        pytest.skip("not enough GPUs")
    base = ["--model", str(checkpoint), "--device", "cuda", "--num-kv-blocks", "256"]
    outs = {}
    for name, extra in (("gpu", layout), ("cpu-ref", None)):
        if extra is None:
            s = server_factory(["--model", str(checkpoint)])
        else:
            s = server_factory(base + extra)
            time.sleep(1.0)  # heartbeats (every 0.25 s) carry the warm-up's replays by now
            before = _replays(s)
            before_pw = _piecewise(s)
        body = {
            "model": str(checkpoint),
            "prompt": "The quick brown fox",
            "max_tokens": 16,
            "temperature": 0,
            "return_token_ids": True,
        }
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        outs[name] = r.json()["choices"][0]["token_ids"]
        if extra is not None:
            # The first token comes from the prefill, each other one from a decode step: a CUDA
            # graph replay on every rank (with DP attention also on the rank that holds no
            # sequence: it replays padding, so the all-gathers match). Heartbeats carry the
            # count, so wait for the last one.
            decode_steps = len(outs[name]) - 1
            want = [n + decode_steps for n in before]
            deadline = time.monotonic() + 10
            while (after := _replays(s)) != want and time.monotonic() < deadline:
                time.sleep(0.2)
            assert after == want and decode_steps > 0
            # The prompt's prefill: one piecewise replay per rank.
            assert _piecewise(s) == [n + 1 for n in before_pw]
    assert outs["gpu"] == outs["cpu-ref"]


def _replays(server) -> list:  # type: ignore[no-untyped-def]
    (group,) = httpx.get(server.admin_url + "/admin/groups").json()["groups"]
    return [r["cuda_graph_replays"] for r in group["ranks"]]


def _piecewise(server) -> list:  # type: ignore[no-untyped-def]
    (group,) = httpx.get(server.admin_url + "/admin/groups").json()["groups"]
    return [r["piecewise_graph_replays"] for r in group["ranks"]]
