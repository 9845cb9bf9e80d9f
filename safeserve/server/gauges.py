"""The metrics gauges, refreshed from the groups' latest reports when `/metrics` is scraped.

Per group: ready, running and waiting requests, KV blocks, preemptions, the expert-load
balancedness of each window and, with EPLB on, the rebalancing numbers; per rank: heartbeat age, utilization, memory and the dispatch
admission numbers; overall: the requests in flight.
"""

from __future__ import annotations

import contextlib
import time

from safeserve.messages import EplbStatus
from safeserve.moe.eplb.balancedness import WINDOWS as BALANCE_WINDOWS
from safeserve.moe.eplb.balancedness import group_balancedness
from safeserve.server.state import ServerState

NODE_STATES = ("READY", "LOST")


def refresh_gauges(state: ServerState) -> None:
    m = state.metrics
    now = time.time()
    export_balance = state.args.expert_balancedness_report_mode in ("prometheus", "both")
    for sup in state.supervisors:
        g = sup.client
        label = str(sup.group)
        m.group_ready.labels(label).set(1 if sup.ready else 0)
        if g is None:
            continue
        m.running.labels(label).set(g.stats.num_running)
        m.waiting.labels(label).set(g.stats.num_waiting)
        m.kv_used.labels(label).set(g.stats.kv_blocks_used)
        m.kv_total.labels(label).set(g.stats.kv_blocks_total)
        m.preemptions.labels(label).set(g.stats.num_preemptions)
        for r in g.ranks.values():
            rank = str(r.rank)
            m.heartbeat_age.labels(label, rank).set(max(0.0, now - r.received_at))
            m.rank_utilization.labels(label, rank).set(r.utilization)
            if r.stats.memory_bytes is not None:
                m.rank_memory.labels(label, rank).set(r.stats.memory_bytes)
            d = r.stats.dispatch
            if d is not None:
                for gauge, value in (
                    (m.dispatch_budget, d.budget_tokens),
                    (m.dispatch_recv_peak, d.recv_tokens_peak),
                    (m.dispatch_rounds, d.rounds_total),
                    (m.dispatch_cut, d.cut_total),
                    (m.dispatch_buffer_bytes, d.buffer_bytes),
                    (m.dispatch_buffer_peak_bytes, d.buffer_peak_bytes),
                ):
                    gauge.labels(label, rank).set(value)
        _eplb_gauges(state, label, g.stats.eplb)
        ranks = [st.stats for _, st in sorted(g.ranks.items())]
        balance = group_balancedness(ranks) if export_balance else {}
        for window in BALANCE_WINDOWS:
            if window in balance:
                m.eplb_balancedness.labels(label, str(window)).set(balance[window])
            else:  # none yet (a restarted group before its first pass): no stale series
                with contextlib.suppress(KeyError):
                    m.eplb_balancedness.remove(label, str(window))
    m.in_flight.set(len(state.generator.active) if state.generator else 0)
    hub = state.hub
    if hub is not None:
        for n in hub.nodes.values():
            current = "LOST" if n.lost is not None else "READY"
            for st in NODE_STATES:
                m.node_state.labels(n.node_id, st).set(1 if st == current else 0)
        for reason, count in (hub.reader.refused + hub.handshakes).items():
            m.node_refused.labels(reason).set(count)


def _eplb_gauges(state: ServerState, label: str, st: EplbStatus | None) -> None:
    """A group's rebalancing numbers; no series where EPLB is off."""
    if st is None or not st.enabled:
        return
    m = state.metrics
    last = st.last_rebalance
    for gauge, value in (
        (m.eplb_rebalances, st.rebalances),
        (m.eplb_skipped, st.skipped),
        (m.eplb_moved_bytes, st.moved_bytes_total),
        (m.eplb_pause_seconds, st.pause_seconds_total),
        (m.eplb_longest_pause, (last.longest_pause_s or 0.0) if last is not None else 0.0),
        (m.eplb_passes_since_check, st.passes_since_check),
        (m.eplb_interval, st.interval_passes),
    ):
        gauge.labels(label).set(value)
