"""What the kernel modules share: Triton as an optional import, and where the kernels run.

Importing this never needs Triton: without it `triton` and `tl` are None, the kernels are not
defined, and every entry point runs its torch reference.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is an optional dependency: CI and CPU-only installs run the torch references.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is missing
    triton = None
    tl = None

HAS_TRITON = triton is not None


def use_kernels(t: torch.Tensor) -> bool:
    """True where the Triton kernels run for tensors like `t`: CUDA, or Triton's interpreter
    (``TRITON_INTERPRET=1``) on CPU."""
    if not HAS_TRITON:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Zeroed int32 words that kernels use as arrival counters and leave zeroed when they finish (the
# last program to arrive resets them), so no memset launch is needed. One buffer per (device,
# purpose), shared by every stream: launches that use one run one after another (the engine runs
# all its kernels, graph replays included, on one stream per process).
#
# A buffer is never allocated during CUDA-graph capture: memory taken there comes from the graph
# pool, where graphs captured earlier may have their intermediates at the same addresses, so
# their replays would overwrite the counters. The first call (a warm-up) must run eagerly. A
# buffer outgrown by a larger call stays alive: graphs captured with it keep using it.
ZEROED_COUNTERS: dict[tuple[str, int, str], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def zeroed_counters(device: torch.device, words: int, purpose: str) -> torch.Tensor:
    """At least `words` int32 zeros on `device`; callers must leave them 0."""
    key = (device.type, device.index or 0, purpose)
    buf = ZEROED_COUNTERS.get(key)
    if buf is None or buf.numel() < words:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{purpose}: its arrival counters ({words} words) would be allocated inside a "
                "CUDA-graph capture; run the same call once outside the capture first"
            )
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(1024, words), dtype=torch.int32, device=device)
        ZEROED_COUNTERS[key] = buf
    return buf
