"""Every Prometheus metric of safeserve (prefix `safeserve:`), declared once, in `METRICS`; and
`count_tbo_steps`, which turns a group's per-incarnation step counts into counter increments."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase

from safeserve.messages import TBO_DECISIONS, EngineStats

# `*_created` series double the output and nobody reads them.
disable_created_metrics()

PREFIX = "safeserve:"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5)

GROUP = ("group",)
RANK = ("group", "rank")


@dataclass(frozen=True)
class MetricSpec:
    attr: str  # the attribute of `Metrics` that holds it
    kind: type[MetricWrapperBase]  # Counter, Gauge or Histogram
    name: str  # after PREFIX; prometheus_client renders a Counter's family as `<name>_total`
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # Histogram only

    def build(self, registry: CollectorRegistry) -> MetricWrapperBase:
        extra = {} if self.buckets is None else {"buckets": self.buckets}
        return self.kind(PREFIX + self.name, self.help, self.labels, registry=registry, **extra)


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "requests",
        Counter,
        "requests",
        "Finished HTTP requests by endpoint and status code.",
        ("endpoint", "status"),
    ),
    MetricSpec("prompt_tokens", Counter, "prompt_tokens", "Prompt tokens admitted."),
    MetricSpec(
        "generation_tokens",
        Counter,
        "generation_tokens",
        "Tokens generated, by the group that generated them.",
        GROUP,
    ),
    MetricSpec(
        "ttft",
        Histogram,
        "time_to_first_token_seconds",
        "Time from request arrival to first token.",
        buckets=_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "tpot",
        Histogram,
        "time_per_output_token_seconds",
        "Mean time per output token after the first.",
        buckets=_TPOT_BUCKETS,
    ),
    MetricSpec(
        "e2e",
        Histogram,
        "e2e_request_latency_seconds",
        "Time from arrival to the last token.",
        buckets=_LATENCY_BUCKETS,
    ),
    MetricSpec(
        "running", Gauge, "num_requests_running", "Requests holding KV blocks in a group.", GROUP
    ),
    MetricSpec("waiting", Gauge, "num_requests_waiting", "Requests queued in a group.", GROUP),
    MetricSpec("kv_used", Gauge, "kv_blocks_used", "KV-cache blocks in use, per group.", GROUP),
    MetricSpec("kv_total", Gauge, "kv_blocks_total", "KV-cache blocks, per group.", GROUP),
    MetricSpec(
        "preemptions",
        Gauge,
        "num_preemptions",
        "Requests preempted (recomputed later) since start, per group.",
        GROUP,
    ),
    MetricSpec("group_ready", Gauge, "group_ready", "1 while the group serves requests.", GROUP),
    MetricSpec(
        "heartbeat_age",
        Gauge,
        "rank_heartbeat_age_seconds",
        "Seconds since a rank's last heartbeat.",
        RANK,
    ),
    MetricSpec(
        "rank_utilization",
        Gauge,
        "rank_utilization",
        "GPU utilization of a rank's device, or its process's share of one CPU core (0..1).",
        RANK,
    ),
    MetricSpec(
        "rank_memory",
        Gauge,
        "rank_memory_bytes",
        "Device memory allocated by a rank (GPU) or its resident memory (CPU).",
        RANK,
    ),
    MetricSpec(
        "watchdog_verdicts",
        Counter,
        "watchdog_verdicts",
        "Watchdog verdicts: dead, crashed, stalled and corrupt fence the group; slow is reported "
        "only.",
        ("group", "verdict"),
    ),
    MetricSpec(
        "canary_runs",
        Counter,
        "canary_runs",
        "Canary runs (--canary-interval-s, GET /health/generate) by result: reference (a group's "
        "first), ok, corrupt (wrong twice: the group is fenced), timeout, error, unavailable.",
        ("group", "result"),
    ),
    MetricSpec(
        "dispatch_budget",
        Gauge,
        "dispatch_budget_tokens",
        "Rows a rank may receive in one dispatch round (admission budget).",
        RANK,
    ),
    MetricSpec(
        "dispatch_recv_peak",
        Gauge,
        "dispatch_recv_tokens_peak",
        "Most rows a rank received in one dispatch round since start.",
        RANK,
    ),
    MetricSpec(
        "dispatch_rounds",
        Gauge,
        "dispatch_rounds_total",
        "Dispatch rounds run by a rank since start (one per MoE layer and step, more when "
        "admission cuts a dispatch).",
        RANK,
    ),
    MetricSpec(
        "dispatch_cut",
        Gauge,
        "dispatch_cut_total",
        "Dispatches admission cut into more than one round, per rank, since start.",
        RANK,
    ),
    MetricSpec(
        "dispatch_buffer_bytes",
        Gauge,
        "dispatch_buffer_bytes",
        "Preallocated dispatch buffer bytes of a rank.",
        RANK,
    ),
    MetricSpec(
        "dispatch_buffer_peak_bytes",
        Gauge,
        "dispatch_buffer_peak_bytes",
        "Most dispatch buffer bytes a rank ever used.",
        RANK,
    ),
    MetricSpec(
        "eplb_balancedness",
        Gauge,
        "eplb_balancedness",
        "How evenly a group's expert-parallel ranks share the routed (token, expert) pairs: "
        "mean over MoE layers of mean/max per-rank load, averaged over the last `window` "
        "passes; 1 is even, 1/ep_size is all on one rank. Only groups with ep_size > 1.",
        ("group", "window"),
    ),
    MetricSpec(
        "eplb_rebalances",
        Gauge,
        "eplb_rebalances_total",
        "Rebalances that moved expert weights, per group, since the group last started "
        "(--enable-eplb).",
        GROUP,
    ),
    MetricSpec(
        "eplb_skipped",
        Gauge,
        "eplb_rebalances_skipped_total",
        "Rebalance checks that moved nothing (balanced enough, nothing routed, or the placement "
        "already the best), per group, since the group last started; the reason is in "
        "GET /admin/eplb.",
        GROUP,
    ),
    MetricSpec(
        "eplb_moved_bytes",
        Gauge,
        "eplb_moved_bytes_total",
        "Expert weight bytes sent between a group's ranks by rebalances since it last started.",
        GROUP,
    ),
    MetricSpec(
        "eplb_pause_seconds",
        Gauge,
        "eplb_pause_seconds_total",
        "Seconds a group spent in EPLB weight-move steps (between model steps) since it last "
        "started.",
        GROUP,
    ),
    MetricSpec(
        "eplb_longest_pause",
        Gauge,
        "eplb_rebalance_longest_step_seconds",
        "The longest single EPLB step of the group's last rebalance: the longest stall a "
        "rebalance put between two model steps.",
        GROUP,
    ),
    MetricSpec(
        "eplb_passes_since_check",
        Gauge,
        "eplb_passes_since_check",
        "Forward passes since the group's last rebalance check; above "
        "safeserve:eplb_rebalance_interval_passes the check was due and did not run.",
        GROUP,
    ),
    MetricSpec(
        "eplb_interval",
        Gauge,
        "eplb_rebalance_interval_passes",
        "--eplb-rebalance-num-iterations of a group with EPLB on.",
        GROUP,
    ),
    MetricSpec(
        "tbo_steps",
        Counter,
        "tbo_steps",
        "Served forward steps (not the start-up warm-up's) by two-batch-overlap decision "
        "(--enable-two-batch-overlap), per group: "
        + ", ".join(TBO_DECISIONS)
        + ". No series before a group reports a decision (none with the flag off).",
        ("group", "decision"),
    ),
    MetricSpec(
        "group_state", Gauge, "group_state", "1 for a group's current state.", ("group", "state")
    ),
    MetricSpec(
        "node_state",
        Gauge,
        "node_state",
        "1 for a node agent's current state, READY or LOST (--placement remote).",
        ("node", "state"),
    ),
    MetricSpec(
        "node_refused",
        Gauge,
        "node_refused",
        "Frames and handshakes refused on the node port since start, by reason (malformed, "
        "unknown_type, replayed, unknown_sender, handshake_auth, ...).",
        ("reason",),
    ),
    MetricSpec(
        "group_failures",
        Counter,
        "group_failures",
        "Group failures (fenced: all its processes killed).",
        GROUP,
    ),
    MetricSpec("group_restarts", Counter, "group_restarts", "Group restarts.", GROUP),
    MetricSpec(
        "migrations",
        Counter,
        "request_migrations",
        "Requests continued on another group after theirs failed (prompt + tokens already sent).",
    ),
    MetricSpec("retries", Counter, "request_retries", "Attempts beyond a request's first."),
    MetricSpec(
        "shed",
        Counter,
        "requests_shed",
        "Requests refused with 503 because --max-queued-requests were already waiting.",
    ),
    MetricSpec(
        "sends_refused",
        Counter,
        "group_sends_refused",
        "Requests a READY group's leader could not take when sent (it died a moment before its "
        "watchdog failed the group, or its inbox was full); each went to another group or "
        "kept waiting where it was.",
        GROUP,
    ),
    MetricSpec(
        "router_picks",
        Counter,
        "router_picks",
        "Groups the router chose for a request: new (its first group), moved (still waiting, "
        "moved to a group that just became READY), migrated (continued after its group failed), "
        "canary (GET /health/generate).",
        ("group", "reason"),
    ),
    MetricSpec(
        "lost",
        Counter,
        "requests_lost",
        "Requests that ended without a complete answer or a clean error (must stay 0).",
    ),
    MetricSpec(
        "failed_after_retries",
        Counter,
        "requests_failed_after_retries",
        "Requests answered 503 after their attempts or the retry budget ran out.",
    ),
    MetricSpec(
        "suspects",
        Gauge,
        "requests_suspect",
        "Requests that were in flight on a group when it failed, not yet ended (running on "
        "another group, or waiting for one that holds no other suspect on probation).",
    ),
    MetricSpec(
        "suspects_cleared",
        Counter,
        "requests_suspect_cleared",
        "Suspects that ended without a second group failing under them (completed, ended "
        "by their client, or failed cleanly).",
    ),
    MetricSpec(
        "quarantined",
        Counter,
        "requests_quarantined",
        "Requests in flight on two groups when each failed: answered 422 "
        "request_quarantined, never retried.",
    ),
    MetricSpec(
        "quarantine_refusals",
        Counter,
        "quarantine_refusals",
        "Requests refused at admission (422 request_quarantined): identical to a quarantined one.",
    ),
    MetricSpec(
        "quarantine_fingerprints",
        Gauge,
        "quarantine_fingerprints",
        "Fingerprints refused at admission now (at most 10,000; each for --quarantine-s).",
    ),
    MetricSpec(
        "in_flight",
        Gauge,
        "requests_in_flight",
        "Requests the frontend holds (queued or generating).",
    ),
)


class Metrics:
    """One registry per server, with one attribute per `METRICS` entry (`spec.attr`); names are
    documented in README.md (Metrics)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        for spec in METRICS:
            setattr(self, spec.attr, spec.build(self.registry))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def count_tbo_steps(metrics: Metrics, group: int, seen: EngineStats, latest: EngineStats) -> None:
    """Adds to `tbo_steps_total` what a group's newest report (`latest`) counts beyond the one
    before it (`seen`). Both count since the group's incarnation started, and a new incarnation's
    GroupClient starts from an empty EngineStats, so a restart adds its steps from zero and no
    step is counted twice. Once TBO reports, every decision has a series (0 until it occurs)."""
    if not latest.tbo_steps:
        return
    for decision in TBO_DECISIONS:
        child = metrics.tbo_steps.labels(str(group), decision)
        new = latest.tbo_steps.get(decision, 0) - seen.tbo_steps.get(decision, 0)
        if new > 0:
            child.inc(new)
