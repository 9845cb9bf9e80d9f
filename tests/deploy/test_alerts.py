"""deploy/prometheus/alerts.yml: its structure, the metrics and labels its expressions name
(declared by safeserve, and exported by a live server), `promtool check rules`, and promtool's
rule unit tests: each alert fires on the series of the failure it is about, and none fires on
the series of a healthy server. The promtool tests skip where promtool is not installed.

PyYAML is no direct test dependency: transformers, huggingface_hub and schemathesis (test
extras) require it."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from promql import problems, refs, tokens

from safeserve.server.supervisor import SupervisorState

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
SEVERITIES = {"critical", "warning", "info"}
DURATION = re.compile(r"^(\d+(ms|[smhdwy]))+$")
NO_PROMTOOL = "promtool not installed (apt install prometheus)"


def load_rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_rules_structure() -> None:
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    names = [g["name"] for g in doc["groups"]]
    assert len(names) == len(set(names)), names
    alerts = []
    for group in doc["groups"]:
        assert group["rules"], group["name"]
        for rule in group["rules"]:
            name = rule.get("alert")
            assert name and name.startswith("Safeserve"), rule
            alerts.append(name)
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, name
            assert isinstance(rule["expr"], str) and rule["expr"].strip(), name
            assert DURATION.match(str(rule["for"])), (name, rule["for"])
            assert rule["labels"]["severity"] in SEVERITIES, name
            notes = rule["annotations"]
            assert {"summary", "description", "runbook"} <= set(notes), name
            assert notes["summary"].strip() and notes["description"].strip(), name
            runbook = ROOT / notes["runbook"]
            assert runbook.parent == ROOT / "runbooks" and runbook.is_file(), (name, runbook)
    assert len(alerts) == len(set(alerts)), alerts


def test_expressions_name_declared_metrics_and_labels(
    declared: dict[str, str], declared_labels: dict[str, frozenset[str]]
) -> None:
    """Every metric an expression names is one safeserve/server/metrics.py declares (no server
    needed), and every label it names is one of that metric's."""
    bad = {
        r["alert"]: p for r in load_rules() if (p := problems(r["expr"], declared, declared_labels))
    }
    assert not bad, bad


@pytest.mark.slow  # starts a server (once for tests/deploy)
def test_expressions_name_metrics_a_live_server_exports(live_families: dict[str, str]) -> None:
    """... and one that a running server's /metrics declares (`# TYPE` lines)."""
    bad = {r["alert"]: p for r in load_rules() if (p := problems(r["expr"], live_families))}
    assert not bad, bad


def test_promtool_check_rules() -> None:
    if shutil.which("promtool") is None:
        pytest.skip(NO_PROMTOOL)
    r = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in r.stdout, r.stdout


# -- promtool rule unit tests ------------------------------------------------------------------
A = {"job": "safeserve", "instance": "a"}
B = {"job": "safeserve", "instance": "b"}


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


@dataclass
class Case:
    """`series` (promtool's expanding notation, one sample a minute) make `alert` fire at `at`
    with exactly the label sets `fires` (the rule's severity added), and each alert in `also`
    with its label sets; every other alert on any of the same metrics must not fire."""

    alert: str
    at: str
    series: list[dict[str, str]]
    fires: list[dict[str, str]] = field(default_factory=list)
    also: dict[str, list[dict[str, str]]] = field(default_factory=dict)


def _state(group: str, current: str, minutes: int) -> list[dict]:
    """safeserve:group_state of a group on A, as the supervisor sets it: 1 for `current`."""
    assert current in {s.value for s in SupervisorState}
    return [
        series(
            "safeserve:group_state",
            f"{int(s.value == current)}x{minutes}",
            **A,
            group=group,
            state=s.value,
        )
        for s in SupervisorState
    ]


VERDICT_ALERTS = {
    "dead": "SafeserveRankDead",
    "stalled": "SafeserveRankStalled",
    "crashed": "SafeserveRankCrashed",
    "slow": "SafeserveRankSlow",
    "corrupt": "SafeserveGroupCorrupt",
}


