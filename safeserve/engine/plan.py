"""A step's plan: what the leader broadcasts to every rank of its group (over gloo)."""

from __future__ import annotations

import dataclasses
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
    # Only in a plan on its way to the other ranks (`TableSender`): block_table holds the
    # entries from this index on; the ones before were sent in earlier steps.
    table_start: int = 0
    # Fault injection (SamplingParams.fault), on every step that holds the request: sampling
    # or not (params is only set on the steps that sample).
    fault: str | None = None
    # Prompt log-probabilities computed this step: the rows at positions prompt_lp_first ..
    # prompt_lp_first + len(prompt_lp_targets) - 1 (within this step's tokens), row j scoring
    # the prompt token at position j + 1 (prompt_lp_targets, which may reach one token past
    # this chunk) with the prompt_lp_top most likely. None: none this step.
    prompt_lp_targets: list[int] | None = None
    prompt_lp_first: int = 0
    prompt_lp_top: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class Faults:
    """Injected faults every rank applies (fault injection only)."""

    route_skew_expert: int | None = None
    delay_s: dict[int, float] = field(default_factory=dict)  # rank -> delay per step
    corrupt_ranks: tuple[int, ...] = ()  # ranks whose weights are damaged (for good)


@dataclass(frozen=True)
class EplbCollect:
    """Every rank reports the tokens it routed per logical expert per MoE layer since the last
    collect with `reset` (`reset` False: the counting goes on, as for an admin dump)."""

    reset: bool = True


@dataclass(frozen=True)
class EplbMove:
    """Every rank moves the expert weights of MoE layers `layers` (expert-map rows) to the
    placement `rows` (per layer, the logical expert of each physical slot), then routes by it."""

    layers: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]


EplbOp = EplbCollect | EplbMove


@dataclass
class EplbRankReport:
    """What a rank reports of an EPLB step (in its `RankResult`)."""

    # collect: tokens routed per logical expert per MoE layer ([L][E]) and the passes counted
    counts: list[list[int]] | None = None
    passes: int = 0
    sent_bytes: int = 0  # move: expert weights this rank sent to other ranks
    seconds: float = 0.0  # the step's time on this rank


@dataclass
class StepPlan:
    step: int
    # Attention rank -> its sequences. With tensor-parallel attention there is one list, which
    # every rank computes (each its heads); with attention data-parallel one list per rank.
    per_rank: list[list[SeqPlan]] = field(default_factory=list)
    idle: bool = False  # nothing to compute: ranks only report they are alive
    shutdown: bool = False
    faults: Faults | None = None
    # Table ids freed since the last plan (`TableSender`): the other ranks forget them.
    retired_tables: list[int] = field(default_factory=list)
    # An EPLB step (no sequences: every rank does this instead of a forward pass).
    eplb: EplbOp | None = None
    # Two-batch overlap: per attention rank, the index among that rank's step tokens of the
    # first token of the second micro-batch (engine/overlap.py); None: the step runs whole.
    split: list[int] | None = None


class TableSender:
    """The leader's half of sending block tables to the other ranks of its group by difference.

    A plan with whole tables grows with the contexts: 64 sequences of 8,192 tokens carry 32,768
    table entries a step, pickled on the leader and unpickled on every other rank before it can
    start (about 0.3 + 0.5 ms on a CPU core; 1.5 + 3.2 ms at 32,768 tokens; with attention
    data-parallel the plan holds every rank's sequences). Under one table id a table only grows,
    so each step sends only the entries the other ranks do not hold yet (none, or one when a
    sequence crosses a block), and the ids freed since the last plan so they can forget them.
    """

    def __init__(self) -> None:
        self._sent: dict[int, int] = {}  # table id -> entries the other ranks hold

    def wire(self, plan: StepPlan, retired: list[int]) -> StepPlan:
        """A copy of `plan` for the other ranks; `plan` itself is left whole."""
        for tid in retired:
            self._sent.pop(tid, None)
        per_rank = []
        for seqs in plan.per_rank:
            out = []
            for s in seqs:
                if s.table_id < 0:
                    out.append(s)
                    continue
                have = self._sent.get(s.table_id, 0)
                out.append(
                    dataclasses.replace(s, block_table=s.block_table[have:], table_start=have)
                )
                self._sent[s.table_id] = len(s.block_table)
            per_rank.append(out)
        return dataclasses.replace(plan, per_rank=per_rank, retired_tables=list(retired))


class TableOutOfStep(RuntimeError):
    """A rank's tables disagree with what the leader sent (a plan was lost or reordered)."""


class TableReceiver:
    """The other ranks' half of `TableSender`: rebuilds every whole table of a received plan
    (in place), from the tables held since earlier plans."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}

    @property
    def num_tables(self) -> int:
        return len(self._tables)

    def expand(self, plan: StepPlan) -> StepPlan:
        for tid in plan.retired_tables:
            self._tables.pop(tid, None)
        plan.retired_tables = []
        for seqs in plan.per_rank:
            for s in seqs:
                if s.table_id < 0:
                    continue
                if s.table_start == 0:
                    table = self._tables[s.table_id] = []
                else:
                    table = self._tables.get(s.table_id, [])
                if len(table) != s.table_start:
                    raise TableOutOfStep(
                        f"step {plan.step}: table {s.table_id} holds {len(table)} entries here, "
                        f"the leader's plan continues it at {s.table_start}"
                    )
                table.extend(s.block_table)
                s.block_table, s.table_start = table, 0
        return plan
