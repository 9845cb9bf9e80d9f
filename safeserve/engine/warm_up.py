"""The start-up warm-up of a group's leader: prefills of every size class before the group
reports READY."""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from safeserve.messages import RequestOutput, SamplingParams


class Warmable(Protocol):
    """What the warm-up drives (an `Engine`)."""

    scheduler: Any
    runner: Any
    config: Any
    max_model_len: int

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> Any: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...


logger = logging.getLogger(__name__)


def warm_up(engine: Warmable) -> None:
    """Prefills of every size class before the group reports READY, so the first clients do
    not pay for first-time work: kernel compilation (Triton builds one variant per MoE tile
    config, which the token count picks, and per divisibility of integer arguments) and the
    allocator's growth to the largest step. A largest step that does not fit in device
    memory fails here, at start-up, with its size in the error, not under traffic.

    On CPU (torch paths only, nothing to compile) one 3-token request runs every stage once
    (a prefill, then a decode step, as every size does where the context leaves room).
    With attention data parallelism each size is sent once per attention rank."""
    # max_model_len is already at most what the KV cache holds
    largest = min(engine.scheduler.chunk, engine.scheduler.token_budget, engine.max_model_len - 1)
    sizes = warm_up_sizes(largest, engine.runner.device.type == "cuda")
    if not sizes:  # a context of one token: nothing to prefill before the first decode
        return
    t_all = time.perf_counter()
    for n in sizes:
        t0 = time.perf_counter()
        for r in range(engine.runner.layout.dp_size):
            prompt = [(7 * i + r) % engine.config.vocab_size for i in range(n)]
            # a decode step after the prefill too, where the context length leaves room
            params = SamplingParams(
                max_tokens=min(2, engine.max_model_len - n), temperature=0, ignore_eos=True
            )
            engine.add_request(f"__warmup_{n}_{r}__", prompt, params)
        try:
            while engine.has_work():
                # A step's exception ends its requests with an error output (isolation.py)
                # rather than raising: at start-up that is the warm-up failing.
                for o in engine.step():
                    if o.finish_reason == "error":
                        raise _WarmUpStepFailed(o.error or "unknown error")
        except torch.cuda.OutOfMemoryError as e:
            raise RuntimeError(_oom_message(n, str(e))) from e
        except Exception as e:
            if "OutOfMemoryError" in str(e):  # as an isolated step's error output says it
                raise RuntimeError(_oom_message(n, str(e))) from e
            raise RuntimeError(f"start-up warm-up failed at a {n}-token prefill: {e}") from e
        if len(sizes) > 1:
            logger.info("warm-up: %d-token prefill in %.2f s", n, time.perf_counter() - t0)
    logger.info(
        "warm-up done: %d prefill size(s) up to %d tokens in %.1f s",
        len(sizes),
        max(sizes),
        time.perf_counter() - t_all,
    )


class _WarmUpStepFailed(RuntimeError):
    """A warm-up request ended with an error output."""


def _oom_message(n: int, error: str) -> str:
    return (
        f"start-up warm-up: a {n}-token prefill does not fit in device memory; lower "
        f"--mem-fraction-static (leaves more for activations) or --max-num-batched-tokens "
        f"({error})"
    )


def warm_up_sizes(largest: int, compiles: bool) -> list[int]:
    """Prompt lengths of the start-up warm-up, each at most `largest` (the longest prefill one
    step takes). Without compiled kernels (CPU): 3 tokens. Where kernels compile (a GPU): every
    power of two from 1, each from 16 on also plus one (a count that is not a multiple of 16,
    which Triton compiles apart), and `largest`. What a kernel's variant depends on grows
    monotonically with the step's token count (tile configs keyed by powers of two, the
    heuristic's size classes, block sizes rounded up to a power of two), so a prefill at each
    doubling reaches every variant; decode batches past the decode graphs have the same
    token counts."""
    if not compiles:
        return [min(3, largest)] if largest >= 1 else []
    sizes = {largest} if largest >= 1 else set()
    n = 1
    while n < largest:
        sizes.add(n)
        if n >= 16 and n + 1 < largest:
            sizes.add(n + 1)
        n *= 2
    return sorted(sizes)
