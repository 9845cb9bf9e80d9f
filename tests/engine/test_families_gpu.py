"""Every model family on CUDA (its kernels where it has them, CUDA graphs where they apply)
against the same checkpoint on the CPU float32 engine: float32 logits within 1e-4 through
prefill, decode and mixed steps; and bf16 on CUDA (graphs on) against float32 on CUDA, fed the
same tokens: never NaN, the median token within 2e-2 and three tokens in four within 3e-2. A
bf16 rounding can flip a routing choice between two near-tied experts; the token's hidden state
then differs in every later layer and in the KV entries later tokens read, so a few tokens of a
small random model land at 0.1-0.5 relative error. A wrong kernel or a wrong dtype on any path
moves every token, and the median with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_checks import small_runner
from seeds import seeded

from safeserve.engine.plan import SeqPlan, StepPlan
from safeserve.messages import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def _write(family: str, out: Path) -> Path:
    if family == "qwen3_moe":
        from checkpoints import write_qwen3_moe_checkpoint

        return write_qwen3_moe_checkpoint(out, seed=5)
    if family == "deepseek_v3":
        from checkpoints_deepseek_v3 import write_deepseek_v3_checkpoint

        return write_deepseek_v3_checkpoint(out, seed=5)
    import checkpoints_families

    return getattr(checkpoints_families, f"write_{family}_checkpoint")(out, seed=5)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3"])
def checkpoint(request, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return _write(request.param, tmp_path_factory.mktemp(request.param))


def _trace(runner, forced: list[list[int]] | None = None):  # type: ignore[no-untyped-def]
    """Three prompts prefilled together, then 10 steps of decodes, with one mixed step; the
    logits of every step and the tokens fed back (the greedy ones, or `forced`, so that two
    runners compare on the same inputs even where their argmax differs)."""
    gen = seeded(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 1, 17)]
    tables = [[3, 7, 1, 12, 40, 41, 42], [20, 21, 22, 23, 24], [5, 0, 9, 30, 31, 32, 33]]
    seqs = [SeqPlan(p, 0, t, GREEDY) for p, t in zip(prompts, tables, strict=True)]
    logits, _ = runner.run_plan(StepPlan(step=0, per_rank=[seqs]))
    trace, fed = [logits.float().cpu()], []
    lens = [len(p) for p in prompts]
    for step in range(1, 11):
        last = forced[step - 1] if forced else logits.argmax(-1).tolist()
        fed.append(last)
        ids = {i: [last[i]] + ([11, 31] if step == 6 and i == 1 else []) for i in range(3)}
        plan = [SeqPlan(ids[i], lens[i], tables[i], GREEDY, step) for i in range(3)]
        logits, _ = runner.run_plan(StepPlan(step=step, per_rank=[plan]))
        trace.append(logits.float().cpu())
        for i in range(3):
            lens[i] += len(ids[i])
    return trace, fed


@pytest.mark.parametrize("graphs", [False, True])
def test_family_on_cuda_matches_cpu_float32(checkpoint: Path, graphs: bool) -> None:
    ref, _ = _trace(small_runner(checkpoint, "cpu", "float32", False))
    cuda = small_runner(checkpoint, "cuda", "float32", graphs)
    # every family's steps run as CUDA graphs where they are on (none ran eagerly instead)
    assert (cuda.cuda_graphs is not None) == graphs
    assert (cuda.piecewise is not None) == graphs
    got, _ = _trace(cuda)
    for a, b in zip(got, ref, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_family_bfloat16_close_to_float32(checkpoint: Path) -> None:
    ref, fed = _trace(small_runner(checkpoint, "cuda", "float32", False))
    got, _ = _trace(small_runner(checkpoint, "cuda", "bfloat16", True), forced=fed)
    errors = []
    for a, b in zip(got, ref, strict=True):
        assert not a.isnan().any()
        errors += ((a - b).norm(dim=-1) / b.norm(dim=-1)).tolist()
    errors.sort()
    assert errors[len(errors) // 2] <= 2e-2, errors
    assert errors[(3 * len(errors)) // 4] <= 3e-2, errors
