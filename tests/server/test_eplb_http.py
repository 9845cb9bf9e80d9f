"""EPLB through the HTTP server: 32 streams run on a 4-rank group (EP4, attention data-parallel,
redundant experts; and tensor-parallel attention without them) whose router favours a few experts, while the group rebalances every few
passes and moves expert weights between its ranks. Every stream's tokens equal transformers'
greedy continuation: nothing lost, failed or repeated; the inter-token latency of the streams
is reported against the same run without EPLB."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from checkpoints import greedy_continuations, skew_router, write_qwen3_moe_checkpoint
from seeds import seeded
from serving import Server, sse_chunk, start_server, stop_server

pytestmark = pytest.mark.slow

STREAMS = 32
MAX_TOKENS = 16
GROUP = ["--tp-size", "4", "--moe-a2a-backend", "alltoall", "--enable-dp-attention"]
EPLB = [
    "--enable-eplb",
    "--ep-num-redundant-experts",
    "4",
    "--eplb-rebalance-num-iterations",
    "6",
    "--expert-balancedness-report-mode",
    "both",
]


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_moe_checkpoint(
        tmp_path_factory.mktemp("eplb-http"), seed=3, init=skew_router
    )


def _prompts() -> list[list[int]]:
    gen = seeded(21)
    return [torch.randint(0, 300, (5 + i % 9,), generator=gen).tolist() for i in range(STREAMS)]


def _stream(s: Server, prompt: list[int], out: dict, key: int) -> None:
    """One streamed greedy completion: (token ids, arrival time of each chunk, error)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True, "stream": True}
    ids: list[int] = []
    times: list[float] = []
    error = None
    try:
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                r.read()
                error = f"HTTP {r.status_code}: {r.text}"
            for line in r.iter_lines() if error is None else ():
                chunk = sse_chunk(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    error = str(chunk["error"])
                    break
                for choice in chunk["choices"]:
                    new = choice.get("token_ids") or []
                    if new:
                        ids.extend(new)
                        times.append(time.perf_counter())
    except httpx.HTTPError as e:
        error = repr(e)
    out[key] = (ids, times, error)


def _run_streams(s: Server) -> dict:
    out: dict = {}
    threads = [
        threading.Thread(target=_stream, args=(s, p, out, i)) for i, p in enumerate(_prompts())
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def _p99_itl_ms(out: dict) -> float:
    gaps = [
        (b - a) * 1e3
        for _, times, _ in out.values()
        for a, b in zip(times, times[1:], strict=False)
    ]
    return statistics.quantiles(gaps, n=100)[98]


def _serve(model: Path, extra: list[str], log: Path, group: list[str] = GROUP) -> tuple[dict, str]:
    s = start_server(
        ["--model", str(model), "--served-model-name", "tiny", *group, *extra], log, timeout=180
    )
    try:
        out = _run_streams(s)
    finally:
        stop_server(s.proc)
    return out, log.read_text(errors="replace")


def test_streams_lose_nothing_while_the_group_rebalances(skewed: Path, tmp_path: Path) -> None:
    want = greedy_continuations(skewed, _prompts(), MAX_TOKENS)
    base, _ = _serve(skewed, [], tmp_path / "base.log")
    got, log = _serve(skewed, EPLB, tmp_path / "eplb.log")
    for out in (base, got):
        assert sorted(out) == list(range(STREAMS))
        for i in range(STREAMS):
            ids, _, error = out[i]
            assert error is None, f"stream {i}: {error}"
            assert ids == want[i], f"stream {i}"
    moves = log.count("EPLB rebalance done")
    assert moves >= 1, log[-3000:]
    print(
        f"p99 inter-token latency over {STREAMS} streams: {_p99_itl_ms(got):.1f} ms with EPLB "
        f"({moves} rebalances), {_p99_itl_ms(base):.1f} ms without"
    )


def test_tensor_parallel_attention_without_redundant_experts(skewed: Path, tmp_path: Path) -> None:
    """The other side: every rank routes the same tokens (`none`, tensor-parallel attention)
    and no expert has a replica: the rebalances permute whole experts between ranks."""
    want = greedy_continuations(skewed, _prompts(), MAX_TOKENS)
    group = ["--tp-size", "4", "--moe-a2a-backend", "none", "--ep-size", "4"]
    extra = ["--enable-eplb", "--eplb-rebalance-num-iterations", "6"]
    extra += ["--expert-balancedness-report-mode", "log"]
    got, log = _serve(skewed, extra, tmp_path / "tp.log", group)
    assert sorted(got) == list(range(STREAMS))
    for i in range(STREAMS):
        ids, _, error = got[i]
        assert error is None, f"stream {i}: {error}"
        assert ids == want[i], f"stream {i}"
    assert log.count("EPLB rebalance done") >= 1, log[-3000:]