def _verdict(kind: str) -> Case:
    """A first verdict (its series born at 1) on group 0 of A, another one on group 1 of A
    whose series existed; an old verdict on B fires nothing; a verdict of another kind on group
    2 fires that kind's alert."""
    m = "safeserve:watchdog_verdicts_total"
    other = "slow" if kind == "dead" else "dead"
    return Case(
        VERDICT_ALERTS[kind],
        "32m",
        [
            series(m, "_x30 1x5", **A, group="0", verdict=kind),
            series(m, "1x30 2x5", **A, group="1", verdict=kind),
            series(m, "3x35", **B, group="0", verdict=kind),
            series(m, "_x30 1x5", **A, group="2", verdict=other),
        ],
        [{**A, "group": "0", "verdict": kind}, {**A, "group": "1", "verdict": kind}],
        {VERDICT_ALERTS[other]: [{**A, "group": "2", "verdict": other}]},
    )


CASES = [
    Case(
        "SafeserveNoGroupReady",
        "5m",
        [
            series("safeserve:group_ready", "0x10", **A, group="0"),
            series("safeserve:group_ready", "0x10", **A, group="1"),
            series("safeserve:group_ready", "0x10", **B, group="0"),
            series("safeserve:group_ready", "1x10", **B, group="1"),
        ],
        [A],
    ),
    Case(
        "SafeserveGroupNotReady",
        "15m",
        [
            series("safeserve:group_ready", "0x20", **A, group="0"),  # STARTING: fires
            *_state("0", "STARTING", 20),
            series("safeserve:group_ready", "0x20", **A, group="1"),  # drained by an operator
            *_state("1", "DRAINED", 20),
            series("safeserve:group_ready", "0x20", **A, group="2"),  # crash loop: its own alert
            *_state("2", "FAILED", 20),
            series("safeserve:group_ready", "1x20", **A, group="3"),
            *_state("3", "READY", 20),
        ],
        [{**A, "group": "0"}],
        {"SafeserveGroupCrashLoop": [{**A, "group": "2", "state": "FAILED"}]},
    ),
    Case(
        "SafeserveGroupCrashLoop",
        "5m",
        [*_state("0", "FAILED", 10), *_state("1", "RESTARTING", 10)],
        [{**A, "group": "0", "state": "FAILED"}],
    ),
    Case(
        "SafeserveGroupFailingRepeatedly",
        "20m",
        [
            series("safeserve:group_failures_total", "_x5 1x5 2x5 3x10", **A, group="0"),
            series("safeserve:group_failures_total", "_x5 1x20", **A, group="1"),  # once
        ],
        [{**A, "group": "0"}],
    ),
    Case(
        "SafeserveGroupDrainedLong",
        "130m",
        [*_state("0", "DRAINED", 140), *_state("1", "READY", 140)],
        [{**A, "group": "0", "state": "DRAINED"}],
    ),
    Case(
        "SafeserveRequestsLost",
        "25m",
        [
            series("safeserve:requests_lost_total", "0x20 1x10", **A),  # rose from 0
            series("safeserve:requests_lost_total", "_x20 1x10", **B),  # a restart, born at 1
        ],
        [A, B],
    ),
    Case(
        "SafeserveRequestsFailedAfterRetries",
        "25m",
        [
            series("safeserve:requests_failed_after_retries_total", "0x20 2x10", **A),
            series("safeserve:requests_failed_after_retries_total", "2x30", **B),  # long ago
        ],
        [A],
    ),
    Case(
        "SafeserveHighServerErrorRate",
        "15m",
        [
            series(
                "safeserve:requests_total", "0+60x20", **A, endpoint="/v1/completions", status="200"
            ),
            series(
                "safeserve:requests_total", "0+10x20", **A, endpoint="/v1/completions", status="503"
            ),
            # B: only /ready answers 503 (no group READY yet), which is not an API error
            series(
                "safeserve:requests_total", "0+60x20", **B, endpoint="/v1/completions", status="200"
            ),
            series("safeserve:requests_total", "0+600x20", **B, endpoint="/ready", status="503"),
        ],
        [A],
    ),
    Case(
        "SafeserveRequestQuarantined",
        "25m",
        [
            series("safeserve:requests_quarantined_total", "0x20 1x10", **A),
            series("safeserve:requests_quarantined_total", "1x30", **B),  # long ago
        ],
        [A],
    ),
    *(_verdict(kind) for kind in VERDICT_ALERTS),
    Case(
        "SafeserveNodeLost",
        "10m",
        [
            # node b lost for the last five minutes; node c lost for one sample and back
            series("safeserve:node_state", "1x5 0x10", **A, node="b", state="READY"),
            series("safeserve:node_state", "0x5 1x10", **A, node="b", state="LOST"),
            series("safeserve:node_state", "1x7 0 1x7", **A, node="c", state="READY"),
            series("safeserve:node_state", "0x7 1 0x7", **A, node="c", state="LOST"),
            series("safeserve:node_state", "1x15", **A, node="a", state="READY"),
            series("safeserve:node_state", "0x15", **A, node="a", state="LOST"),
        ],
        [{**A, "node": "b"}],
    ),
    Case(
        "SafeserveHeartbeatLate",
        "5m",
        [
            series("safeserve:rank_heartbeat_age_seconds", "0.1x10", **A, group="0", rank="0"),
            series("safeserve:rank_heartbeat_age_seconds", "5x10", **A, group="0", rank="1"),
            series("safeserve:group_ready", "1x10", **A, group="0"),
            # a restarting group's old ranks stop beating: not this alert's business
            series("safeserve:rank_heartbeat_age_seconds", "50+60x10", **A, group="1", rank="0"),
            series("safeserve:group_ready", "0x10", **A, group="1"),
        ],
        [{**A, "group": "0", "rank": "1"}],
    ),
    Case(
        "SafeserveKVCacheFull",
        "15m",
        [
            series("safeserve:kv_blocks_used", "95x20", **A, group="0"),
            series("safeserve:kv_blocks_total", "100x20", **A, group="0"),
            series("safeserve:num_requests_waiting", "3x20", **A, group="0"),
            # full but nobody waits
            series("safeserve:kv_blocks_used", "99x20", **A, group="1"),
            series("safeserve:kv_blocks_total", "100x20", **A, group="1"),
            series("safeserve:num_requests_waiting", "0x20", **A, group="1"),
            # an engine that has not reported yet: 0 of 0
            series("safeserve:kv_blocks_used", "0x20", **A, group="2"),
            series("safeserve:kv_blocks_total", "0x20", **A, group="2"),
            series("safeserve:num_requests_waiting", "5x20", **A, group="2"),
        ],
        [{**A, "group": "0"}],
    ),
    Case(
        "SafeservePreemptionsLasting",
        "25m",
        [
            series("safeserve:num_preemptions", "0+5x30", **A, group="0"),
            series("safeserve:num_preemptions", "0x10 50x20", **A, group="1"),  # one burst
        ],
        [{**A, "group": "0"}],
    ),
    Case(
        "SafeserveDispatchCutsRising",
        "45m",
        [
            *(
                series("safeserve:dispatch_rounds_total", "0+1000x50", **A, group="0", rank=r)
                for r in "01"
            ),
            series("safeserve:dispatch_cut_total", "0+200x50", **A, group="0", rank="0"),
            series("safeserve:dispatch_cut_total", "0x50", **A, group="0", rank="1"),
            # a few cuts: the cost of safety
            series("safeserve:dispatch_rounds_total", "0+1000x50", **A, group="1", rank="0"),
            series("safeserve:dispatch_cut_total", "0+10x50", **A, group="1", rank="0"),
        ],
        [{**A, "group": "0"}],
    ),
    Case(
        "SafeserveExpertLoadSkewed",
        "20m",
        [
            series("safeserve:eplb_balancedness", "0.5x30", **A, group="0", window="100"),
            series("safeserve:eplb_balancedness", "0.3x30", **A, group="1", window="10"),
            series("safeserve:eplb_balancedness", "0.9x30", **A, group="1", window="100"),
        ],
        [{**A, "group": "0", "window": "100"}],
    ),
    Case(
        "SafeserveEplbRebalanceOverdue",
        "15m",
        [
            # group 0's check never ran: its passes grow past the interval
            series("safeserve:eplb_passes_since_check", "0+20x20", **A, group="0"),
            series("safeserve:eplb_rebalance_interval_passes", "100x20", **A, group="0"),
            # group 1 checks every 100 passes: the count climbs to the interval and resets
            series(
                "safeserve:eplb_passes_since_check",
                "0 50 100 0 50 100 0 50 100 0 50 100 0 50 100 0 50 100 0 50",
                **A,
                group="1",
            ),
            series("safeserve:eplb_rebalance_interval_passes", "100x20", **A, group="1"),
        ],
        [{**A, "group": "0"}],
    ),
]

