"""The front-door faults on CUDA, where decode steps replay CUDA graphs and the Triton kernels
run: two groups sharing one GPU (`--devices 0,0`). A request that makes the ranks raise, and one
whose temperature overflows the logits, cost no group while other streams continue exactly; a
request that exits a rank hard costs at most two group failures and is then refused."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from serving import (
    Server,
    admin_groups,
    metric,
    start_server,
    stop_server,
    stream_completion,
    wait_all_ready,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MAX_TOKENS = 16
PROMPTS = [[5 + (13 * i + 7 * j) % 240 for j in range(5 + i)] for i in range(8)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    log = tmp_path_factory.mktemp("front-door-gpu") / "server.log"
    args = ["--device", "cuda", "--num-groups", "2", "--devices", "0,0", "--num-kv-blocks", "256"]
    s = start_server([*args, "--enable-fault-injection", "--restart-backoff-s", "0.5"], log)
    yield s
    stop_server(s.proc)


def _streams(s: Server, prompts: list[list[int]]) -> list[tuple[list[int], str | None]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: stream_completion(s, p, MAX_TOKENS), prompts))


def test_front_door_faults_on_cuda(server: Server) -> None:
    reference = _streams(server, PROMPTS)
    assert all(err is None and len(ids) == MAX_TOKENS for ids, err in reference), reference
    with ThreadPoolExecutor(len(PROMPTS) + 2) as pool:
        streams = [pool.submit(stream_completion, server, p, MAX_TOKENS) for p in PROMPTS]
        time.sleep(0.3)
        tiny_t = pool.submit(stream_completion, server, PROMPTS[0], MAX_TOKENS, temperature=1e-300)
        raising = pool.submit(
            stream_completion, server, PROMPTS[1], MAX_TOKENS, safeserve_fault="raise"
        )
        assert [f.result() for f in streams] == reference
        assert tiny_t.result() == reference[0]
        assert raising.result()[1] == "internal_error"
    assert metric(server, "safeserve:group_failures_total") == 0

    # Log-probabilities through the graphs: the greedy token is the most likely one.
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json={**body, "logprobs": 2, "echo": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(PROMPTS[2]) + 4 and lp["token_logprobs"][0] is None
    for tok_lp, top in zip(lp["token_logprobs"][-4:], lp["top_logprobs"][-4:], strict=True):
        assert math.isfinite(tok_lp) and tok_lp == pytest.approx(max(top.values()), abs=1e-5)

    # The query of death: at most two group failures, then refused at the edge.
    deadly = stream_completion(server, PROMPTS[3], MAX_TOKENS, safeserve_fault="exit")
    assert deadly[1] == "request_quarantined", deadly
    failures = metric(server, "safeserve:group_failures_total")
    assert 1 <= failures <= 2
    for _ in range(5):
        assert stream_completion(server, PROMPTS[3], MAX_TOKENS, safeserve_fault="exit") == (
            [],
            "request_quarantined",
        )
    assert metric(server, "safeserve:group_failures_total") == failures
    wait_all_ready(server, timeout=180)
    assert not any(g["crash_loop"] for g in admin_groups(server))
    assert _streams(server, PROMPTS) == reference
