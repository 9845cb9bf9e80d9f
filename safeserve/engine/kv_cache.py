"""The paged KV cache: fixed-size blocks, a free list, and per-request block tables."""

from __future__ import annotations

from collections import deque

import torch

from safeserve.engine.request import Request


class BlockAllocator:
    """Hands out block ids from a free list; a request owns its blocks until freed."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        """Extra blocks `req` needs to hold `num_tokens` tokens in total."""
        want = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, want - len(req.block_ids))

    def can_allocate(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_needed(req, num_tokens) <= len(self._free)

    def allocate(self, req: Request, num_tokens: int) -> None:
        need = self.blocks_needed(req, num_tokens)
        if need > len(self._free):
            raise RuntimeError("out of KV blocks; call can_allocate first")
        req.block_ids.extend(self._free.popleft() for _ in range(need))

    def free(self, req: Request) -> None:
        self._free.extend(req.block_ids)
        req.block_ids = []


class KVCache:
    """Per layer, one key and one value tensor `[num_blocks * block_size, kv_heads, head_dim]`."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        # Uninitialized on purpose: a slot is always written before it is read.
        self.layers = [
            (
                torch.empty(shape, dtype=dtype, device=device),
                torch.empty(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
