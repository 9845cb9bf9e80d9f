"""A rank's memory arithmetic, without torch: how many KV blocks it holds and how many rows its
dispatch buffers take in one round.

The ranks size themselves with these functions at start-up (`engine/kv_cache.py`,
`engine/rank_setup.py`, `guards/admission.py`), and `safeserve plan` predicts the same numbers
with them before any GPU is touched.
"""

from __future__ import annotations

ROUTING_BYTES_PER_CHOICE = 8  # a received row's routing: a float32 weight and a float32 id


def recv_row_bytes(
    hidden: int, moe_width: int, top_k: int, local_experts: int, itemsize: int
) -> int:
    """Memory one received row may need: the row, its routing, its output, and the expert
    intermediates of its (at most `min(top_k, local_experts)`) local choices."""
    pairs = min(top_k, local_experts)
    return (
        itemsize * (2 * hidden)
        + ROUTING_BYTES_PER_CHOICE * top_k
        + pairs * itemsize * (3 * moe_width + hidden)
    )


def buffer_row_bytes(hidden: int, moe_width: int, top_k: int, itemsize: int) -> int:
    """Bytes of the preallocated dispatch buffers per row of the budget (`DispatchBuffers`):
    received rows, routing, the experts' output, and one expert's rows, gate|up, activation
    and output."""
    return itemsize * (4 * hidden + 3 * moe_width) + ROUTING_BYTES_PER_CHOICE * top_k


def dispatch_budget(
    free_bytes: int, row_bytes: int, attention_groups: int, max_num_batched_tokens: int
) -> int:
    """The default receive budget: what `free_bytes` holds of rows, never more than a full step
    of every attention group's tokens (more is never received)."""
    useful = attention_groups * max_num_batched_tokens
    return max(1, min(useful, free_bytes // row_bytes))


def gpu_kv_budget(free_bytes: int, total_bytes: int, mem_fraction_static: float) -> float:
    """Bytes a GPU rank gives its KV cache: what is free after the weights, less the share
    `--mem-fraction-static` keeps for activations and graphs."""
    return free_bytes - (1 - mem_fraction_static) * total_bytes


def kv_blocks(
    budget_bytes: float,
    per_block: int,
    max_running_requests: int,
    max_model_len: int,
    block_size: int,
) -> int:
    """KV blocks that `budget_bytes` holds, never more than every running request at full
    length, and at least two."""
    blocks = int(budget_bytes // per_block)
    per_req = (max_model_len + block_size - 1) // block_size
    return max(2, min(blocks, max_running_requests * per_req))
