"""What two-batch and single-batch overlap show an operator, in process (no server): the
`overlap` section of GET /admin/config, and `safeserve:tbo_steps_total` fed from a group's
engine reports across incarnations."""

from __future__ import annotations

import asyncio

import httpx

from safeserve.config import TBO_RULE, ServerArgs
from safeserve.messages import TBO_DECISIONS, EngineStats
from safeserve.server.admin import build_admin_app
from safeserve.server.metrics import Metrics, count_tbo_steps
from safeserve.server.state import ServerState

TBO = dict(tp_size=2, enable_dp_attention=True, enable_two_batch_overlap=True)


def _get(state: ServerState, path: str) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_admin_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://admin") as c:
            return await c.get(path)

    return asyncio.run(run())


def test_admin_config_shows_the_overlap_flags_and_rule() -> None:
    args = ServerArgs(**TBO, tbo_token_distribution_threshold=0.4, tbo_min_decode_batch=32)
    r = _get(ServerState(args, on_fatal=lambda reason: None), "/admin/config")
    assert r.status_code == 200, r.text
    assert r.json()["overlap"] == {
        "enable_two_batch_overlap": True,
        "enable_single_batch_overlap": False,
        "tbo_token_distribution_threshold": 0.4,
        "tbo_min_decode_batch": 32,
        "rule": TBO_RULE,
    }
    off = _get(ServerState(ServerArgs(), on_fatal=lambda reason: None), "/admin/config").json()
    assert off["overlap"]["enable_two_batch_overlap"] is False
    assert off["overlap"]["tbo_min_decode_batch"] == 64


def _samples(metrics: Metrics) -> dict[tuple[str, str], float]:
    return {
        (s.labels["group"], s.labels["decision"]): s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == "safeserve:tbo_steps_total"
    }


def test_tbo_steps_count_each_report_once_across_incarnations() -> None:
    m = Metrics()
    off = EngineStats()
    count_tbo_steps(m, 0, off, off)
    assert _samples(m) == {}  # TBO off: no series
    first = EngineStats(tbo_steps={"split": 3, "cuda_graph": 5})
    count_tbo_steps(m, 0, off, first)
    assert _samples(m) == {("0", d): {"split": 3, "cuda_graph": 5}.get(d, 0) for d in TBO_DECISIONS}
    later = EngineStats(tbo_steps={"split": 4, "cuda_graph": 5, "split_cut": 2})
    count_tbo_steps(m, 0, first, later)
    count_tbo_steps(m, 0, later, later)  # a report with no new step adds nothing
    # the group restarts: the new incarnation counts from zero, its client from an empty report
    count_tbo_steps(m, 0, off, EngineStats(tbo_steps={"split": 1, "too_few_tokens": 1}))
    count_tbo_steps(m, 1, off, EngineStats(tbo_steps={"decode_below_threshold": 7}))
    got = _samples(m)
    assert {d: got[("0", d)] for d in TBO_DECISIONS} == {
        "split": 5,
        "split_cut": 2,
        "decode_below_threshold": 0,
        "too_few_tokens": 1,
        "cuda_graph": 5,
    }
    assert got[("1", "decode_below_threshold")] == 7
    text = m.render().decode()
    assert "# TYPE safeserve:tbo_steps_total counter" in text
    assert 'safeserve:tbo_steps_total{decision="split",group="0"} 5.0' in text
