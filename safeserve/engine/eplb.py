"""The leader's half of EPLB: when to rebalance, the new placement, and the chunks of the move
(`rank_eplb.py` is every rank's half); also the admin recording of the expert distribution.

Every `--eplb-rebalance-num-iterations` served passes the leader collects the group's routed
tokens per logical expert since the previous check (an EPLB step: a plan with no sequences that
every rank answers). The check is skipped when the balancedness measured over those passes is
above `--eplb-min-rebalancing-utilization-threshold`, when nothing was routed, or when the
algorithm's placement for that routing (DeepSeek's, refined for how the routers spread tokens
over replicas: `moe/eplb/refine.py`) is the current one; otherwise the MoE layers whose
placement changes move in chunks of `--eplb-rebalance-layers-per-chunk`, one EPLB step between
two model steps each, so no step carries the whole move and requests keep running in between
(a layer routes by its new placement from the step its weights have moved in).

Distribution recording (POST /admin/expert_distribution/start|stop|dump) reads the same counts:
a collect that does not reset the window gives what was counted since the last check, the
checks' windows are summed while recording.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from safeserve.config import ServerArgs
from safeserve.engine.plan import EplbCollect, EplbMove, EplbOp, EplbRankReport
from safeserve.messages import EplbCheck, EplbCommand, EplbReply, EplbStatus
from safeserve.moe.eplb.balancedness import BalancednessRecorder, layer_balancedness
from safeserve.moe.eplb.location import placement_of_counts
from safeserve.moe.eplb.refine import refine_placement
from safeserve.moe.expert_map import ExpertMap

logger = logging.getLogger(__name__)

# Run an EPLB step on every rank, return each rank's report (Engine.run_eplb).
RunEplb = Callable[[EplbOp], list[EplbRankReport]]
# Routed tokens per (layer, logical expert) by who routed them: an EP rank (its candidates), or
# None (every replica: `ExpertMap.candidates`).
Sources = list[tuple[int | None, torch.Tensor]]


class EplbController:
    """One group's rebalancing state on its leader."""

    def __init__(
        self,
        args: ServerArgs,
        expert_map: Callable[[], ExpertMap],
        balance: BalancednessRecorder | None,
        counts_summed: bool,
        num_groups: int = 1,
    ) -> None:
        """`expert_map`: the group's current placement; `balance`: the measured balancedness
        per pass (the leader's dispatcher's); `counts_summed`: each rank counts its own tokens
        (attention data-parallel) so the group's counts are the ranks' sum, else every rank
        counts every token and the leader's own counts are the group's."""
        self.enabled = args.enable_eplb
        self.interval = args.eplb_rebalance_num_iterations
        self.chunk = args.eplb_rebalance_layers_per_chunk
        self.threshold = args.eplb_min_rebalancing_utilization_threshold
        self.report = args.expert_balancedness_report_mode in ("log", "both")
        self.expert_map = expert_map
        self.balance = balance
        self.counts_summed = counts_summed
        self.num_groups = num_groups
        self.passes_since_check = 0
        self.pending: list[EplbMove] = []
        self.rebalances = 0
        self.skipped = 0
        self.moved_bytes_total = 0
        self.pause_seconds_total = 0.0
        self.last: EplbCheck | None = None
        self.last_rebalance: EplbCheck | None = None
        self._move_started = 0.0
        self._after_from = 0  # balance.total when the last rebalance finished
        # admin recording: counts of the checks' windows since start, minus what the window held
        # at start (`_base`)
        self.recording = False
        self._recorded: torch.Tensor | None = None
        self._base: torch.Tensor | None = None
        self._recorded_passes = 0
        self._base_passes = 0
        self._replicas: tuple[ExpertMap, int] | None = None  # (map, its most replicas)

    # -- when ------------------------------------------------------------------------------------
    def on_pass(self) -> None:
        """A served forward pass ran on every rank."""
        self.passes_since_check += 1

    def next_op(self) -> EplbOp | None:
        """The EPLB step to run before the next model step, if one is due."""
        if not self.enabled:
            return None
        if self.pending:
            return self.pending[0]
        if self.passes_since_check >= self.interval:
            return EplbCollect(reset=True)
        return None

    # -- what came of an EPLB step ---------------------------------------------------------------
    def done(self, op: EplbOp, reports: Sequence[EplbRankReport]) -> None:
        if isinstance(op, EplbMove):
            self._moved(op, reports)
            return
        counts, passes = self._counts(reports)
        self._window(counts, passes)
        self._check(counts, passes, self._sources(reports, counts))

    def _counts(self, reports: Sequence[EplbRankReport]) -> tuple[torch.Tensor, int]:
        used = reports if self.counts_summed else reports[:1]
        counts = sum(torch.tensor(r.counts, dtype=torch.int64) for r in used)
        assert isinstance(counts, torch.Tensor)
        return counts, reports[0].passes

    def _sources(self, reports: Sequence[EplbRankReport], counts: torch.Tensor) -> Sources:
        """Who routed the counted tokens: each EP rank its own (attention data-parallel); where
        every rank routes the same tokens, each rank's equal share of them spreads as that rank
        would (`moe/topk.py`, `Router.spread`)."""
        if not self.counts_summed:
            ep = len(reports)
            return [(r, counts.to(torch.float64) / ep) for r in range(ep)]
        return [(r, torch.tensor(rep.counts, dtype=torch.int64)) for r, rep in enumerate(reports)]

    def _check(self, counts: torch.Tensor, passes: int, sources: Sources) -> None:
        self.passes_since_check = 0
        m = self.expert_map()
        measured = self.balance.mean_of_last(passes) if self.balance is not None else None
        before = measured if measured is not None else predicted_balancedness(m, sources)
        check = EplbCheck(time.time(), passes, before, "skipped", "")
        if int(counts.sum()) == 0:
            check.reason = "no routed tokens since the last check"
        elif before > self.threshold:
            check.reason = (
                f"balancedness {before:.3f} over {passes} passes is above "
                f"--eplb-min-rebalancing-utilization-threshold {self.threshold}"
            )
        else:
            new = placement_of_counts(counts, m.num_physical, m.ep_size, self.num_groups, m.seed)
            # DeepSeek's placement assumes equal shares per replica; the routers keep a rank's
            # tokens on its own replicas: refine it for that (moe/eplb/refine.py)
            new = refine_placement(new, sources)
            check.balancedness_predicted = predicted_balancedness(new, sources)
            layers = [i for i in range(m.num_layers) if new.phy2log[i] != m.phy2log[i]]
            if not layers:
                check.reason = "the placement for this routing is the current one"
            else:
                check.outcome = "in_progress"
                check.reason = f"{len(layers)} of {m.num_layers} MoE layers move"
                self.pending = [
                    EplbMove(tuple(part), tuple(new.phy2log[i] for i in part))
                    for part in (
                        layers[k : k + self.chunk] for k in range(0, len(layers), self.chunk)
                    )
                ]
                self._move_started = time.perf_counter()
                check.duration_s, check.longest_pause_s = 0.0, 0.0
        if check.outcome == "skipped":
            self.skipped += 1
        self.last = check
        if self.report:
            logger.info(
                "EPLB check: balancedness %.3f over %d passes; %s: %s",
                before,
                passes,
                check.outcome,
                check.reason,
            )

    def _moved(self, op: EplbMove, reports: Sequence[EplbRankReport]) -> None:
        self.pending.pop(0)
        check = self.last
        assert check is not None
        pause = max(r.seconds for r in reports)
        sent = sum(r.sent_bytes for r in reports)
        check.layers_moved += len(op.layers)
        check.moved_bytes += sent
        check.longest_pause_s = max(check.longest_pause_s or 0.0, pause)
        check.duration_s = time.perf_counter() - self._move_started
        self.moved_bytes_total += sent
        self.pause_seconds_total += pause
        if self.pending:
            return
        check.outcome = "rebalanced"
        self.rebalances += 1
        self.last_rebalance = check
        self._after_from = self.balance.total if self.balance is not None else 0
        if self.report:
            logger.info(
                "EPLB rebalance done: %d layers, %d bytes moved in %.3f s (longest step %.1f ms); "
                "balancedness %.3f before, %.3f predicted",
                check.layers_moved,
                check.moved_bytes,
                check.duration_s,
                check.longest_pause_s * 1e3,
                check.balancedness_before,
                check.balancedness_predicted or 0.0,
            )

    # -- admin recording -------------------------------------------------------------------------
    def _window(self, counts: torch.Tensor, passes: int) -> None:
        """A check's window closes: while recording, it is added to the recording."""
        if not self.recording:
            return
        base = self._base if self._base is not None else torch.zeros_like(counts)
        self._recorded = (self._recorded if self._recorded is not None else 0) + counts - base
        self._recorded_passes += passes - self._base_passes
        self._base, self._base_passes = None, 0

    def command(self, cmd: EplbCommand, run: RunEplb) -> EplbReply:
        """Answers an admin command (running the EPLB steps it needs through `run`)."""
        if cmd.op == "map":
            m = self.expert_map()
            return EplbReply(cmd.request_id, self.recording, phy2log=[list(r) for r in m.phy2log])
        if not self.enabled:
            return EplbReply(
                cmd.request_id,
                False,
                error="expert distribution recording needs a server started with --enable-eplb",
            )
        if cmd.op == "stop":
            self.recording = False
            return EplbReply(cmd.request_id, False)
        counts, passes = self._counts(run(EplbCollect(reset=False)))
        if cmd.op == "start":
            self.recording = True
            self._recorded, self._recorded_passes = torch.zeros_like(counts), 0
            self._base, self._base_passes = counts, passes
            return EplbReply(cmd.request_id, True)
        if self._recorded is None:
            return EplbReply(
                cmd.request_id, False, error="no recording: POST /admin/expert_distribution/start"
            )
        base = self._base if self._base is not None else torch.zeros_like(counts)
        total = self._recorded + (counts - base if self.recording else 0)
        total_passes = self._recorded_passes + (passes - self._base_passes if self.recording else 0)
        return EplbReply(
            cmd.request_id, self.recording, logical_count=total.tolist(), passes=total_passes
        )

    # -- what /admin/eplb shows ------------------------------------------------------------------
    def status(self) -> EplbStatus:
        m = self.expert_map()
        if self._replicas is None or self._replicas[0] is not m:
            self._replicas = (m, max(len(s) for layer in m.log2phy_rows() for s in layer))
        done = self.last_rebalance
        if done is not None and self.balance is not None:
            done.balancedness_after = self.balance.mean_of_last(
                self.balance.total - self._after_from
            )
        return EplbStatus(
            enabled=self.enabled,
            num_logical=m.num_logical,
            num_physical=m.num_physical,
            slots_per_rank=m.slots_per_rank,
            max_replicas=self._replicas[1],
            interval_passes=self.interval,
            passes_since_check=self.passes_since_check,
            threshold=self.threshold,
            rebalances=self.rebalances,
            skipped=self.skipped,
            moved_bytes_total=self.moved_bytes_total,
            pause_seconds_total=self.pause_seconds_total,
            layers_pending=sum(len(op.layers) for op in self.pending),
            last=self.last,
            last_rebalance=self.last_rebalance,
        )


def predicted_balancedness(expert_map: ExpertMap, sources: Sources) -> float:
    """The balancedness the routed tokens of `sources` would have under `expert_map`: the mean
    over layers of (mean rank load) / (max rank load), each source's `counts[L, E]` (tokens per
    logical expert) split equally over its candidates (`ExpertMap.candidates` of its EP rank,
    or of None: every replica), as the routers spread them. A rank's tokens stay on its own
    replicas where it holds any, so a replica only non-holders reach takes less than an equal
    share of its expert's tokens."""
    m = expert_map
    values = []
    for layer in range(m.num_layers):
        loads = [0.0] * m.ep_size
        for source, counts in sources:
            row = counts[layer].tolist()
            cands = m.candidate_rows(source)[layer]
            for e in range(m.num_logical):
                for p in cands[e]:
                    loads[m.rank_of(p)] += row[e] / len(cands[e])
        values.append(layer_balancedness(loads))
    return sum(values) / len(values) if values else 1.0
