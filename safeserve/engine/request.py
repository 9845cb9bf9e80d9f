"""A request's state inside a group: its tokens, how many are computed, its KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from safeserve.messages import SamplingParams, TokenLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    # Set by the allocator when block_ids starts from empty; under one id block_ids only grows
    # by appending (the decode graphs upload only a table's new entries). -1: no blocks.
    table_id: int = -1
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    dp_rank: int = 0  # attention rank holding its KV cache (attention data-parallel)
    # Prompt log-probabilities accumulated over its prefill chunks (when asked; entry 0 is
    # None), sent once with its first output.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V still have to be computed before the next sample."""
        return len(self.token_ids) - self.num_computed