# A healthy server for 70 minutes: serving, an old slow verdict and an old failure, no waits.
HEALTHY = [
    *(series("safeserve:group_ready", "1x70", **A, group=g) for g in "01"),
    *_state("0", "READY", 180),
    *_state("1", "READY", 180),
    series("safeserve:requests_total", "0+600x70", **A, endpoint="/v1/completions", status="200"),
    series("safeserve:requests_total", "0+1x70", **A, endpoint="/v1/completions", status="503"),
    series("safeserve:requests_total", "0+4x70", **A, endpoint="/ready", status="200"),
    series("safeserve:requests_lost_total", "0x70", **A),
    series("safeserve:requests_failed_after_retries_total", "1x70", **A),
    series("safeserve:requests_quarantined_total", "0x70", **A),
    series("safeserve:watchdog_verdicts_total", "1x70", **A, group="1", verdict="slow"),
    series("safeserve:group_failures_total", "1x70", **A, group="1"),
    *(
        series("safeserve:rank_heartbeat_age_seconds", "0.2x70", **A, group=g, rank=r)
        for g in "01"
        for r in "01"
    ),
    *(series("safeserve:kv_blocks_used", "40x70", **A, group=g) for g in "01"),
    *(series("safeserve:kv_blocks_total", "100x70", **A, group=g) for g in "01"),
    *(series("safeserve:num_requests_waiting", "0x70", **A, group=g) for g in "01"),
    *(series("safeserve:num_preemptions", "3x70", **A, group=g) for g in "01"),
    *(series("safeserve:dispatch_rounds_total", "0+500x70", **A, group=g, rank="0") for g in "01"),
    *(series("safeserve:dispatch_cut_total", "0+1x70", **A, group=g, rank="0") for g in "01"),
    *(
        series("safeserve:eplb_balancedness", "0.85x70", **A, group=g, window=w)
        for g in "01"
        for w in ("10", "100", "1000")
    ),
    *(series("safeserve:eplb_passes_since_check", "0+10x70", **A, group=g) for g in "01"),
    *(series("safeserve:eplb_rebalance_interval_passes", "1000x70", **A, group=g) for g in "01"),
]


