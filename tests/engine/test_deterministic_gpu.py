"""--enable-deterministic-inference on CUDA (bf16, CUDA graphs on): a request's logits are the
same bits whatever else is in the step, whether its prompt is prefilled whole, in chunks or
beside decodes, and whatever graph bucket pads its step; and a continuation (the prompt plus
the tokens produced so far, prefilled at once, as a migrated request is) gives the logits the
decode steps gave, to the bit, so the continuation goes on exactly. The families with
grouped-query attention, small random checkpoints written by transformers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from seeds import seeded

from safeserve.config import ServerArgs
from safeserve.engine.plan import SeqPlan, StepPlan
from safeserve.messages import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
STEPS = 10  # tokens generated per request
BLOCK = 4


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe"])
def runner(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    from safeserve.engine.model_runner import ModelRunner
    from safeserve.kernels import common

    out = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_moe":
        from checkpoints import write_qwen3_moe_checkpoint

        model: Path = write_qwen3_moe_checkpoint(out, seed=5)
    else:
        import checkpoints_families

        model = getattr(checkpoints_families, f"write_{request.param}_checkpoint")(out, seed=5)
    args = ServerArgs(
        model=str(model),
        device="cuda",
        dtype="bfloat16",
        num_kv_blocks=512,
        block_size=BLOCK,
        max_model_len=128,
        max_running_requests=8,
        cuda_graph_max_bs=8,
        enable_deterministic_inference=True,
    )
    r = ModelRunner(args)
    assert r.cuda_graphs is not None
    yield r
    common.set_batch_invariant(False)


@dataclass
class Seq:
    """A request: its prompt, its blocks, what it computed, and each sampled step's logits."""

    prompt: list[int]
    table: list[int]
    done: int = 0  # tokens in the cache
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


class Blocks:
    def __init__(self) -> None:
        self.next = 0

    def take(self, tokens: int) -> list[int]:
        n = (tokens + BLOCK - 1) // BLOCK
        self.next += n
        return list(range(self.next - n, self.next))


def _step(runner, work: list[tuple[Seq, int]]) -> None:  # type: ignore[no-untyped-def]
    """One step: each (seq, n) computes its next n tokens; a seq whose tokens then reach its
    end samples (greedy), and its logits row is kept."""
    plans, sampling = [], []
    for seq, n in work:
        ids = seq.tokens[seq.done : seq.done + n]
        samples = seq.done + n == len(seq.tokens)
        plans.append(SeqPlan(ids, seq.done, seq.table, GREEDY if samples else None))
        if samples:
            sampling.append(seq)
        seq.done += n
    step = getattr(runner, "_test_step", 0) + 1
    runner._test_step = step
    logits, _ = runner.run_plan(StepPlan(step=step, per_rank=[plans]))
    assert (logits is None) == (not sampling)
    for row, seq in enumerate(sampling):
        seq.logits.append(logits[row].float().cpu())
        seq.out.append(int(logits[row].argmax()))


def _prompts(seed: int) -> list[list[int]]:
    gen = seeded(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 9, 40, 17, 5)]


def test_logits_do_not_depend_on_the_batch_and_continuations_are_exact(runner) -> None:  # type: ignore[no-untyped-def]
    blocks = Blocks()
    prompts = _prompts(3)
    room = max(len(p) for p in prompts) + STEPS + 8
    # each request alone: its prompt in one step, then one decode step per token
    alone = [Seq(p, blocks.take(room)) for p in prompts]
    for seq in alone:
        _step(runner, [(seq, len(seq.prompt))])
        while len(seq.out) < STEPS:
            _step(runner, [(seq, 1)])
    # together: request i joins at step 2 i (its prefill beside the others' decodes), the
    # 40-token prompt in chunks of 16 and 24, batches of 1 to 5 rows in graph buckets
    together = [Seq(p, blocks.take(room)) for p in prompts]
    step = 0
    while any(len(s.out) < STEPS for s in together):
        work = []
        for i, seq in enumerate(together):
            if step < 2 * i or len(seq.out) >= STEPS:
                continue
            if seq.done < len(seq.prompt):
                left = len(seq.prompt) - seq.done
                work.append(
                    (seq, min(left, 16) if len(seq.prompt) == 40 and seq.done == 0 else left)
                )
            else:
                work.append((seq, 1))
        if work:
            _step(runner, work)
        step += 1
    for i, (a, t) in enumerate(zip(alone, together, strict=True)):
        assert t.out == a.out, i
        for j, (x, y) in enumerate(zip(a.logits, t.logits, strict=True)):
            assert not x.isnan().any()
            assert torch.equal(x, y), (i, j, (x - y).abs().max().item())
    # continuations: a prompt plus its first m outputs prefilled at once (as a migrated request
    # is; here three in one step), then decoded together: the same logits as the uninterrupted
    # run, to the bit
    picks = ((1, 4), (2, 7), (4, 1))
    conts = [Seq(alone[i].prompt + alone[i].out[:m], blocks.take(room)) for i, m in picks]
    _step(runner, [(c, len(c.prompt)) for c in conts])
    while any(len(c.out) < STEPS - m for c, (_, m) in zip(conts, picks, strict=True)):
        _step(
            runner,
            [(c, 1) for c, (_, m) in zip(conts, picks, strict=True) if len(c.out) < STEPS - m],
        )
    for c, (i, m) in zip(conts, picks, strict=True):
        assert c.out == alone[i].out[m:], i
        for j, x in enumerate(c.logits):
            assert torch.equal(x, alone[i].logits[m + j]), (i, m, j)
