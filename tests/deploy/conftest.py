"""What the deploy tests check the alert rules and the dashboard against: the metric families
safeserve declares (its `Metrics` registry, in process) and those a live server exports on
/metrics (one `safeserve serve --model tiny`, started once for both test modules)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from serving import start_server, stop_server

sys.path.insert(0, str(Path(__file__).parent))

from promql import TARGET_LABELS, families  # noqa: E402


@pytest.fixture(scope="session")
def declared() -> dict[str, str]:
    """{family: type} of every metric in safeserve/server/metrics.py, as the server renders it."""
    from safeserve.server.metrics import Metrics

    return families(Metrics().render().decode())


@pytest.fixture(scope="session")
def declared_labels() -> dict[str, frozenset[str]]:
    """{family: label names} of every metric, from the registry's collectors (a labelled metric
    with no child yet renders no sample, so /metrics cannot say)."""
    from prometheus_client.metrics import MetricWrapperBase

    from safeserve.server.metrics import Metrics

    out = {}
    for m in vars(Metrics()).values():
        if isinstance(m, MetricWrapperBase):
            # prometheus_client keeps no public accessor for these; a rename fails here loudly.
            name = m._name + ("_total" if m._type == "counter" else "")
            out[name] = frozenset(m._labelnames) | TARGET_LABELS
    return out


@pytest.fixture(scope="session")
def live_exposition(tmp_path_factory: pytest.TempPathFactory) -> str:
    """/metrics of a real server that served one completion (counters, histograms and the per
    group and per rank gauges then have samples). The server is stopped once it is read."""
    log = tmp_path_factory.mktemp("deploy") / "server.log"
    s = start_server(["--model", "tiny"], log)
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        m = httpx.get(s.url + "/metrics", timeout=10)
        assert m.status_code == 200 and "# TYPE " in m.text, (m.status_code, s.output()[-4000:])
    finally:
        stop_server(s.proc)
    return m.text


@pytest.fixture(scope="session")
def live_families(live_exposition: str) -> dict[str, str]:
    return families(live_exposition)
