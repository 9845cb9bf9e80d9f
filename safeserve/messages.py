"""Everything the frontend and the group processes say to each other.

Messages are small dataclasses sent as pickles over ZeroMQ sockets between processes of one
deployment (never over an untrusted network).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Heartbeat phases, in the order a step goes through them.
PHASES = ("idle", "schedule", "attention", "dispatch", "experts", "combine", "sample")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


# -- frontend -> group leader -----------------------------------------------------------------
@dataclass
class GenerateRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequest:
    rid: str


@dataclass
class Shutdown:
    pass


# -- group -> frontend ------------------------------------------------------------------------
@dataclass
class RequestOutput:
    rid: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # tokens generated so far, the stop token included


@dataclass
class EngineStats:
    step: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0


@dataclass
class StepOutputs:
    group: int
    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass
class GroupReady:
    group: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int


@dataclass
class GroupFatal:
    """A rank could not start or hit an unrecoverable error; `message` is one line."""

    group: int
    rank: int
    message: str


@dataclass
class Heartbeat:
    group: int
    rank: int
    pid: int
    step: int
    phase: str
    time: float  # time.time() on the rank
