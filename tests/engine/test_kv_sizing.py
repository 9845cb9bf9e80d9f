"""How many KV blocks a rank gets: the GPU branch's arithmetic with the device's memory queries
replaced (CPU CI has no GPU; tests/model/test_loader_memory_gpu.py and the bench check it on one),
and the CPU branch as it runs."""

from __future__ import annotations

import logging

import pytest
import torch

from safeserve.config import ServerArgs
from safeserve.engine.kv_cache import kv_blocks_from_memory

GIB = 2**30
MIB = 2**20


class FakeGpu:
    """A 100 GiB device with 40 GiB free and 2 GiB more cached by the allocator."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.free = 40 * GIB

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.free += 2 * GIB

    def mem_get_info(self, device: object) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return self.free, 100 * GIB


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    gpu = FakeGpu()
    monkeypatch.setattr(torch.cuda, "empty_cache", gpu.empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", gpu.mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 55 * GIB)
    return gpu


def test_gpu_blocks_are_free_memory_less_the_kept_share(fake_gpu: FakeGpu, caplog) -> None:  # type: ignore[no-untyped-def]
    args = ServerArgs(mem_fraction_static=0.85, max_running_requests=1000)
    with caplog.at_level(logging.INFO, logger="safeserve.engine.kv_cache"):
        blocks = kv_blocks_from_memory(args, MIB, torch.device("cuda"), 40960)
    # cached memory is handed back before counting: 42 GiB free, 15 kept -> 27 GiB of blocks
    assert fake_gpu.calls == ["empty_cache", "mem_get_info"]
    assert blocks == 27 * 1024
    assert "42.0 GiB free of 100.0 after the weights (55.0 GiB allocated), 15.0 GiB kept" in (
        caplog.text
    )


def test_gpu_blocks_never_exceed_every_request_at_full_length(fake_gpu: FakeGpu) -> None:
    args = ServerArgs(mem_fraction_static=0.85, max_running_requests=4, block_size=16)
    assert kv_blocks_from_memory(args, MIB, torch.device("cuda"), 1000) == 4 * 63


def test_gpu_without_room_says_to_raise_the_fraction(fake_gpu: FakeGpu) -> None:
    fake_gpu.free = 5 * GIB
    args = ServerArgs(mem_fraction_static=0.85)
    with pytest.raises(RuntimeError, match="keeps 15.0 GiB for activations; raise it"):
        kv_blocks_from_memory(args, MIB, torch.device("cuda"), 4096)


def test_cpu_blocks_come_from_the_cpu_budget() -> None:
    args = ServerArgs(kv_cache_memory_gb=0.5, max_running_requests=1000)
    assert kv_blocks_from_memory(args, MIB, torch.device("cpu"), 40960) == 512
