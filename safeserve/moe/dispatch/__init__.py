"""Stage 2 and 4: moving tokens to the ranks that hold their experts, and back."""

from __future__ import annotations

from safeserve.moe.dispatch.allgather import AllGatherDispatcher
from safeserve.moe.dispatch.alltoall import AllToAllDispatcher
from safeserve.moe.dispatch.base import CombineInput, Dispatcher, DispatchOutput, StepTokens
from safeserve.moe.dispatch.local import LocalDispatcher
from safeserve.moe.placement import ExpertPlacement
from safeserve.parallel.comm import Comm

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "CombineInput",
    "DispatchOutput",
    "Dispatcher",
    "LocalDispatcher",
    "StepTokens",
    "make_dispatcher",
]


def make_dispatcher(backend: str, placement: ExpertPlacement, comm: Comm) -> Dispatcher:
    """The dispatcher of `--moe-a2a-backend` for this rank."""
    if comm.world == 1:
        return LocalDispatcher(placement)
    if backend == "alltoall":
        return AllToAllDispatcher(placement, comm)
    if backend == "none":
        return AllGatherDispatcher(placement, comm)
    raise ValueError(f"--moe-a2a-backend {backend} is not available")
