"""The dispatcher interface and the small types that pass between the MoE stages.

A dispatch runs in one or more rounds (admission: no rank receives more rows in a round than
its budget). `run` drives them: `prepare` (share counts, plan rounds), then per round
`dispatch` -> experts -> `combine`, then `finish` (per-token sums).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from safeserve.guards.admission import DispatchBuffers
from safeserve.moe.eplb.balancedness import BalancednessRecorder
from safeserve.moe.placement import ExpertPlacement
from safeserve.moe.topk import TopKOutput


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

    # Per-rank expert loads of this step's MoE layers still on the device (backends that only
    # know them there); `end_step` moves them to the recorder in one transfer.
    _device_loads: list[torch.Tensor] | None = None
    _balance: BalancednessRecorder | None = None
    # While a CUDA graph captures a step: the step's host bookkeeping, to run after each replay.
    _tape: list[Callable[[], None]] | None = None

    def begin_step(self, step: StepTokens) -> None:
        self.step = step
        self.step_peak_share = None

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
        """Forgets the device loads of a step that is not a pass (warm-up and capture runs)."""
        self._device_loads = []

    def _record_device_loads(self, loads: torch.Tensor) -> None:
        def record() -> None:
            if self._device_loads is None:
                self._device_loads = []
            self._device_loads.append(loads)

        self.host_effect(record)

    def end_step(self) -> None:
        """Closes the step's pass in the balancedness record (after the step's last layer)."""
        if self._device_loads:
            for loads in torch.stack(self._device_loads).tolist():
                self.balance.record_layer(loads)
            self._device_loads = []
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
    def prepare(self, hidden_states: torch.Tensor, topk: TopKOutput) -> Any:
        """Shares counts and plans the rounds; returns the state the other calls take."""

    @abstractmethod
    def num_rounds(self, state: Any) -> int: ...

    @abstractmethod
    def dispatch(self, state: Any, round_index: int) -> DispatchOutput: ...

    @abstractmethod
    def combine(self, state: Any, round_index: int, combine_input: CombineInput) -> None: ...

    @abstractmethod
    def finish(self, state: Any) -> torch.Tensor:
        """[T, H] for the T tokens that entered `prepare`, summed over all their experts."""

    def run(
        self,
        hidden_states: torch.Tensor,
        topk: TopKOutput,
        experts: Experts,
        on_phase: Callable[[str], None] | None = None,
    ) -> torch.Tensor:
        phase = on_phase or (lambda p: None)
        phase("dispatch")
        state = self.prepare(hidden_states, topk)
        rounds = self.num_rounds(state)
        buffers = self.buffers
        if buffers is not None and rounds > 1:
            self.host_effect(buffers.stats.count_cut)
        for r in range(rounds):
            phase("dispatch")
            d = self.dispatch(state, r)
            if buffers is not None:
                rows = d.hidden_states.shape[0]
                self.host_effect(lambda rows=rows: buffers.record_round(rows))
                d.workspace = buffers
            phase("experts")
            out = experts(d)
            phase("combine")
            self.combine(state, r, out)
        return self.finish(state)


def recv_views(
    buffers: DispatchBuffers | None, rows: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Views of the preallocated receive buffers for `rows` rows (None without admission)."""
    if buffers is None:
        return None, None
    return buffers.hidden[:rows], buffers.routing[:rows]
