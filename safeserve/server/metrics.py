"""Every Prometheus metric of safeserve (prefix `safeserve:`), defined once, here."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# `*_created` series double the output and nobody reads them.
disable_created_metrics()

PREFIX = "safeserve:"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5)


class Metrics:
    """One registry per server; names are documented in README.md (Metrics)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "requests",
            "Finished HTTP requests by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens admitted.", registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens",
            "Tokens generated, by the group that generated them.",
            ["group"],
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            PREFIX + "num_requests_running",
            "Requests holding KV blocks in a group.",
            ["group"],
            registry=r,
        )
        self.waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests queued in a group.", ["group"], registry=r
        )
        self.kv_used = Gauge(
            PREFIX + "kv_blocks_used", "KV-cache blocks in use, per group.", ["group"], registry=r
        )
        self.kv_total = Gauge(
            PREFIX + "kv_blocks_total", "KV-cache blocks, per group.", ["group"], registry=r
        )
        self.preemptions = Gauge(
            PREFIX + "num_preemptions",
            "Requests preempted (recomputed later) since start, per group.",
            ["group"],
            registry=r,
        )
        self.group_ready = Gauge(
            PREFIX + "group_ready", "1 while the group serves requests.", ["group"], registry=r
        )
        self.heartbeat_age = Gauge(
            PREFIX + "rank_heartbeat_age_seconds",
            "Seconds since a rank's last heartbeat.",
            ["group", "rank"],
            registry=r,
        )
        self.rank_utilization = Gauge(
            PREFIX + "rank_utilization",
            "GPU utilization of a rank's device, or its process's share of one CPU core (0..1).",
            ["group", "rank"],
            registry=r,
        )
        self.rank_memory = Gauge(
            PREFIX + "rank_memory_bytes",
            "Device memory allocated by a rank (GPU) or its resident memory (CPU).",
            ["group", "rank"],
            registry=r,
        )
        self.watchdog_verdicts = Counter(
            PREFIX + "watchdog_verdicts",
            "Watchdog verdicts: dead, crashed and stalled fence the group; slow is reported only.",
            ["group", "verdict"],
            registry=r,
        )
        self.dispatch_budget = Gauge(
            PREFIX + "dispatch_budget_tokens",
            "Rows a rank may receive in one dispatch round (admission budget).",
            ["group", "rank"],
            registry=r,
        )
        self.dispatch_recv_peak = Gauge(
            PREFIX + "dispatch_recv_tokens_peak",
            "Most rows a rank received in one dispatch round since start.",
            ["group", "rank"],
            registry=r,
        )
        self.dispatch_rounds = Gauge(
            PREFIX + "dispatch_rounds_total",
            "Dispatch rounds run by a rank since start (one per MoE layer and step, more when "
            "admission cuts a dispatch).",
            ["group", "rank"],
            registry=r,
        )
        self.dispatch_cut = Gauge(
            PREFIX + "dispatch_cut_total",
            "Dispatches admission cut into more than one round, per rank, since start.",
            ["group", "rank"],
            registry=r,
        )
        self.dispatch_buffer_bytes = Gauge(
            PREFIX + "dispatch_buffer_bytes",
            "Preallocated dispatch buffer bytes of a rank.",
            ["group", "rank"],
            registry=r,
        )
        self.dispatch_buffer_peak_bytes = Gauge(
            PREFIX + "dispatch_buffer_peak_bytes",
            "Most dispatch buffer bytes a rank ever used.",
            ["group", "rank"],
            registry=r,
        )
        self.eplb_balancedness = Gauge(
            PREFIX + "eplb_balancedness",
            "How evenly a group's expert-parallel ranks share the routed (token, expert) pairs: "
            "mean over MoE layers of mean/max per-rank load, averaged over the last `window` "
            "passes; 1 is even, 1/ep_size is all on one rank. Only groups with ep_size > 1.",
            ["group", "window"],
            registry=r,
        )
        self.group_state = Gauge(
            PREFIX + "group_state", "1 for a group's current state.", ["group", "state"], registry=r
        )
        self.group_failures = Counter(
            PREFIX + "group_failures",
            "Group failures (fenced: all its processes killed).",
            ["group"],
            registry=r,
        )
        self.group_restarts = Counter(
            PREFIX + "group_restarts", "Group restarts.", ["group"], registry=r
        )
        self.migrations = Counter(
            PREFIX + "request_migrations",
            "Requests continued on another group after theirs failed (prompt + tokens already sent).",
            registry=r,
        )
        self.retries = Counter(
            PREFIX + "request_retries", "Attempts beyond a request's first.", registry=r
        )
        self.lost = Counter(
            PREFIX + "requests_lost",
            "Requests that ended without a complete answer or a clean error (must stay 0).",
            registry=r,
        )
        self.failed_after_retries = Counter(
            PREFIX + "requests_failed_after_retries",
            "Requests answered 503 after their attempts or the retry budget ran out.",
            registry=r,
        )
        self.suspects = Gauge(
            PREFIX + "requests_suspect",
            "Requests that were in flight on a group when it failed, not yet ended (running on "
            "another group, or waiting for one that holds no other suspect).",
            registry=r,
        )
        self.suspects_cleared = Counter(
            PREFIX + "requests_suspect_cleared",
            "Suspects that ended without a second group failing under them (completed, ended "
            "by their client, or failed cleanly).",
            registry=r,
        )
        self.quarantined = Counter(
            PREFIX + "requests_quarantined",
            "Requests in flight on two groups when each failed: answered 422 "
            "request_quarantined, never retried.",
            registry=r,
        )
        self.quarantine_refusals = Counter(
            PREFIX + "quarantine_refusals",
            "Requests refused at admission (422 request_quarantined): identical to a "
            "quarantined one.",
            registry=r,
        )
        self.quarantine_fingerprints = Gauge(
            PREFIX + "quarantine_fingerprints",
            "Fingerprints refused at admission now (at most 10,000; each for --quarantine-s).",
            registry=r,
        )
        self.in_flight = Gauge(
            PREFIX + "requests_in_flight",
            "Requests the frontend holds (queued or generating).",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
