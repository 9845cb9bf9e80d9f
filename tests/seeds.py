"""Seeded generators for tests' random inputs. `SAFESERVE_TEST_SEED=n` moves every seed by n, so
a run draws fresh inputs (the GPU device scripts set it from the clock and print it); unset, the
inputs are the same on every run. A failure reproduces with the offset its run printed:
`SAFESERVE_TEST_SEED=n pytest TEST_ID`."""

from __future__ import annotations

import os

import torch

OFFSET = int(os.environ.get("SAFESERVE_TEST_SEED", "0"))


def seeded(seed: int, device: str | torch.device | None = None) -> torch.Generator:
    """A generator seeded with `seed` moved by the run's offset."""
    return torch.Generator(device=device).manual_seed((seed + OFFSET) % 2**63)


def seed_all(seed: int) -> None:
    """`torch.manual_seed` with the run's offset (the global CPU and CUDA generators)."""
    torch.manual_seed((seed + OFFSET) % 2**63)
