"""deploy/grafana/safeserve.json: its structure, and every query's metrics and labels: each
metric is one a live server exports (its `# TYPE` families on /metrics) and safeserve declares,
each label one its metrics carry, and every metric safeserve exports has a panel."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from promql import family, label_scope, problems, refs

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "safeserve.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's variable query `label_values(SELECTOR, LABEL)`.
LABEL_VALUES = re.compile(
    r"^label_values\((?P<selector>.+),\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\)$"
)
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(d: dict) -> Iterator[dict]:
    """Every panel, those inside rows (collapsed rows keep theirs) included; rows left out."""
    for p in d["panels"]:
        if p["type"] == "row":
            yield from p.get("panels", [])
        else:
            yield p


def queries(d: dict) -> Iterator[tuple[str, str, str]]:
    """(where, PromQL expression, legend format) of every panel target and variable query."""
    for p in panels(d):
        for t in p["targets"]:
            yield f"panel {p['title']!r} {t['refId']}", t["expr"], t.get("legendFormat", "")
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = LABEL_VALUES.match(v["query"]["query"])
            assert m, v["query"]
            yield f"variable {v['name']!r}", m["selector"], "{{" + m["label"] + "}}"


def test_dashboard_structure() -> None:
    d = load()
    assert 36 <= d["schemaVersion"] <= 41
    assert d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DATASOURCE, v["name"]
            assert v["definition"] == v["query"]["query"], v["name"]
    ids = [p["id"] for p in d["panels"]] + [
        p["id"] for r in d["panels"] for p in r.get("panels", [])
    ]
    assert len(ids) == len(set(ids)), ids
    taken: set[tuple[int, int]] = set()
    for p in d["panels"]:  # no two panels overlap on the 24-column grid
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        cells = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & taken, p["title"]
        taken |= cells
    for p in panels(d):
        assert p["title"] and p.get("description"), p["id"]
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], p["title"]
        refids = [t["refId"] for t in p["targets"]]
        assert len(refids) == len(set(refids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE and t["expr"].strip(), (p["title"], t)


@pytest.mark.slow  # starts a server (once for tests/deploy)
def test_queries_name_metrics_a_live_server_exports(live_families: dict[str, str]) -> None:
    bad = {where: p for where, expr, _ in queries(load()) if (p := problems(expr, live_families))}
    assert not bad, bad


def test_queries_name_declared_metrics_and_labels(
    declared: dict[str, str], declared_labels: dict[str, frozenset[str]]
) -> None:
    """Labels in selectors and by(...) lists are their metrics'; a legend's `{{label}}` is one
    the query's result keeps (its aggregation's by(...) labels, if it aggregates by any)."""
    bad = {}
    for where, expr, legend in queries(load()):
        p = problems(expr, declared, declared_labels)
        r = refs(expr)
        keeps = r.grouping_labels or label_scope(r, declared, declared_labels)
        p += [
            f"legend label {x!r} not in {sorted(keeps)}"
            for x in LEGEND_LABEL.findall(legend)
            if x not in keeps
        ]
        if p:
            bad[where] = p
    assert not bad, bad


def test_every_exported_metric_has_a_panel(declared: dict[str, str]) -> None:
    shown = {family(n, declared) for _, expr, _ in queries(load()) for n in refs(expr).metrics}
    missing = sorted(set(declared) - shown)
    assert not missing, f"metrics with no panel in {DASHBOARD.name}: {missing}"


def test_histograms_are_read_as_quantiles(declared: dict[str, str]) -> None:
    """Each latency histogram has a histogram_quantile panel, summed by `le`."""
    exprs = [expr for _, expr, _ in queries(load())]
    for name, kind in declared.items():
        if kind != "histogram":
            continue
        quantiles = [e for e in exprs if f"{name}_bucket" in e and "histogram_quantile" in e]
        assert quantiles, name
        assert all(refs(e).grouping_labels == {"le"} for e in quantiles), quantiles
