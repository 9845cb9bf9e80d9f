"""A rank's half of EPLB: it counts the tokens its MoE layers route, reports them when the
leader collects, and moves expert weights when the leader's plan says so (`engine/eplb.py` is
the leader's half).

Each MoE layer counts its routed choices per physical slot on the device
(`ExpertDistributionRecorder`: a scatter-add a CUDA graph can hold); passes are closed after
every served step, and only served steps count (not warm-up or graph capture). Before the
placement changes, and when the leader collects, the physical counts are folded into counts per
logical expert under the placement they were recorded with, so a collect that spans a move
stays exact. A move changes the stacked expert weights and the routers' maps in place (the
tensors that captured graphs read), one chunk of layers per EPLB step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from safeserve.engine.plan import EplbCollect, EplbMove, EplbRankReport
from safeserve.messages import EPLB_MOVE_PHASE
from safeserve.model.sharding import routing_source
from safeserve.moe.eplb.move import layer_transfers, move_layer
from safeserve.moe.eplb.recorder import ExpertDistributionRecorder, physical_to_logical_counts
from safeserve.moe.expert_map import ExpertMap
from safeserve.moe.layer import MoELayer, write_expert_map
from safeserve.moe.placement import ExpertPlacement

# The rank's ModelRunner (which builds this: typed loosely, or the two modules would import each
# other): its args, device, layout, comm, dispatcher, model, on_phase and expert_map.
ModelRunner = Any


class RankEplb:
    """The recorder of a rank's MoE layers and the moves of their expert weights."""

    def __init__(self, runner: ModelRunner, layers: list[MoELayer]) -> None:
        m = runner.expert_map
        assert m is not None and len(layers) == m.num_layers
        self.runner = runner
        self.layers = layers
        self.recorder = ExpertDistributionRecorder.for_map(m, runner.device, enabled=False)
        for i, layer in enumerate(layers):
            layer.recorder, layer.moe_index = self.recorder, i
        self._logical = torch.zeros(m.num_layers, m.num_logical, dtype=torch.int64)
        self._passes = 0

    @staticmethod
    def build(runner: ModelRunner) -> RankEplb | None:
        """The rank's EPLB half where --enable-eplb is given and the model routes experts."""
        if not runner.args.enable_eplb or runner.expert_map is None:
            return None
        layers = [layer.mlp for layer in runner.model.layers if layer.is_moe]
        return RankEplb(runner, layers)

    # -- counting ------------------------------------------------------------------------------
    def begin_serving(self) -> None:
        self.recorder.reset()
        self._logical.zero_()
        self._passes = 0
        self.recorder.enabled = True
        # the fold's first run loads its kernels (about 20 ms on an H200): not in a move's stall
        m = self.runner.expert_map
        assert m is not None
        index = m.phy2log_tensor().to(self.runner.device)
        physical_to_logical_counts(self.recorder.dump(), index, m.num_logical).cpu()

    def end_step(self) -> None:
        self.recorder.end_pass()

    def discard_step(self) -> None:
        self.recorder.discard_pass()

    def _fold(self) -> None:
        """The device's physical counts into the logical ones, under the current placement."""
        m = self.runner.expert_map
        assert m is not None
        if self.recorder.passes:
            index = m.phy2log_tensor().to(self.runner.device)
            logical = physical_to_logical_counts(self.recorder.dump(), index, m.num_logical)
            self._logical += logical.cpu()
            self._passes += self.recorder.passes
        self.recorder.reset()

    # -- EPLB steps ----------------------------------------------------------------------------
    def run(self, step: int, op: EplbCollect | EplbMove) -> EplbRankReport:
        start = time.perf_counter()
        if isinstance(op, EplbCollect):
            self._fold()
            report = EplbRankReport(counts=self._logical.tolist(), passes=self._passes)
            if op.reset:
                self._logical.zero_()
                self._passes = 0
        else:
            self.runner.on_phase(step, EPLB_MOVE_PHASE)
            report = EplbRankReport(sent_bytes=self.move(op))
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        report.seconds = time.perf_counter() - start
        return report

    def move(self, op: EplbMove) -> int:
        """Moves the weights of `op`'s layers to its rows and routes by the new placement;
        the bytes this rank sent."""
        self._fold()  # the counts so far belong to the old placement
        runner = self.runner
        old = runner.expert_map
        assert old is not None
        rank = runner.layout.ep_rank
        rows = [list(r) for r in old.phy2log]
        sent = 0
        for layer, row in zip(op.layers, op.rows, strict=True):
            transfers = layer_transfers(old.phy2log[layer], row, old.slots_per_rank)
            sent += move_layer(expert_weights(self.layers[layer]), transfers, rank, runner.comm)
            rows[layer] = list(row)
        new = ExpertMap.from_phy2log(rows, old.num_logical, old.ep_size, old.seed)
        set_expert_map(runner, self.layers, new, changed=op.layers)
        return sent


def expert_weights(layer: MoELayer) -> list[torch.Tensor]:
    """The stacked per-slot tensors of a layer's routed experts (what a move carries): FP8
    experts' block scales too."""
    slots = layer.experts.w13.shape[0]
    return [p.data for p in layer.experts.parameters() if p.dim() > 0 and p.shape[0] == slots]


def set_expert_map(
    runner: ModelRunner,
    layers: list[MoELayer],
    expert_map: ExpertMap,
    changed: Sequence[int] | None = None,
) -> None:
    """Makes `expert_map` the rank's placement: the routers' maps (in place; of the `changed`
    MoE layers only where given), the dispatcher's and the layers' view of it, the runner's.
    The weights must already be where it says."""
    write_expert_map(layers, expert_map, routing_source(runner.layout), changed)
    placement = ExpertPlacement.of(expert_map, runner.layout.ep_rank)
    if runner.dispatcher is not None:
        runner.dispatcher.placement = placement
    for layer in layers:
        layer.placement = placement
    runner.expert_map = expert_map