def unit_tests(rules: Path, severity: dict[str, str]) -> dict:
    tests = []
    for case in CASES:
        tests.append(
            {
                "name": case.alert,
                "interval": "1m",
                "input_series": case.series,
                "alert_rule_test": [
                    {
                        "eval_time": case.at,
                        "alertname": name,
                        "exp_alerts": [
                            {"exp_labels": {**labels, "severity": severity[name]}}
                            for labels in (
                                case.fires if name == case.alert else case.also.get(name, [])
                            )
                        ],
                    }
                    for name in severity
                    if name == case.alert or _shares_metrics(name, case)
                ],
            }
        )
    tests.append(
        {
            "name": "healthy",
            "interval": "1m",
            "input_series": HEALTHY,
            "alert_rule_test": [
                {"eval_time": at, "alertname": name, "exp_alerts": []}
                for name in severity
                for at in ("20m", "65m")
            ],
        }
    )
    return {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": tests}


def _shares_metrics(name: str, case: Case) -> bool:
    """Whether alert `name` reads any metric of the case's series (only those could fire)."""
    expr = next(r["expr"] for r in load_rules() if r["alert"] == name)
    return not refs(expr).metrics.isdisjoint(s["series"].split("{", 1)[0] for s in case.series)


def test_every_alert_has_a_unit_test(declared: dict[str, str]) -> None:
    assert [c.alert for c in CASES] == [r["alert"] for r in load_rules()]
    used = {s["series"].split("{", 1)[0] for c in CASES for s in c.series}
    used |= {s["series"].split("{", 1)[0] for s in HEALTHY}
    assert used <= set(declared), used - set(declared)


def test_promtool_unit_tests(tmp_path: Path) -> None:
    """The rules without their annotations (promtool compares them verbatim; `promtool check
    rules` has checked their templates), against CASES and HEALTHY."""
    if shutil.which("promtool") is None:
        pytest.skip(NO_PROMTOOL)
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
    rules = tmp_path / "alerts.yml"
    rules.write_text(yaml.safe_dump(doc, sort_keys=False))
    severity = {r["alert"]: r["labels"]["severity"] for r in load_rules()}
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(yaml.safe_dump(unit_tests(rules, severity), sort_keys=False))
    r = subprocess.run(
        ["promtool", "test", "rules", str(spec)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


# -- the PromQL reference extractor itself ------------------------------------------------------
@pytest.mark.parametrize(
    ("expr", "metrics", "selector", "grouping"),
    [
        (
            'rate(m_total{status=~"5..", endpoint="/v1/x"}[5m])',
            {"m_total"},
            {("m_total", "status"), ("m_total", "endpoint")},
            set(),
        ),
        (
            "histogram_quantile(0.99, sum by (le, group) (rate(ns:h_bucket[$__rate_interval])))",
            {"ns:h_bucket"},
            set(),
            {"le", "group"},
        ),
        (
            "sum(rate(x[1h30m:1m])) by (group) / on (group) group_left (state) y offset 5m",
            {"x", "y"},
            set(),
            {"group", "state"},
        ),
        ('{__name__="foo", a="b"} + bar', {"foo", "bar"}, {(None, "a")}, set()),
        ("(a unless a offset 10m) > bool 0 and b", {"a", "b"}, set(), set()),
        ("max_over_time(a[5m] @ end()) - a @ 1609746000", {"a"}, set(), set()),
        ('a{l="}{ by (sum)", m!~"x\\"y"}', {"a"}, {("a", "l"), ("a", "m")}, set()),
        ("1e3 * 0x1f + Inf - NaN + .5 * -2", set(), set(), set()),
        ("SUM WITHOUT (rank) (a) and ON () b", {"a", "b"}, set(), {"rank"}),
        ('topk(3, count_values("v", a))', {"a"}, set(), set()),
        ("a # not_a_metric {x}\n + d", {"a", "d"}, set(), set()),
        ("rate(a[${__rate_interval}]) * $scale", {"a"}, set(), set()),
    ],
)
def test_refs(expr: str, metrics: set, selector: set, grouping: set) -> None:
    r = refs(expr)
    assert (r.metrics, r.selector_labels, r.grouping_labels) == (metrics, selector, grouping)


@pytest.mark.parametrize(
    "expr",
    ["rat(a[5m])", "a{b}", "rate(a[5m]", "a ; b", "sum(a))", "a[5m{x}]", "a{x=y}"],
)
def test_refs_refuses_what_it_does_not_know(expr: str) -> None:
    with pytest.raises(ValueError):
        refs(expr)


def test_tokens_tell_durations_from_numbers() -> None:
    assert tokens("5m 1h30m 1e3 5 0x1f") == [
        ("duration", "5m"),
        ("duration", "1h30m"),
        ("number", "1e3"),
        ("number", "5"),
        ("number", "0x1f"),
    ]


def test_problems_name_the_culprit(
    declared: dict[str, str], declared_labels: dict[str, frozenset[str]]
) -> None:
    ok = "histogram_quantile(0.9, sum by (le) (rate(safeserve:e2e_request_latency_seconds_bucket[5m])))"
    assert problems(ok, declared, declared_labels) == []
    assert problems("rate(safeserve:requests[5m])", declared) == [
        "safeserve:requests: no such metric"
    ]
    assert problems("safeserve:group_ready_bucket", declared) == [
        "safeserve:group_ready_bucket: no such metric"  # a gauge has no buckets
    ]
    assert problems('safeserve:group_ready{grup="0"}', declared, declared_labels) == [
        "safeserve:group_ready: no label 'grup'"
    ]
    assert problems("sum by (verdict) (safeserve:group_ready)", declared, declared_labels) == [
        "no metric here has label 'verdict'"
    ]
