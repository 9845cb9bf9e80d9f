"""The plan's GPU sizing: a case worked by hand, and the same numbers from the code a serve rank
runs at start-up (`engine/rank_setup.py`: `num_kv_blocks`, `admission_buffers`) when the device
reports the memory the plan assumes (its size, less the calibration's `runtime_bytes` and the
weights). The CPU path against real servers: `test_plan_serve.py`."""

from __future__ import annotations

import pytest
import torch

from safeserve.config import ServerArgs
from safeserve.engine import rank_setup
from safeserve.guards.admission import DispatchBuffers
from safeserve.guards.prefill_sizing import PrefillSizer
from safeserve.model import registry
from safeserve.model.checkpoint import load_model_config
from safeserve.plan.gpus import load_gpu
from safeserve.plan.model import ModelFacts
from safeserve.plan.planner import Candidate, Workload, size_rank

WORK = Workload([1, 64], 512, 128)


def test_qwen3_on_one_h200_by_hand() -> None:
    """Qwen3-30B-A3B, bf16, one H200, serve's default flags."""
    cfg = load_model_config("kernels/configs/qwen3-30b-a3b")
    facts = ModelFacts(cfg, 2)
    gpu = load_gpu("h200")
    cand = Candidate(1, False, 8)  # 8x EP1 on 8 GPUs
    rb = facts.rank_bytes(cand.layout())
    # per layer: q 2048x4096, k and v 2048x512, o 4096x2048, q/k norms 2x128, two layer norms
    # 2x2048, router 128x2048, 128 experts of 3 x 2048x768; plus embedding and LM head
    # (untied) 2 x 151936x2048 and the final norm
    layer = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128 + 2 * 2048
    layer += 128 * 2048 + 128 * 3 * 2048 * 768
    params = 48 * layer + 2 * 151936 * 2048 + 2048
    assert params == 30_532_122_624
    assert rb.total == 2 * params == 61_064_245_248
    assert rb.kv_token == 48 * 2 * 4 * 128 * 2  # layers x (K, V) x KV heads x head dim x bf16
    s = size_rank(facts, cand, gpu, ServerArgs(dtype="bfloat16"), WORK, rb)
    assert s.per_block == 16 * 98_304 == 1_572_864
    # free = H200's 150,109,880,320 - runtime 852,922,368 - weights 61,064,245,248
    assert s.free_after_weights == 88_192_712_704
    # KV budget = free - 0.15 x 150,109,880,320 (--mem-fraction-static 0.85) = 65,676,230,656
    # = 41,755 blocks of 1,572,864 and 1,294,336 bytes over (serve allocated 41,755 on an H200:
    # kernels/RESULTS.md)
    assert s.kv_blocks == 41_755
    assert s.kv_tokens == 668_080
    # each of the 8 groups: 41,755 blocks // 40 per request (512 + 128 tokens)
    assert s.max_concurrency == 8 * 1043
    # a received row: 2 x 2 x 2048 + 8 x 8 routing + 8 choices x 2 x (3 x 768 + 2048) = 77,888;
    # half of what the KV cache leaves, 11,258,888,192 bytes, holds 144,552 of them, capped at
    # one step of the one attention group's 2048 tokens
    assert s.recv_row_bytes == 77_888
    assert s.dispatch_budget == 2048
    # the buffers per budget row: 2 x (4 x 2048 + 3 x 768) + 8 x 8
    assert s.dispatch_buffer_bytes == 2048 * 21_056
    assert s.prefill is not None and s.prefill.chunk == 2048


CASES = [
    ("kernels/configs/qwen3-30b-a3b", Candidate(1, False, 1), {}),
    ("kernels/configs/qwen3-30b-a3b", Candidate(8, True, 1), {}),
    ("kernels/configs/qwen3-30b-a3b", Candidate(4, False, 2), {"max_running_requests": 512}),
    ("kernels/configs/qwen3-30b-a3b-24-layers", Candidate(2, True, 4), {}),
    ("kernels/configs/mixtral-8x7b", Candidate(1, False, 1), {"max_model_len": 4096}),
    ("kernels/configs/mixtral-8x7b", Candidate(8, False, 1), {"mem_fraction_static": 0.7}),
    ("kernels/configs/moonlight-16b-a3b", Candidate(4, True, 2), {"max_num_batched_tokens": 64}),
    # a budget that memory bounds, not a step's tokens
    ("kernels/configs/qwen3-30b-a3b", Candidate(1, False, 1), {"max_num_batched_tokens": 10**6}),
]


@pytest.mark.parametrize("model,cand,flags", CASES)
def test_a_gpu_rank_sizes_itself_as_the_plan_says(
    model: str, cand: Candidate, flags: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_model_config(model)
    facts = ModelFacts(cfg, 2)
    gpu = load_gpu("h200")
    assert gpu.calibration is not None
    args = ServerArgs(dtype="bfloat16", device="cuda", **flags)
    layout = cand.layout()
    rb = facts.rank_bytes(layout)
    want = size_rank(facts, cand, gpu, args, WORK, rb)

    # the device as the plan assumes it after the weights are loaded
    free = [gpu.memory_bytes - gpu.calibration.runtime_bytes - rb.total]
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free[0], gpu.memory_bytes))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: rb.total)
    device = torch.device("cuda", 0)
    max_model_len = args.max_model_len or cfg.max_position_embeddings
    spec = registry.kv_spec(cfg, layout)
    blocks = rank_setup.num_kv_blocks(args, spec, device, max_model_len)
    assert blocks == want.kv_blocks
    assert blocks * args.block_size == want.kv_tokens
    assert spec.token_bytes(2) * args.block_size == want.per_block

    free[0] -= blocks * want.per_block  # the KV cache allocated
    allocate = DispatchBuffers.allocate.__func__  # type: ignore[attr-defined]

    def on_meta(cls, budget, hidden, width, k, dtype, device):  # type: ignore[no-untyped-def]
        return allocate(cls, budget, hidden, width, k, dtype, torch.device("meta"))

    monkeypatch.setattr(DispatchBuffers, "allocate", classmethod(on_meta))
    buffers = rank_setup.admission_buffers(args, cfg, layout, device, lambda x: x)
    assert buffers is not None
    assert buffers.max_recv_tokens == want.dispatch_budget
    assert buffers.nbytes == want.dispatch_buffer_bytes
    # the leader's prefill sizing from what the group reports (`engine/engine.py`)
    guards = rank_setup.guard_sizing(buffers, cfg, layout)
    sizer = PrefillSizer(
        args.prefill_sizing,
        guards.dispatch_budget_tokens,
        layout.dp_size,
        args.max_num_batched_tokens,
        args.chunked_prefill_size,
    )
    assert sizer.sizing == want.prefill
    if flags.get("max_num_batched_tokens") == 10**6:  # the case memory bounds
        assert want.dispatch_budget < 10**6
