"""The server on CUDA: one rank, and a 2-rank alltoall group with attention data-parallel."""

from __future__ import annotations

import httpx
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "layout", [[], ["--tp-size", "2", "--moe-a2a-backend", "alltoall", "--enable-dp-attention"]]
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
    assert outs["gpu"] == outs["cpu-ref"]
