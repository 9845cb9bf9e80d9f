"""A step's plan: what the leader broadcasts to every rank of its group (over gloo)."""

from __future__ import annotations

from dataclasses import dataclass, field

from safeserve.messages import SamplingParams


@dataclass
class SeqPlan:
    """One sequence's work in a step, on the attention rank that holds its KV cache."""

    token_ids: list[int]  # tokens computed this step
    start: int  # position of token_ids[0]
    # Blocks covering positions 0 .. start + len(token_ids) - 1. On the leader this is the
    # request's own list, not a copy: read it during the step only.
    block_table: list[int]
    params: SamplingParams | None = None  # set when this step samples the next token
    output_index: int = 0  # index of the token being sampled among the request's outputs
    # The request's table id (Request.table_id): tables of one id >= 0 only grow by appending,
    # so a decode graph that held it last step uploads only the new entries; -1: always whole.
    table_id: int = -1

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class Faults:
    """Injected faults every rank applies (fault injection only)."""

    route_skew_expert: int | None = None
    delay_s: dict[int, float] = field(default_factory=dict)  # rank -> delay per step


@dataclass
class StepPlan:
    step: int
    # Attention rank -> its sequences. With tensor-parallel attention there is one list, which
    # every rank computes (each its heads); with attention data-parallel one list per rank.
    per_rank: list[list[SeqPlan]] = field(default_factory=list)
    idle: bool = False  # nothing to compute: ranks only report they are alive
    shutdown: bool = False
    faults: Faults | None = None
