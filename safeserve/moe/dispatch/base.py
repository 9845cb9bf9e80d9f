"""The dispatcher interface and the small types that pass between the MoE stages.

A dispatch runs in one or more rounds (admission: no rank receives more rows in a round than
its budget). `steps` drives them: `prepare` (share counts, plan rounds), then per round
`dispatch` -> experts -> `combine`, then `finish` (per-token sums). The stages are generators
(`parallel/schedule.py`): with `asynchronous` set they issue their collectives and yield before
waiting, so that another micro-batch can run meanwhile (two-batch overlap); otherwise their
collectives complete before they go on and `run` is one plain call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from safeserve.guards.admission import DispatchBuffers
from safeserve.moe.eplb.balancedness import BalancednessRecorder
from safeserve.moe.placement import ExpertPlacement
from safeserve.moe.topk import TopKOutput
from safeserve.parallel.comm import Pending
from safeserve.parallel.schedule import Steps, drive


@dataclass
class DispatchOutput:
    """Rows this rank must run its local experts on (one round).

    `topk_ids` holds local slot indices (0 .. experts_per_rank-1), or -1 for a choice whose
    physical slot lives on another rank; the runner skips those. With admission on, `hidden_states`
    is a view of the preallocated receive buffer and `workspace` holds the rest of them.
    """

    hidden_states: torch.Tensor  # [N, H]
    topk_ids: torch.Tensor  # [N, k]
    topk_weights: torch.Tensor  # [N, k]
    handle: Any = None
    workspace: DispatchBuffers | None = None


@dataclass
class CombineInput:
    """Per received row, the routing-weighted sum of this rank's experts' outputs."""

    hidden_states: torch.Tensor  # [N, H]
    handle: Any = None


@dataclass
class StepTokens:
    """How this step's tokens sit on the group's ranks; the model runner sets it every step.

    `replicated`: every rank holds the same tokens (tensor-parallel attention); otherwise rank r
    holds its own `per_rank[r]` tokens (attention data-parallel). `graph`: a CUDA graph captures
    the step, so the dispatch must not read anything on the host. `real`: in a graph step, a
    bool device tensor over this rank's rows, False for the bucket's padding rows (computed
    inside the graph from its static inputs): their routing is dropped, so they cost no expert
    work and count in no expert load.
    """

    per_rank: list[int]
    replicated: bool
    graph: bool = False
    real: torch.Tensor | None = None


Experts = Callable[[DispatchOutput], CombineInput]


@dataclass
class MicroBatch:
    """One micro-batch's dispatch context (two-batch overlap): its tokens, its half of the
    receive buffers, and the expert loads its layers recorded this step (host lists or device
    vectors, one per MoE layer, in layer order)."""

    step: StepTokens
    buffers: DispatchBuffers | None
    loads: list[Any] = field(default_factory=list)


class Dispatcher(ABC):
    """Moves tokens to their experts' ranks and the results back, in rounds that fit."""

    # This rank's view of the expert map: the rank of each physical slot, its local slots.
    placement: ExpertPlacement
    step: StepTokens | None = None
    buffers: DispatchBuffers | None = None  # None: admission off (one round, no budget)
    # Rows each source rank sends each destination rank in the last dispatch: the numbers the
    # admission guard plans rounds from, known before any token moves.
    last_count_matrix: torch.Tensor | None = None

    # The largest share of a step's tokens one rank received in any layer of the step.
    step_peak_share: float | None = None

    # Collectives issued asynchronously, each stage yielding while its transfer moves (set for
    # the micro-batches of a split step, and for single-batch overlap's combine).
    asynchronous: bool = False
    # Per-rank expert loads of this step's MoE layers, one entry per layer: a host list, or a
    # device vector (backends that only know them there); `end_step` records them in one
    # transfer. A split step's micro-batches each keep their own (`MicroBatch.loads`).
    _layer_loads: list[Any] | None = None
    _micro: list[MicroBatch] | None = None
    _halves: tuple[DispatchBuffers, DispatchBuffers] | None = None
    # The whole step's context while its micro-batches run (`end_micro_batches` restores it).
    _whole: tuple[StepTokens | None, DispatchBuffers | None] = (None, None)
    _balance: BalancednessRecorder | None = None
    # While a CUDA graph captures a step: the step's host bookkeeping, to run after each replay.
    _tape: list[Callable[[], None]] | None = None

    def begin_step(self, step: StepTokens) -> None:
        self.step = step
        self.step_peak_share = None
        self._micro = None

    def micro_batches(self, steps: list[StepTokens]) -> list[Callable[[], None]]:
        """Splits this step into micro-batches of `steps` (two): each gets half of the receive
        buffers (whose rounds are planned against half the budget) and its own loads. Returns,
        per micro-batch, the function that makes it the dispatcher's context (call it before
        each of its turns: `schedule.bound`). `end_step` sums their loads per layer."""
        full = self.buffers
        if full is not None and self._halves is None:
            self._halves = full.halves()
        halves: list[DispatchBuffers | None] = (
            list(self._halves) if self._halves is not None and full is not None else [None, None]
        )
        whole, micro = self.step, [MicroBatch(s, b) for s, b in zip(steps, halves, strict=True)]
        self._micro = micro

        def enter(mb: MicroBatch) -> Callable[[], None]:
            def use() -> None:
                self.step, self.buffers, self.asynchronous = mb.step, mb.buffers, True
                self._layer_loads = mb.loads

            return use

        self._whole = (whole, full)
        return [enter(mb) for mb in micro]

    def end_micro_batches(self) -> None:
        """Back to the whole step's context after a split forward pass."""
        if self._micro is not None:
            self.step, self.buffers = self._whole
            self.asynchronous = False

    @property
    def balance(self) -> BalancednessRecorder:
        """Balancedness of this group's passes (recorded by backends with ep_size > 1)."""
        if self._balance is None:
            self._balance = BalancednessRecorder()
        return self._balance

    def host_effect(self, fn: Callable[[], None]) -> None:
        """Runs `fn`, host-side bookkeeping of the step (statistics, loads to record). While
        `taping`, it is also kept: a graph replay does the device work only, so whoever replays
        the captured step runs the tape after it."""
        fn()
        if self._tape is not None:
            self._tape.append(fn)

    @contextmanager
    def taping(self) -> Iterator[list[Callable[[], None]]]:
        """The host effects of the steps run inside, in order (for a CUDA graph capture)."""
        tape: list[Callable[[], None]] = []
        self._tape = tape
        try:
            yield tape
        finally:
            self._tape = None

    def discard_step(self) -> None:
        """Forgets the loads of a step that is not a pass (warm-up and capture runs)."""
        self.end_micro_batches()
        self._layer_loads = []
        self._micro = None

    def _record_loads(self, loads: torch.Tensor | list[int]) -> None:
        """One MoE layer's per-rank loads (device vector or host list) for this step's pass."""

        def record() -> None:
            if self._layer_loads is None:
                self._layer_loads = []
            self._layer_loads.append(loads)

        self.host_effect(record)

    def end_step(self) -> None:
        """Closes the step's pass in the balancedness record (after the step's last layer); a
        split step's layer loads are the sums of its micro-batches'."""
        self.end_micro_batches()
        if self._micro is not None:
            per_batch = [_host_loads(mb.loads) for mb in self._micro]
            layers = [
                [sum(v) for v in zip(*rows, strict=True)] for rows in zip(*per_batch, strict=True)
            ]
            self._micro = None
        else:
            layers = _host_loads(self._layer_loads or [])
        for loads in layers:
            self.balance.record_layer(loads)
        self._layer_loads = []
        self.balance.end_pass()

    def _note_share(self, received_by_busiest: int, step_tokens: int) -> None:
        if step_tokens > 0:
            share = received_by_busiest / step_tokens

            def note() -> None:
                self.step_peak_share = max(self.step_peak_share or 0.0, share)

            self.host_effect(note)

    @property
    def budget(self) -> int | None:
        return self.buffers.max_recv_tokens if self.buffers is not None else None

    @abstractmethod
    def prepare(self, hidden_states: torch.Tensor, topk: TopKOutput) -> Steps[Any]:
        """Shares counts and plans the rounds; returns the state the other stages take."""

    @abstractmethod
    def num_rounds(self, state: Any) -> int: ...

    @abstractmethod
    def dispatch(self, state: Any, round_index: int) -> Steps[DispatchOutput]: ...

    @abstractmethod
    def combine(
        self,
        state: Any,
        round_index: int,
        combine_input: CombineInput,
        during: Callable[[], None] | None = None,
    ) -> Steps[None]:
        """Brings a round's results back; `during` runs once the transfer is issued, before it
        is waited for (single-batch overlap: the shared experts)."""

    @abstractmethod
    def finish(self, state: Any) -> Steps[torch.Tensor]:
        """[T, H] for the T tokens that entered `prepare`, summed over all their experts."""

    def _wait(self, pending: Pending, during: Callable[[], None] | None = None) -> Steps[Any]:
        """A collective's result: `during` first, then (asynchronous) a turn for the other
        micro-batch while it moves."""
        if during is not None:
            during()
        if self.asynchronous:
            yield
        return pending.wait()

    def steps(
        self,
        hidden_states: torch.Tensor,
        topk: TopKOutput,
        experts: Experts,
        on_phase: Callable[[str], None] | None = None,
        during_combine: Callable[[], None] | None = None,
    ) -> Steps[torch.Tensor]:
        """The whole dispatch; `during_combine` runs while the last round's combine moves."""
        phase = on_phase or (lambda p: None)
        phase("dispatch")
        state = yield from self.prepare(hidden_states, topk)
        rounds = self.num_rounds(state)
        buffers = self.buffers
        if buffers is not None and rounds > 1:
            self.host_effect(buffers.stats.count_cut)
        for r in range(rounds):
            phase("dispatch")
            d = yield from self.dispatch(state, r)
            if buffers is not None:
                rows = d.hidden_states.shape[0]
                self.host_effect(lambda rows=rows: buffers.record_round(rows))
                d.workspace = buffers
            phase("experts")
            out = experts(d)
            phase("combine")
            yield from self.combine(state, r, out, during_combine if r == rounds - 1 else None)
        return (yield from self.finish(state))

    def run(
        self,
        hidden_states: torch.Tensor,
        topk: TopKOutput,
        experts: Experts,
        on_phase: Callable[[str], None] | None = None,
    ) -> torch.Tensor:
        return drive(self.steps(hidden_states, topk, experts, on_phase))


def _host_loads(loads: list[Any]) -> list[list[int]]:
    """Per-layer loads as host lists (device vectors moved in one transfer)."""
    device = [x for x in loads if isinstance(x, torch.Tensor)]
    moved = iter(torch.stack(device).tolist()) if device else iter(())
    return [next(moved) if isinstance(x, torch.Tensor) else list(x) for x in loads]


def recv_views(
    buffers: DispatchBuffers | None, rows: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Views of the preallocated receive buffers for `rows` rows (None without admission)."""
    if buffers is None:
        return None, None
    return buffers.hidden[:rows], buffers.routing[:rows]
