"""What the kernel modules share: Triton as an optional import, and where the kernels run.

Importing this never needs Triton: without it `triton` and `tl` are None, the kernels are not
defined, and every entry point runs its torch reference.
"""

from __future__ import annotations

import functools
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


# Shared memory one program may opt into: an H100/H200/B200's 227 KiB; an A100's 163 KiB; 99 KiB
# on the other parts Triton supports (A10, L4, L40S, RTX 30/40/50, GB10). Tiles that need more do
# not launch there ("out of resources"), so launchers size them by `shared_memory_per_program`.
HOPPER_SHARED_BYTES = 227 * 1024
_SHARED_BY_CAPABILITY = {(8, 0): 163 * 1024, (8, 7): 163 * 1024, (9, 0): HOPPER_SHARED_BYTES,
                         (10, 0): HOPPER_SHARED_BYTES, (10, 3): HOPPER_SHARED_BYTES}  # fmt: skip
_SMALL_SHARED_BYTES = 99 * 1024


def optin_shared_bytes(props: object) -> int:
    """Shared memory one program may opt into on a device with these `torch.cuda` properties
    (by compute capability where this torch does not report it)."""
    shared = getattr(props, "shared_memory_per_block_optin", None)
    if shared is not None:
        return int(shared)
    cap = (getattr(props, "major", 0), getattr(props, "minor", 0))
    return _SHARED_BY_CAPABILITY.get(cap, _SMALL_SHARED_BYTES)


@functools.cache
def _cuda_shared_bytes(index: int) -> int:
    return optin_shared_bytes(torch.cuda.get_device_properties(index))


def shared_memory_per_program(device: torch.device) -> int:
    """Bytes of shared memory one program may take on `device`; for CPU tensors (Triton's
    interpreter, which has no limit) an H100's, so the same tiles run there."""
    if device.type != "cuda":
        return HOPPER_SHARED_BYTES
    return _cuda_shared_bytes(
        device.index if device.index is not None else torch.cuda.current_device()
    )


# Programmatic dependent launch (Hopper and newer). Every Triton kernel on the engine's paths takes
# a ``USE_PDL`` constexpr and, when it is set, is launched with ``launch_pdl=True`` and calls
# `pdl_wait` before it touches memory written by an earlier launch: the kernel's programs are
# scheduled while the launch before it finishes (the launch gap and block start-up overlap its
# tail), then wait until it has completed and its writes are visible. Each kernel lets its own
# dependent start before it waits itself, so the next launch's programs are resident by the time
# this one's work begins. A chain of such launches stays ordered all the same: a kernel completes
# only after its wait returned, which needed the kernel before it to have completed (and, by the
# same argument, every kernel before that). Library kernels (cuBLAS, NCCL, torch's elementwise
# ops) launch as usual. Reads before the wait are allowed only of weights (never written while
# serving). `--disable-pdl` turns it off.
_PDL_ENABLED = True


def set_pdl(enabled: bool) -> None:
    """Whether kernels launch as programmatic dependents where the device supports it."""
    global _PDL_ENABLED
    _PDL_ENABLED = enabled


# --enable-deterministic-inference: the kernel entry points take their batch-invariant paths (a
# row's result does not depend on the other rows of its launch, on the launch's size, nor on a
# CUDA graph's padding): fixed tiles and fixed reduction orders whatever the batch. Set once per
# process by the model runner, as `set_pdl` is.
_BATCH_INVARIANT = False


def set_batch_invariant(enabled: bool) -> None:
    """Whether the kernel entry points take their batch-invariant paths."""
    global _BATCH_INVARIANT
    _BATCH_INVARIANT = enabled


def batch_invariant() -> bool:
    return _BATCH_INVARIANT


@functools.cache
def _pdl_device(index: int) -> bool:
    major = torch.cuda.get_device_capability(index)[0]
    return major >= 9 and hasattr(tl.extra.cuda, "gdc_wait")


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch is on and `device` has it: a CUDA device of Hopper or
    newer, Triton with ``gdc_wait``, not under the interpreter."""
    if not (_PDL_ENABLED and HAS_TRITON) or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if device.type != "cuda":
        return False
    return _pdl_device(device.index if device.index is not None else torch.cuda.current_device())


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


if HAS_TRITON:

    @triton.jit
    def pdl_wait(USE_PDL: tl.constexpr):
        """A kernel's first step: with USE_PDL (launched with ``launch_pdl=True``), let the next
        launch's programs be scheduled, then wait for the launch before it to complete.

        Triggering first (not after the wait) moved the decode step at concurrency 1 from
        3.34-3.36 to 3.30-3.32 ms on an H200 (kernels/RESULTS.md, ninth session)."""
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of program `pid` over a num_pid_m x num_pid_n grid of output tiles,
        in groups of GROUP_M row tiles that walk their column tiles together (row tiles of one
        group share each weight tile while it is in L2)."""
        group = GROUP_M * num_pid_n
        first_m = (pid // group) * GROUP_M
        group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (pid % group) % group_m, (pid % group) // group_m

    @triton.jit
    def round_e4m3(x):
        """x (float32) clamped to +-448 and rounded to the nearest float8_e4m3fn value (ties to
        even), still as float32, so the conversion that follows is exact. A GPU's conversion
        saturates and rounds the same, but Triton's interpreter truncates and flushes
        subnormals, and the kernels' tests run there: the FP8 KV cache's stores and the block-FP8
        activation quantizers round here."""
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        bits = x.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) - 127
        exp = tl.maximum(exp, -6)  # below 2^-6 e4m3 is subnormal: a fixed step of 2^-9
        step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
        inv = ((127 - exp + 3) << 23).to(tl.float32, bitcast=True)
        y = x * inv  # exact (a power of two; an FMA with the add below rounds the same); |y| < 16
        # round half to even in float32: adding and taking away 1.5 * 2^23 leaves no fraction
        magic = 12582912.0
        r = (y + magic) - magic
        return tl.where(r == 0.0, x * 0.0, r * step)  # a zero keeps its sign, as torch's cast

else:  # pragma: no cover - exercised where Triton is missing
    pdl_wait = None
    grouped_tile = None
    round_e4m3 = None
