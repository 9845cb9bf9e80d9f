"""One trace per model family for the engine-against-reference checks: a small random checkpoint
of the family written by transformers, three prompts prefilled together, then ten steps of
decodes with one mixed step, the logits of every step recorded (`trace`), and transformers'
logits at the same rows (`reference_rows`: the whole sequences through the Hugging Face model,
each row taken at the position the engine's row predicts from)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from seeds import seeded

from safeserve.engine.plan import SeqPlan, StepPlan
from safeserve.messages import SamplingParams

FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3"]
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
STEPS = 10
MIXED_STEP = 6  # sequence 1 takes two extra tokens then: a prefill chunk beside the decodes
PROMPT_LENS = (9, 1, 17)
TABLES = [[3, 7, 1, 12, 40, 41, 42], [20, 21, 22, 23, 24], [5, 0, 9, 30, 31, 32, 33]]

# Overrides that route every token to every expert: no top-k choice is left that a rounding
# can flip (DeepSeek-V3: every group, every expert). Each sets the expert count with the top k.
EVERY_EXPERT: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=8),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=8),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=8),
    "deepseek_v3": dict(n_routed_experts=12, num_experts_per_tok=12, n_group=4, topk_group=4),
}


def write_family(family: str, out: Path, every_expert: bool = False) -> Path:
    """The family's small test checkpoint (seed 5 plus the run's offset) in `out`;
    `every_expert`: with `EVERY_EXPERT`'s routing."""
    overrides = EVERY_EXPERT[family] if every_expert else {}
    if family == "qwen3_moe":
        from checkpoints import write_qwen3_moe_checkpoint

        return write_qwen3_moe_checkpoint(out, seed=5, **overrides)
    if family == "deepseek_v3":
        from checkpoints_deepseek_v3 import write_deepseek_v3_checkpoint

        return write_deepseek_v3_checkpoint(out, seed=5, **overrides)
    import checkpoints_families

    return getattr(checkpoints_families, f"write_{family}_checkpoint")(out, seed=5, **overrides)


def prompts() -> list[list[int]]:
    gen = seeded(4)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _step_ids(step: int, last: list[int], i: int) -> list[int]:
    return [last[i]] + ([11, 31] if step == MIXED_STEP and i == 1 else [])


def trace(runner, forced: list[list[int]] | None = None, steps: int = STEPS):  # type: ignore[no-untyped-def]
    """The logits of every step ([3, vocab] each, float32 on CPU) and the tokens fed back (the
    greedy ones, or `forced`, so that two runners compare on the same inputs even where their
    argmax differs); `steps` decode steps after the prefill (the mixed one is step 6)."""
    seqs = [SeqPlan(p, 0, t, GREEDY) for p, t in zip(prompts(), TABLES, strict=True)]
    logits, _ = runner.run_plan(StepPlan(step=0, per_rank=[seqs]))
    out, fed = [logits.float().cpu()], []
    lens = list(PROMPT_LENS)
    for step in range(1, steps + 1):
        last = forced[step - 1] if forced else logits.argmax(-1).tolist()
        fed.append(last)
        ids = {i: _step_ids(step, last, i) for i in range(3)}
        plan = [SeqPlan(ids[i], lens[i], TABLES[i], GREEDY, step) for i in range(3)]
        logits, _ = runner.run_plan(StepPlan(step=step, per_rank=[plan]))
        out.append(logits.float().cpu())
        for i in range(3):
            lens[i] += len(ids[i])
    return out, fed


def reference_rows(
    checkpoint: Path, fed: list[list[int]], dtype: torch.dtype, device: str
) -> list[torch.Tensor]:
    """transformers' logits (`dtype` on `device`) at the rows `trace` records when fed `fed`:
    one [3, vocab] float32 tensor on CPU per step."""
    from transformers import AutoModelForCausalLM

    seqs = prompts()
    rows = [[len(s) - 1 for s in seqs]]
    for step, last in enumerate(fed, start=1):
        for i in range(3):
            seqs[i] += _step_ids(step, last, i)
        rows.append([len(s) - 1 for s in seqs])
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval().to(device)
    with torch.no_grad():
        full = [hf(torch.tensor([s], device=device)).logits[0].float().cpu() for s in seqs]
    return [torch.stack([full[i][r[i]] for i in range(3)]) for r in rows]


def kernel_switches() -> dict[str, Any]:
    """Every loaded module of the package that imported the `use_kernels` switch, by name (a
    runner built first has loaded them all): each decides on its own name's binding."""
    import sys

    return {
        name: m
        for name, m in sorted(sys.modules.items())
        if name.startswith("safeserve.")
        and callable(fn := getattr(m, "use_kernels", None))
        and fn.__module__ != name  # not where it is defined
    }


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    """Every row's |got - want| / |want|, sorted."""
    e: list[float] = []
    for a, b in zip(got, want, strict=True):
        e += ((a - b).norm(dim=-1) / b.norm(dim=-1)).tolist()
    return sorted(e)
