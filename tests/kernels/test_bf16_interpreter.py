"""The engine's bf16 kernels round as its torch paths do: under Triton's interpreter, with bf16
rounded as a GPU rounds it (`interpreter_numerics`), a GQA and an MLA family's trace (`family_trace`,
every expert routed: no top-k choice to flip) in bf16 with the kernels on CPU and with the torch paths,
fed the same tokens: every row of logits within 2e-3 relative of the torch paths' (bf16's own
rounding moves a row by about 1e-2 from float32), and kernels did run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from family_trace import kernel_switches, trace, write_family
from model_checks import small_runner

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Under the interpreter every step runs each kernel program by program: two families (GQA with
# q/k norms; MLA), a prefill and two decode steps keep it under a minute.
CHECKED = ["qwen3_moe", "deepseek_v3"]
STEPS = 2


@pytest.mark.kernel
@pytest.mark.skipif(not INTERPRET, reason="runs the kernels under TRITON_INTERPRET=1")
@pytest.mark.parametrize("family", CHECKED)
def test_interpreter_bf16_kernels_round_as_the_torch_paths(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triton.runtime import interpreter

    ckpt = write_family(family, tmp_path / family, every_expert=True)
    _, fed = trace(small_runner(ckpt, "cpu", "float32", False), steps=STEPS)
    launched: dict[str, int] = {}
    run = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        launched[self.fn.__name__] = launched.get(self.fn.__name__, 0) + 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    kernels, _ = trace(small_runner(ckpt, "cpu", "bfloat16", False), forced=fed, steps=STEPS)
    assert launched, "no kernel ran"
    for module in kernel_switches().values():
        monkeypatch.setattr(module, "use_kernels", lambda t: False)
    launched.clear()
    torch_paths, _ = trace(small_runner(ckpt, "cpu", "bfloat16", False), forced=fed, steps=STEPS)
    assert not launched, launched
    for a, b in zip(kernels, torch_paths, strict=True):
        assert not a.isnan().any()
        rel = (a - b).norm(dim=-1) / b.norm(dim=-1)
        assert rel.max().item() <= 2e-3, (family, rel.tolist())
