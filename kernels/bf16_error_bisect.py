"""Where a small random model's bf16 error on CUDA comes from: the family trace
(`tests/family_trace.py`: three prompts, ten decode steps, one mixed) in float32 on
CUDA as the reference, then in bf16 (eager) with every kernel module's `use_kernels` as shipped,
with all of them off (the torch paths on CUDA), with dependent launches off, and with each one
off alone. Prints the median and
upper-quartile relative error of the logits rows per variant, and transformers' own bf16 error
on the same tokens and rows (the model's inherent bf16 sensitivity). `--every-expert` routes
every token to every expert (no top-k choice for a rounding to flip). With `--device cpu` and
TRITON_INTERPRET=1 the kernels run under Triton's interpreter, bf16 as a GPU rounds it
(`tests/interpreter_numerics.py`).

    SAFESERVE_TEST_SEED=n python3 kernels/bf16_error_bisect.py [--family qwen3_moe] [--every-expert]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import interpreter_numerics  # noqa: E402
from family_trace import (  # noqa: E402
    kernel_switches,
    reference_rows,
    relative_errors,
    trace,
    write_family,
)
from model_checks import small_runner  # noqa: E402


def errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    e = relative_errors(got, ref)
    return e[len(e) // 2], e[(3 * len(e)) // 4]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--family", default="qwen3_moe")
    p.add_argument("--device", default="cuda")
    p.add_argument("--every-expert", action="store_true")
    ns = p.parse_args()
    interpreter_numerics.apply()  # under TRITON_INTERPRET=1 (--device cpu): bf16 as a GPU has it
    ckpt = write_family(ns.family, Path(tempfile.mkdtemp()) / ns.family, ns.every_expert)
    ref, fed = trace(small_runner(ckpt, ns.device, "float32", False))
    mods = kernel_switches()
    shipped = {m: mod.use_kernels for m, mod in mods.items()}

    def run(label: str, off: set[str], graphs: bool = False, **flags: object) -> None:
        for m, fn in shipped.items():
            mods[m].use_kernels = (lambda t: False) if m in off else fn
        try:
            runner = small_runner(ckpt, ns.device, "bfloat16", graphs, **flags)
            got, _ = trace(runner, forced=fed)
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

    want = {d: reference_rows(ckpt, fed, d, ns.device) for d in (torch.float32, torch.bfloat16)}
    med, q3 = errors(want[torch.bfloat16], want[torch.float32])
    print(f"{'transformers bf16 vs float32 (same rows)':45s} median {med:.4f}  q3 {q3:.4f}")


if __name__ == "__main__":
    main()
