"""Where a small random model's bf16 error on CUDA comes from: the family test's trace
(`tests/engine/test_families_gpu.py`: three prompts, ten decode steps, one mixed) in float32 on
CUDA as the reference, then in bf16 (eager) with every kernel module's `use_kernels` as shipped,
with all of them off (the torch paths on CUDA), with dependent launches off, and with each one
off alone. Prints the median and
upper-quartile relative error of the logits rows per variant, and transformers' own bf16 error
on the same tokens (the model's inherent bf16 sensitivity).

    SAFESERVE_TEST_SEED=n python3 kernels/bf16_error_bisect.py [--family qwen3_moe]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "engine")]

from model_checks import small_runner  # noqa: E402
from test_families_gpu import _trace, _write  # noqa: E402

MODULES = [
    "safeserve.kernels.fused_moe",
    "safeserve.kernels.linear",
    "safeserve.kernels.norm_rope",
    "safeserve.kernels.paged_attention",
    "safeserve.kernels.paged_prefill",
    "safeserve.kernels.qkv_rope",
    "safeserve.kernels.router_topk",
    "safeserve.kernels.topk_softmax",
    "safeserve.kernels.moe_align",
    "safeserve.layers.linear",
    "safeserve.layers.paged_attention",
    "safeserve.moe.runner",
    "safeserve.engine.model_runner",
]


def errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    e: list[float] = []
    for a, b in zip(got, ref, strict=True):
        e += ((a - b).norm(dim=-1) / b.norm(dim=-1)).tolist()
    e.sort()
    return e[len(e) // 2], e[(3 * len(e)) // 4]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--family", default="qwen3_moe")
    p.add_argument("--device", default="cuda")
    ns = p.parse_args()
    ckpt = _write(ns.family, Path(tempfile.mkdtemp()) / ns.family)
    ref, fed = _trace(small_runner(ckpt, ns.device, "float32", False))
    mods = {m: importlib.import_module(m) for m in MODULES}
    shipped = {m: mod.use_kernels for m, mod in mods.items() if hasattr(mod, "use_kernels")}

    def run(label: str, off: set[str], graphs: bool = False, **flags: object) -> None:
        for m, fn in shipped.items():
            mods[m].use_kernels = (lambda t: False) if m in off else fn
        try:
            runner = small_runner(ckpt, ns.device, "bfloat16", graphs, **flags)
            got, _ = _trace(runner, forced=fed)
            med, q3 = errors(got, ref)
            print(f"{label:45s} median {med:.4f}  q3 {q3:.4f}", flush=True)
        except Exception as e:  # noqa: BLE001 - a torch path may not run beside some kernels
            print(f"{label:45s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)

    run("shipped, graphs", set(), graphs=ns.device == "cuda")
    run("shipped, eager", set())
    run("shipped, eager, no dependent launches", set(), disable_pdl=True)
    run("all torch paths", set(shipped))
    for m in shipped:
        run(f"off: {m.removeprefix('safeserve.')}", {m})
    for m in shipped:
        run(f"only: {m.removeprefix('safeserve.')}", set(shipped) - {m})

    from transformers import AutoModelForCausalLM

    seqs = [[int(t) for t in s] for s in _sequences(fed)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval().to(ns.device)
        with torch.no_grad():
            out[dtype] = [
                hf(torch.tensor([s], device=ns.device)).logits[0].float().cpu() for s in seqs
            ]
    med, q3 = errors(out[torch.bfloat16], out[torch.float32])
    print(f"{'transformers bf16 vs float32 (same tokens)':45s} median {med:.4f}  q3 {q3:.4f}")


def _sequences(fed: list[list[int]]) -> list[list[int]]:
    """The trace's three sequences (prompts, then the fed tokens; the mixed step's extras)."""
    from seeds import seeded

    gen = seeded(4)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 1, 17)]
    for step, last in enumerate(fed, start=1):
        for i in range(3):
            seqs[i] += [last[i]] + ([11, 31] if step == 6 and i == 1 else [])
    return seqs


if __name__ == "__main__":
    main()
