"""The paged KV cache: fixed-size blocks, a free list, and per-request block tables."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import TYPE_CHECKING

import torch

from safeserve.engine.request import Request
from safeserve.guards.sizing import gpu_kv_budget, kv_blocks
from safeserve.kernels.kv_quant import KV_FP8
from safeserve.model.loader import DTYPES
from safeserve.model.spec import KVSpec

if TYPE_CHECKING:
    from safeserve.config import ServerArgs

logger = logging.getLogger(__name__)

# Table ids, unique in the process (every allocator draws from it): a request's block list gets
# a new one whenever it starts from empty, and under one id the list only grows by appending.
_table_ids = itertools.count()


def new_table_id() -> int:
    """A table id no other block list of this process has (see `Request.table_id`)."""
    return next(_table_ids)


class BlockAllocator:
    """Hands out block ids from a free list; a request owns its blocks until freed."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._retired: list[int] = []  # table ids freed since `drain_retired`

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
        if need and not req.block_ids:
            req.table_id = new_table_id()
        req.block_ids.extend(self._free.popleft() for _ in range(need))

    def free(self, req: Request) -> None:
        self._free.extend(req.block_ids)
        if req.table_id >= 0:
            self._retired.append(req.table_id)
        req.block_ids = []
        req.table_id = -1

    def drain_retired(self) -> list[int]:
        """The table ids freed since the last call (the leader tells its other ranks)."""
        out, self._retired = self._retired, []
        return out


class KVCache:
    """Per layer a key and a value tensor `[num_blocks * block_size, heads, dim]`, as the
    family's KV specification says (`model/spec.py`, KVSpec); where the values are part of the
    one latent vector a token keeps (`v_in_k`), the value tensor is a view of the key tensor."""

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
        """A cache of K and V heads of one size (grouped-query attention)."""
        spec = KVSpec(num_layers, num_kv_heads, head_dim, head_dim)
        self._build(spec, num_blocks * block_size, dtype, device)

    @classmethod
    def from_spec(
        cls,
        spec: KVSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        cache = cls.__new__(cls)
        cache._build(spec, num_blocks * block_size, dtype, device)
        return cache

    def _build(
        self, spec: KVSpec, slots: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        if dtype == KV_FP8 and spec.v_in_k:
            # the MLA kernels and latent store read and write the latent in the model's dtype
            raise ValueError("an FP8 KV cache is not available for latent (MLA) caches")
        self.spec = spec
        self.dtype = dtype
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _ in range(spec.num_layers):
            # Uninitialized on purpose: a slot is always written before it is read.
            k = torch.empty(slots, spec.num_heads, spec.k_dim, dtype=dtype, device=device)
            if spec.v_in_k:
                v = k[..., : spec.v_dim]
            else:
                v = torch.empty(slots, spec.num_heads, spec.v_dim, dtype=dtype, device=device)
            self.layers.append((k, v))

    @staticmethod
    def bytes_per_block(spec: KVSpec, block_size: int, dtype: torch.dtype) -> int:
        return block_size * spec.token_bytes(dtype.itemsize)


def kv_cache_dtype(args: ServerArgs) -> torch.dtype:
    """The dtype the cache is stored in: `--kv-cache-dtype`, or the model's (`auto`)."""
    return KV_FP8 if args.kv_cache_dtype == "fp8_e4m3" else DTYPES[args.dtype]


def kv_blocks_from_memory(
    args: ServerArgs, per_block: int, device: torch.device, max_model_len: int
) -> int:
    """KV blocks for one rank: on a GPU what is free after the weights, less the share
    `--mem-fraction-static` keeps for activations and graphs; on the CPU `--kv-cache-memory-gb`.
    Never more than every running request at full length."""
    if device.type == "cuda":
        # Memory the allocator caches (freed temporaries of the weight fill) is free to us but
        # not to the driver's count: hand it back before counting.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = gpu_kv_budget(free, total, args.mem_fraction_static)
        keep = free - budget
        gib = 2**30
        if budget <= per_block:
            raise RuntimeError(
                f"no device memory left for the KV cache: {free / gib:.1f} GiB free of "
                f"{total / gib:.1f} after the weights, and --mem-fraction-static "
                f"{args.mem_fraction_static} keeps {keep / gib:.1f} GiB for activations; "
                "raise it, or free the device of other processes"
            )
        logger.info(
            "KV cache from device memory: %.1f GiB free of %.1f after the weights "
            "(%.1f GiB allocated), %.1f GiB kept (--mem-fraction-static %s): %d blocks "
            "(free %d of %d bytes)",
            free / gib,
            total / gib,
            torch.cuda.memory_allocated(device) / gib,
            keep / gib,
            args.mem_fraction_static,
            int(budget // per_block),
            free,
            total,
        )
    else:
        budget = args.kv_cache_memory_gb * (1 << 30)
    return kv_blocks(budget, per_block, args.max_running_requests, max_model_len, args.block_size)
