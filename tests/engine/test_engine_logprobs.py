"""Sampled and prompt log-probabilities against a full-sequence transformers forward (float32,
1e-4), through chunked prefill and preemption; and on real tp=2 gloo groups (tensor-parallel and
data-parallel attention) together with a request-borne fault that every rank survives."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from seeds import seeded
from serving import free_port
from transformers import AutoModelForCausalLM

from safeserve.config import ServerArgs
from safeserve.engine.engine import Engine
from safeserve.messages import RequestOutput, SamplingParams, TokenLogprob

sys.path.insert(0, str(Path(__file__).parent))  # engine_group, for the spawned ranks too
from engine_group import run_engine_group  # noqa: E402


@pytest.fixture(scope="module")
def hf(checkpoint: Path):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _prompts() -> list[list[int]]:
    gen = seeded(7)
    return [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (3, 17, 9, 1, 12)]


def _params(i: int) -> SamplingParams:
    """A mix: both kinds, only one kind, neither; greedy and seeded sampling."""
    kinds = [(3, 4), (0, 2), (None, 5), (2, 0), (5, None)]
    lp, plp = kinds[i % len(kinds)]
    if i == 2:
        return SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=3, prompt_logprobs=plp)
    return SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=lp, prompt_logprobs=plp
    )


def _cmp(got: TokenLogprob | None, tok: int, row: torch.Tensor, n: int, what: str) -> None:
    assert got is not None, what
    assert got.token_id == tok, what
    assert abs(got.logprob - row[tok].item()) < 1e-4, what
    values, ids = torch.topk(row, n)
    assert [t for t, _ in got.top] == ids.tolist(), what
    torch.testing.assert_close(
        torch.tensor([v for _, v in got.top]), values, atol=1e-4, rtol=0, msg=what
    )


def _check(hf, prompt: list[int], params: SamplingParams, outs: list[RequestOutput]) -> None:
    tokens = [t for o in outs for t in o.new_token_ids]
    seq = prompt + tokens
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
    if params.prompt_logprobs is None:
        assert all(o.prompt_logprobs is None for o in outs)
    else:
        plp = outs[0].prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        assert all(o.prompt_logprobs is None for o in outs[1:])  # once, not again on recompute
        for i in range(1, len(prompt)):
            _cmp(plp[i], prompt[i], ref[i - 1], params.prompt_logprobs, f"prompt {i}")
    if params.logprobs is None:
        assert all(o.logprobs is None for o in outs)
        return
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    assert len(lps) == len(tokens)
    for k, lp in enumerate(lps):
        _cmp(lp, tokens[k], ref[len(prompt) + k - 1], params.logprobs, f"output {k}")


def _by_rid(outputs: list[RequestOutput]) -> dict[str, list[RequestOutput]]:
    out: dict[str, list[RequestOutput]] = {}
    for o in outputs:
        out.setdefault(o.rid, []).append(o)
    return out


@pytest.mark.parametrize(
    "blocks,chunk", [(None, 5), (12, 5), (None, 512)], ids=["chunked", "preempting", "whole"]
)
def test_logprobs_match_a_full_forward(checkpoint: Path, hf, blocks, chunk) -> None:
    args = ServerArgs(
        model=str(checkpoint),
        chunked_prefill_size=chunk,
        num_kv_blocks=blocks,
        block_size=4,
        max_model_len=48,
        max_num_batched_tokens=16,
    )
    engine = Engine(args)
    prompts = _prompts()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, _params(i))
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    if blocks == 12:
        assert engine.scheduler.num_preemptions > 0  # the case really preempted
    outs = _by_rid(outputs)
    for i, p in enumerate(prompts):
        assert outs[str(i)][-1].finish_reason == "length"
        _check(hf, p, _params(i), outs[str(i)])


@pytest.mark.parametrize("layout", ["tp2-ep2-none", "tp2-ep1-none-dp"])
def test_group_survives_a_raise_fault_with_logprobs(checkpoint: Path, hf, layout: str) -> None:
    """Every rank raises in the steps holding the faulty request (before any collective); the
    followers report it through the gather and go on, the leader isolates the request, and the
    others' tokens and log-probabilities are right; the group then shuts down in order."""
    prompts = _prompts()[:4]
    requests = [(str(i), p, _params(i)) for i, p in enumerate(prompts)]
    bad = SamplingParams(max_tokens=12, temperature=0.0, fault="raise", logprobs=1)
    requests.insert(1, ("bad", [4, 5, 6, 7, 8, 9], bad))
    outputs = run_engine_group(
        checkpoint,
        layout,
        requests,
        free_port(),
        num_kv_blocks=64,
        block_size=4,
        max_model_len=48,
        chunked_prefill_size=5,
        max_num_batched_tokens=16,
    )
    outs = _by_rid(outputs)
    assert [o.finish_reason for o in outs["bad"]] == ["error"]
    assert outs["bad"][0].error.startswith("step: RequestFault:")
    single = Engine(
        ServerArgs(
            model=str(checkpoint),
            num_kv_blocks=64,
            block_size=4,
            max_model_len=48,
            chunked_prefill_size=5,
            max_num_batched_tokens=16,
        )
    )
    for i, p in enumerate(prompts):
        single.add_request(str(i), p, _params(i))
    alone = []
    while single.has_work():
        alone.extend(single.step())
    alone_by = _by_rid(alone)
    for i, p in enumerate(prompts):
        got = outs[str(i)]
        assert got[-1].finish_reason == "length"
        tokens = [t for o in got for t in o.new_token_ids]
        assert tokens == [t for o in alone_by[str(i)] for t in o.new_token_ids], i
        _check(hf, p, _params(i), got)
