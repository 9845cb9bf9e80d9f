"""The FP8 KV cache (`--kv-cache-dtype fp8_e4m3`) on the small random Qwen3-MoE, float32, CPU.

Two references: the same model with a float32 cache (what FP8 costs: the rounding of K and V
to 3 mantissa bits), and transformers' float32 model whose attention rounds K and V to e4m3 the
same way (clamp to +-448, round to nearest even) before using them (what the FP8 path must
compute: logits within float noise, the same greedy tokens). Greedy tokens against the float32
cache are not asserted: this random model's top logits lie close together, and measured on 8
short prompts (12 tokens each) the two caches' greedy continuations part after 3-8 tokens on 7.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from layouts import CHUNKS as LAYOUT_CHUNKS
from layouts import run_layout
from model_checks import CHUNKS, TABLE, load_ours, paged_logits
from seeds import seeded
from serving import free_port

from safeserve.config import ServerArgs
from safeserve.engine.engine import Engine
from safeserve.engine.kv_cache import kv_cache_dtype
from safeserve.engine.rank_setup import num_kv_blocks
from safeserve.kernels.kv_quant import KV_FP8, to_cache
from safeserve.messages import SamplingParams
from safeserve.model.loader import load_model_config
from safeserve.model.registry import kv_spec
from safeserve.parallel.layout import Layout

# Measured on this model (29 tokens: a chunked prefill, then decode steps; three seeds): the FP8
# cache moves the logits by 4.2-7.5 % of their norm against a float32 cache (largest element
# 0.13-0.53 of logits up to 2.8; a random 64-wide model, whose top-2 routing flips under the
# rounding at some positions, up to 22 % there); against transformers rounding K and V the same
# way by float noise only (largest element 1.3e-6). The asserted bounds keep a margin.
FP8_VS_FLOAT32_REL = 0.15
FP8_VS_FAKE_QUANT_ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return to_cache(x, KV_FP8).to(x.dtype)


@pytest.fixture(scope="module")
def fake_quant_hf(checkpoint: Path) -> Iterator:
    """transformers' float32 model whose eager attention takes K and V rounded to e4m3."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    plain = m.eager_attention_forward

    def rounded(module, query, key, value, *args, **kw):  # type: ignore[no-untyped-def]
        return plain(module, query, _e4m3(key), _e4m3(value), *args, **kw)

    hf = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(m, "eager_attention_forward", rounded)
        yield hf


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=seeded(seed)).tolist()


def test_fp8_cache_logits_against_float32_and_rounded_references(
    checkpoint: Path, fake_quant_hf
) -> None:
    net = load_ours(checkpoint)
    ids = _ids(sum(CHUNKS), 1)
    with torch.no_grad():
        fp8 = paged_logits(net, ids, CHUNKS, 4, TABLE, dtype=KV_FP8)
        full = paged_logits(net, ids, CHUNKS, 4, TABLE, dtype=torch.float32)
        rounded = fake_quant_hf(torch.tensor([ids])).logits[0]
    assert torch.isfinite(fp8).all()
    rel = ((fp8 - full).norm() / full.norm()).item()
    assert 1e-4 < rel < FP8_VS_FLOAT32_REL  # the cache really is rounded, and not by much
    torch.testing.assert_close(fp8, rounded, atol=FP8_VS_FAKE_QUANT_ATOL, rtol=0)


def test_fp8_engine_greedy_equals_rounded_transformers(
    checkpoint: Path, fake_quant_hf, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine (chunked prefill, batched decode, block size 4) with an FP8 cache generates
    what transformers rounding K and V the same way generates, token for token; its start-up
    line names the cache dtype."""
    with caplog.at_level(logging.INFO, logger="safeserve.engine.engine"):
        engine = Engine(
            ServerArgs(
                model=str(checkpoint),
                kv_cache_dtype="fp8_e4m3",
                block_size=4,
                max_model_len=48,
                chunked_prefill_size=6,
                max_num_batched_tokens=16,
            )
        )
    assert engine.runner.kv.layers[0][0].dtype == KV_FP8
    tokens = engine.num_blocks * 4
    assert f"({tokens} tokens, " in caplog.text and "cache dtype float8_e4m3fn)" in caplog.text
    prompts = [_ids(n, 7 + n) for n in (1, 5, 13)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0.0))
    outs: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            for _ in range(12):
                nxt = fake_quant_hf(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        want = ids[0, len(p) :].tolist()
        eos = next((j for j, t in enumerate(want) if t in engine.eos_token_ids), len(want))
        assert outs[str(i)] == want[:eos], f"prompt {i}"


def test_fp8_cache_tp2_ep2_alltoall_matches_one_rank(checkpoint: Path) -> None:
    """Two ranks (kv heads split between them, experts over the all-to-all) with an FP8 cache
    give the logits one rank gives with an FP8 cache."""
    net = load_ours(checkpoint)
    seqs = [_ids(n, 20 + n) for n in (14, 9)]
    got = run_layout(
        checkpoint,
        "tp2-ep2-alltoall",
        seqs,
        LAYOUT_CHUNKS,
        free_port(),
        server_kw={"kv_cache_dtype": "fp8_e4m3"},
    )
    assert got
    with torch.no_grad():
        one = {i: paged_logits(net, s, [len(s)], 4, list(range(8)), dtype=KV_FP8) for i, s in
               enumerate(seqs)}  # fmt: skip
    for (i, pos), row in got.items():
        torch.testing.assert_close(row, one[i][pos], atol=FP8_VS_FAKE_QUANT_ATOL, rtol=0)


@pytest.mark.parametrize("dtype,factor", [("float32", 4), ("bfloat16", 2)])
def test_same_memory_holds_more_fp8_blocks(checkpoint: Path, dtype: str, factor: int) -> None:
    spec = kv_spec(load_model_config(str(checkpoint)), Layout())
    blocks = {}
    for kv in ("auto", "fp8"):
        args = ServerArgs(
            model=str(checkpoint),
            dtype=dtype,
            kv_cache_dtype=kv,
            kv_cache_memory_gb=3 / 1024,  # 3 MiB: whole float32 blocks (12 KiB each)
            max_running_requests=1000,
        )
        assert args.kv_cache_dtype == ("auto" if kv == "auto" else "fp8_e4m3")  # the alias
        blocks[kv] = num_kv_blocks(args, spec, torch.device("cpu"), 4096)
    assert kv_cache_dtype(args) == KV_FP8
    assert blocks["fp8"] == 3 * 2**20 // (16 * spec.token_bytes(1))  # one byte an element
    assert blocks["fp8"] == factor * blocks["auto"]
