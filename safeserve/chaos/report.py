"""What a chaos run proved: requests sent / succeeded / failed / lost, detection, recovery and
the other groups' goodput per fault, the guards' numbers, and each goal met or missed.

Definitions (docs/operations.md, Chaos runs):
- *succeeded*: HTTP 200, no error event, a finish reason and every one of `max_tokens` tokens;
  *failed*: the server said no (an error status or error event; the client knows to retry);
  *lost*: anything else (a stream cut without an error, missing tokens): the outcome we forbid.
- *consistent*: a succeeded request's tokens equal the most common output of its prompt
  (greedy), so a continuation on another group lost or repeated nothing.
- *reference_equal* (`[load].reference`): a succeeded request's tokens equal its prompt's answer
  when sent alone after the load, every group READY again (the unfaulted reference). Exact on
  CPU (float32) and with `--enable-deterministic-inference`; on GPUs without it, results depend
  on the batch a request shares and the share is reported, not required.
- *baseline*: from `warmup_s` to the first fault; each group's tokens/s there (server counter
  `generation_tokens_total{group}`) and the p99 TPOT of requests that started on it.
- per signal fault on group g: *detect* = first watchdog verdict on g after the signal;
  *ready* = g READY again; *recovered* = first time g's tokens/s over the last
  `RECOVERY_WINDOW_S` is back at `recover_throughput` × its baseline. The fault's *window* runs
  from the signal to that recovery (or the next fault, or the end); the *survivors* are the
  other groups: their tokens/s in the window ÷ baseline, and the p99 TPOT of their own requests
  (started on them) that ran in the window against their baseline p99.
- *meets the SLO*: succeeded, its TTFT (sent to first token) within `[slo].ttft_s` and its TPOT
  within `[slo].tpot_s`. *SLO goodput*: of the requests sent in a span, those that met it (a
  count, a share, and per second of the span), overall and per group (the group that answered:
  `X-Safeserve-Group`). In the baseline per group; per fault, each survivor's own requests sent
  in the window, and its goodput per second against its baseline's (`slo_goodput_ratio`): under
  an open-loop load a survivor gets the whole rate, so this is what it carried.
- per node fault (`node_kill`, `node_stop`, `partition`): *node_lost* = the frontend found the
  node LOST (its `lost_at` in `/admin/nodes`, polled while it is LOST); *group_left_ready* = the
  first state other than READY of a group that had ranks on the node; *detect* = the earlier.
  The survivors are the groups with no rank on the node, over the window to the next fault.
  Per `heal`: *node_ready* = the node READY again in `/admin/nodes`; *ready* = every group
  READY (a group READY when the heal came counts at 0).
- *share*: after a signal fault, from the faulted group's READY event on, the share of the
  requests sent in each `share_window_s` window (sliding by `SHARE_STEP_S`) that it answered;
  *rebalanced* = READY to the end of the first window within `share_tolerance` of 1/groups.

`build_report` puts a run's numbers together; `render` formats a report as text, `as_json` and
`dump` as JSON.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from safeserve.chaos.faults import FaultRecord
from safeserve.chaos.load import RequestRecord
from safeserve.chaos.observer import Observer, metric_total
from safeserve.chaos.scenario import (
    EXPECTED_VERDICT,
    FENCING_FAULTS,
    NODE_ACTIONS,
    NODE_DETECT_GOALS,
    NODE_FAULTS,
    Scenario,
)
from safeserve.guards.watchdog import VERDICT_KINDS
from safeserve.messages import ROUTER_PICK_REASONS

RECOVERY_WINDOW_S = 3.0
SHARE_STEP_S = 0.5
SHARE_MIN_REQUESTS = 5  # a window with fewer answered requests says nothing about a share


def percentile(xs: list[float], q: float) -> float | None:
    """The nearest-rank q-quantile (0 < q <= 1); None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def p99(xs: list[float]) -> float | None:
    return percentile(xs, 0.99)


def outcome(r: RequestRecord, max_tokens: int) -> str:
    if r.error:
        return "failed"
    if r.status == 200 and r.finish_reason and not r.broken and len(r.token_ids) == max_tokens:
        return "succeeded"
    return "lost"


def request_summary(
    records: list[RequestRecord], max_tokens: int, reference: dict[int, list[int]] | None = None
) -> dict[str, Any]:
    kinds = Counter(outcome(r, max_tokens) for r in records)
    ok = [r for r in records if outcome(r, max_tokens) == "succeeded"]
    usual: dict[int, tuple[int, ...]] = {}
    for p in {r.prompt for r in ok}:
        usual[p] = Counter(tuple(r.token_ids) for r in ok if r.prompt == p).most_common(1)[0][0]
    consistent = sum(1 for r in ok if tuple(r.token_ids) == usual[r.prompt])
    examples = [
        f"#{r.index}: {r.error or r.broken or f'{len(r.token_ids)} tokens'}"
        for r in records
        if outcome(r, max_tokens) != "succeeded"
    ][:5]
    equal = None
    if reference is not None:
        # a prompt without a lone answer counts against the share: nothing to compare with
        same = sum(1 for r in ok if reference.get(r.prompt) == r.token_ids)
        equal = same / len(ok) if ok else None
    return {
        "sent": len(records),
        "succeeded": kinds["succeeded"],
        "failed": kinds["failed"],
        "lost": kinds["lost"],
        "consistent": (consistent / len(ok)) if ok else None,
        "reference_equal": equal,
        "reference_prompts": None if reference is None else len(reference),
        "tokens": sum(len(r.token_ids) for r in records),
        "not_succeeded_examples": examples,
    }


def meets_slo(r: RequestRecord, sc: Scenario) -> bool:
    if outcome(r, sc.load.max_tokens) != "succeeded":
        return False
    ttft, tpot = r.ttft(), r.tpot()
    if sc.slo.ttft_s is not None and (ttft is None or ttft > sc.slo.ttft_s):
        return False
    return sc.slo.tpot_s is None or tpot is None or tpot <= sc.slo.tpot_s


def slo_goodput(records: list[RequestRecord], sc: Scenario, seconds: float) -> dict[str, Any]:
    """Of `records` (sent over `seconds`): how many, how many met the SLO, the share, per s."""
    met = sum(1 for r in records if meets_slo(r, sc))
    return {
        "requests": len(records),
        "met": met,
        "share": met / len(records) if records else None,
        "per_s": met / seconds if seconds > 0 else None,
    }


def _sent(records: list[RequestRecord], a: float, b: float, group: int | None = None) -> list:
    return [r for r in records if a <= r.start < b and (group is None or r.group == group)]


def slo_summary(sc: Scenario, records: list[RequestRecord]) -> dict[str, Any]:
    """SLO goodput over the whole load, overall and per answering group."""
    span = sc.load.duration_s
    groups = sorted({r.group for r in records if r.group is not None and r.group >= 0})
    return {
        "ttft_s": sc.slo.ttft_s,
        "tpot_s": sc.slo.tpot_s,
        "overall": slo_goodput(records, sc, span),
        "groups": {
            str(g): slo_goodput([r for r in records if r.group == g], sc, span) for g in groups
        },
    }


def share_after_ready(
    records: list[RequestRecord], group: int, ready_t: float, until: float, groups: int, gl: Any
) -> dict[str, Any]:
    """The faulted group's share of the requests sent in each window after it was READY again
    (`ready_t`, seconds since the load started) and when it first came within the tolerance."""
    even = 1 / max(1, groups)
    windows, rebalanced, share_then = [], None, None
    end = ready_t + gl.share_window_s
    while end <= until + 1e-9:
        sent = [
            r
            for r in _sent(records, end - gl.share_window_s, end)
            if r.group is not None and r.group >= 0
        ]
        share = sum(1 for r in sent if r.group == group) / len(sent) if sent else None
        windows.append([round(end, 2), None if share is None else round(share, 3), len(sent)])
        ok = share is not None and len(sent) >= SHARE_MIN_REQUESTS
        if rebalanced is None and ok and abs(share - even) <= gl.share_tolerance:  # type: ignore[operator]
            rebalanced, share_then = end - ready_t, share
        end += SHARE_STEP_S
    return {
        "ready_at_s": round(ready_t, 3),
        "even": even,
        "rebalanced_s": None if rebalanced is None else round(rebalanced, 3),
        "share": share_then,
        "windows": windows,
    }


def _first_event(group: dict, state: str, after: float) -> float | None:
    times = [e["at"] for e in group.get("events", []) if e["state"] == state and e["at"] >= after]
    return min(times) if times else None


def _tpots(records: list[RequestRecord], group: int, a: float, b: float, mt: int) -> list[float]:
    """TPOT of the succeeded requests that started on `group` and produced tokens in [a, b]."""
    out = []
    for r in records:
        if r.group != group or outcome(r, mt) != "succeeded" or not r.times:
            continue
        if r.times[0] <= b and r.times[-1] >= a and (t := r.tpot()) is not None:
            out.append(t)
    return out


def _round3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def node_detection(obs: Observer, groups: list[dict], fr: FaultRecord) -> dict[str, Any]:
    """When the frontend noticed a node fault: the node LOST, or one of its groups out of READY
    (seconds after the fault was sent; None: not within the run)."""
    lost = [
        n.get("lost_at") or s.wall
        for s in obs.samples
        for n in s.nodes
        if n["id"] == fr.fault.node and n["state"] == "LOST"
    ]
    lost = [t for t in lost if t >= fr.wall]
    left = [
        e["at"]
        for g in groups
        if g["id"] in (fr.groups or [])
        for e in g.get("events", [])
        if e["state"] != "READY" and e["at"] >= fr.wall
    ]
    node_lost = min(lost) - fr.wall if lost else None
    group_left = min(left) - fr.wall if left else None
    seen = [x for x in (node_lost, group_left) if x is not None]
    return {
        "node_lost_s": _round3(node_lost),
        "group_left_ready_s": _round3(group_left),
        "detect_s": _round3(min(seen)) if seen else None,
    }


def all_ready_after(groups: list[dict], wall: float) -> float | None:
    """Seconds from `wall` until every group was READY (a group READY at `wall` counts at 0;
    None: one was not READY again within the run)."""
    worst = 0.0
    for g in groups:
        events = sorted(g.get("events", []), key=lambda e: e["at"])
        before = [e for e in events if e["at"] <= wall]
        if before and before[-1]["state"] == "READY":
            continue
        ready = _first_event(g, "READY", wall)
        if ready is None:
            return None
        worst = max(worst, ready - wall)
    return worst


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def analyse_faults(
    sc: Scenario, obs: Observer, records: list[RequestRecord], faults: list[FaultRecord]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    mt, end = sc.load.max_tokens, sc.load.duration_s
    final = obs.samples[-1].groups if obs.samples else []
    ids = sorted(g["id"] for g in final)
    first_fault = faults[0].at if faults else end
    a = sc.load.warmup_s
    base = {
        g: {
            "tokens_per_s": obs.rate(g, a, first_fault),
            "p99_tpot_s": p99(_tpots(records, g, a, first_fault, mt)),
            "slo": slo_goodput(_sent(records, a, first_fault, g), sc, first_fault - a),
        }
        for g in ids
    }
    out = []
    for i, fr in enumerate(faults):
        f = fr.fault
        rec: dict[str, Any] = {
            "action": f.action,
            "group": None if f.action in NODE_ACTIONS else f.group,
            "rank": f.rank,
            "scheduled_s": f.at_s,
            "at_s": round(fr.at, 3),
            "pid": fr.pid,
            "verified": fr.verified,
            "detail": fr.detail,
        }
        nxt = faults[i + 1].at if i + 1 < len(faults) else end
        faulted = {f.group}
        if f.action in NODE_ACTIONS:
            rec.update(node=f.node, groups=fr.groups)
            faulted = set(fr.groups or [])
        if f.action in NODE_FAULTS:
            rec.update(node_detection(obs, final, fr))
        elif f.action == "heal":
            rec["node_ready_s"] = _round3(fr.effect_s)
            rec["ready_s"] = _round3(all_ready_after(final, fr.wall))
        g = next((x for x in final if x["id"] == f.group), None)
        want = EXPECTED_VERDICT.get(f.action)
        if want and g is not None:
            vs = [v for v in g.get("verdicts", []) if v["at"] >= fr.wall and v["kind"] == want]
            rec["verdict"] = want if vs else None
            rec["detect_s"] = round(min(v["at"] for v in vs) - fr.wall, 3) if vs else None
        recovered = None
        if f.action in FENCING_FAULTS and g is not None:
            failed = _first_event(g, "FAILED", fr.wall)
            ready = _first_event(g, "READY", failed) if failed is not None else None
            rec["failed_s"] = None if failed is None else round(failed - fr.wall, 3)
            rec["ready_s"] = None if ready is None else round(ready - fr.wall, 3)
            target = (base[f.group]["tokens_per_s"] or 0) * sc.goals.recover_throughput
            if ready is not None and target > 0:
                t = fr.at + (ready - fr.wall)
                for s in obs.samples:
                    if s.t < t or s.t > nxt:
                        continue
                    r = obs.rate(f.group, s.t - RECOVERY_WINDOW_S, s.t)
                    if r is not None and r >= target:
                        recovered = s.t
                        break
            rec["recovered_s"] = None if recovered is None else round(recovered - fr.at, 3)
            if ready is not None:
                ready_t = fr.at + (ready - fr.wall)
                rec["share"] = share_after_ready(records, f.group, ready_t, nxt, len(ids), sc.goals)
        w_end = min(nxt, recovered if recovered is not None else nxt)
        rec["window_s"] = [round(fr.at, 3), round(w_end, 3)]
        surv = {}
        for h in ids:
            if h in faulted or f.action == "heal":
                continue
            tps = obs.rate(h, fr.at, w_end)
            tp99 = p99(_tpots(records, h, fr.at, w_end, mt))
            slo = slo_goodput(_sent(records, fr.at, w_end, h), sc, w_end - fr.at)
            surv[str(h)] = {
                "tokens_per_s": tps,
                "goodput_ratio": _ratio(tps, base[h]["tokens_per_s"]),
                "p99_tpot_s": tp99,
                "p99_tpot_ratio": _ratio(tp99, base[h]["p99_tpot_s"]),
                "slo": slo,
                "slo_goodput_ratio": _ratio(slo["per_s"], base[h]["slo"]["per_s"]),
            }
        rec["survivors"] = surv
        out.append(rec)
    return {str(g): v for g, v in base.items()}, out


def dispatch_summary(
    groups: list[dict[str, Any]], at_start: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Per rank: admission counters and memory at the end (and its peak when the run began)."""
    start = {
        (g["id"], r["rank"]): (r.get("memory_bytes"), r.get("memory_peak_bytes"))
        for g in at_start or []
        for r in g.get("ranks", [])
    }
    rows = []
    for g in groups:
        for r in g.get("ranks", []):
            d = r.get("dispatch") or {}
            key = (g["id"], r["rank"])
            rows.append(
                {
                    "group": g["id"],
                    "rank": r["rank"],
                    "budget": d.get("dispatch_budget_tokens"),
                    "recv_peak": d.get("dispatch_recv_tokens_peak"),
                    "rounds": d.get("dispatch_rounds_total"),
                    "cut": d.get("dispatch_cut_total"),
                    "buffer_bytes": d.get("dispatch_buffer_bytes"),
                    "buffer_peak_bytes": d.get("dispatch_buffer_peak_bytes"),
                    "memory_bytes": r.get("memory_bytes"),
                    "memory_peak_bytes": r.get("memory_peak_bytes"),
                    "memory_bytes_at_start": start.get(key, (None, None))[0],
                    "memory_peak_bytes_at_start": start.get(key, (None, None))[1],
                    "memory_startup_peak_bytes": r.get("memory_startup_peak_bytes"),
                }
            )
    return rows


def balance_summary(samples: list) -> dict[str, dict[str, float]]:
    """Per group: the lowest, the highest and the last expert-load balancedness (10-pass window)
    that the observer saw (groups with one expert-parallel rank report none)."""
    seen: dict[str, list[float]] = {}
    for s in samples:
        for g in s.groups:
            value = (g.get("eplb_balancedness") or {}).get("10")
            if value is not None:
                seen.setdefault(str(g["id"]), []).append(value)
    return {g: {"min": min(v), "max": max(v), "end": v[-1]} for g, v in seen.items()}


def server_counters(before: dict, after: dict, groups_before: list, groups_after: list) -> dict:
    def delta(name: str, **labels: str) -> float:
        return metric_total(after, name, **labels) - metric_total(before, name, **labels)

    fails = {g["id"]: g["failures"] for g in groups_before}
    rests = {g["id"]: g["restarts"] for g in groups_before}
    return {
        "migrations": delta("request_migrations_total"),
        # the router's choices by reason: new, moved (waiting, to a group back READY), migrated
        "router_picks": {r: delta("router_picks_total", reason=r) for r in ROUTER_PICK_REASONS},
        "retries": delta("request_retries_total"),
        "failed_after_retries": delta("requests_failed_after_retries_total"),
        "lost": delta("requests_lost_total"),
        "verdicts": {v: delta("watchdog_verdicts_total", verdict=v) for v in VERDICT_KINDS},
        "quarantined": delta("requests_quarantined_total"),
        "quarantine_refusals": delta("quarantine_refusals_total"),
        "group_failures": {
            str(g["id"]): g["failures"] - fails.get(g["id"], 0) for g in groups_after
        },
        "group_restarts": {
            str(g["id"]): g["restarts"] - rests.get(g["id"], 0) for g in groups_after
        },
    }


def build_report(
    sc: Scenario,
    obs: Observer,
    records: list[RequestRecord],
    faults: list[FaultRecord],
    *,
    elapsed_s: float,
    before: dict,
    after: dict,
    groups_before: list[dict[str, Any]],
    groups_after: list[dict[str, Any]],
    reference: dict[int, list[int]] | None = None,
) -> dict[str, Any]:
    """The report of a run: its requests, the baseline, each fault, the server's counters
    (`before` and `after` are /metrics scrapes, the groups are /admin/groups views, each taken
    before the load and after it), the dispatch and balance numbers, the per-second timeline,
    and each goal met or missed (`ok`: every one met)."""
    baseline, fault_rows = analyse_faults(sc, obs, records, faults)
    report: dict[str, Any] = {
        "scenario": sc.name,
        "description": sc.description,
        "load": asdict(sc.load),
        "elapsed_s": round(elapsed_s, 3),
        "requests": request_summary(records, sc.load.max_tokens, reference),
        "slo": slo_summary(sc, records),
        "baseline": baseline,
        "faults": fault_rows,
        "server": server_counters(before, after, groups_before, groups_after),
        "dispatch": dispatch_summary(groups_after, groups_before),
        "balance": balance_summary(obs.samples),
        "observer_poll_errors": obs.errors,
        "timeline": timeline(obs),
    }
    report["goals"] = evaluate(sc, report)
    report["ok"] = all(g["ok"] for g in report["goals"])
    return report


def timeline(obs: Observer, step: float = 1.0) -> list[dict[str, Any]]:
    """Per second: each group's tokens/s and state (for plots and for reading a run back)."""
    if not obs.samples:
        return []
    rows, t = [], step
    while t <= obs.samples[-1].t:
        s = min(obs.samples, key=lambda x: abs(x.t - t))
        rows.append(
            {
                "t": round(t, 1),
                "tokens_per_s": {
                    str(g["id"]): _round(obs.rate(g["id"], t - step, t)) for g in s.groups
                },
                "state": {str(g["id"]): g["state"] for g in s.groups},
            }
        )
        t += step
    return rows


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _goal(name: str, target: Any, value: Any, ok: bool) -> dict[str, Any]:
    return {"goal": name, "target": target, "value": value, "ok": bool(ok)}


def evaluate(sc: Scenario, report: dict[str, Any]) -> list[dict[str, Any]]:
    gl, req, faults = sc.goals, report["requests"], report["faults"]
    out = []
    if gl.lost_max is not None:
        out.append(_goal("lost", f"<= {gl.lost_max}", req["lost"], req["lost"] <= gl.lost_max))
    if gl.failed_max is not None:
        out.append(
            _goal("failed", f"<= {gl.failed_max}", req["failed"], req["failed"] <= gl.failed_max)
        )
    if gl.consistent_min is not None:
        v = req["consistent"]
        out.append(
            _goal(
                "consistent", f">= {gl.consistent_min}", v, v is not None and v >= gl.consistent_min
            )
        )
    if gl.reference_equal_min is not None:
        v = req["reference_equal"]
        out.append(
            _goal(
                "reference_equal",
                f">= {gl.reference_equal_min}",
                v,
                v is not None and v >= gl.reference_equal_min,
            )
        )
    if gl.slo_goodput_min is not None:
        v = report["slo"]["overall"]["share"]
        out.append(
            _goal(
                "SLO goodput",
                f">= {gl.slo_goodput_min}",
                v,
                v is not None and v >= gl.slo_goodput_min,
            )
        )
    for action, limit, name in (
        ("sigkill", gl.detect_kill_max_s, "detect_kill_s"),
        ("sigstop", gl.detect_stall_max_s, "detect_stall_s"),
        ("corrupt", gl.detect_corrupt_max_s, "detect_corrupt_s"),
    ):
        if limit is None:
            continue
        for f in (f for f in faults if f["action"] == action):
            v = f.get("detect_s")
            out.append(
                _goal(name, f"<= {limit}", v, f["verified"] and v is not None and v <= limit)
            )
    for action, key in NODE_DETECT_GOALS.items():
        limit = getattr(gl, key)
        for f in (f for f in faults if f["action"] == action and limit is not None):
            v = f.get("detect_s")
            out.append(
                _goal(
                    f"detect_{action}_s node {f['node']}@{f['scheduled_s']:g}s",
                    f"<= {limit}",
                    v,
                    f["verified"] and v is not None and v <= limit,
                )
            )
    for f in (f for f in faults if f["action"] == "heal" and gl.heal_ready_max_s is not None):
        v = f.get("ready_s")
        out.append(
            _goal(
                f"every group READY after heal node {f['node']}@{f['scheduled_s']:g}s",
                f"<= {gl.heal_ready_max_s}",
                v,
                f["verified"] and v is not None and v <= gl.heal_ready_max_s,
            )
        )
    for f in faults:
        if f["action"] not in FENCING_FAULTS and f["action"] not in NODE_FAULTS:
            continue
        tag = f"{f['action']}@{f['scheduled_s']:g}s"
        fencing = f["action"] in FENCING_FAULTS  # a node fault's groups wait for its heal
        if fencing and gl.recover_max_s is not None:
            v = f.get("recovered_s")
            out.append(
                _goal(
                    f"recovered_s {tag}",
                    f"<= {gl.recover_max_s}",
                    v,
                    v is not None and v <= gl.recover_max_s,
                )
            )
        if fencing and gl.rebalance_max_s is not None:
            v = (f.get("share") or {}).get("rebalanced_s")
            out.append(
                _goal(
                    f"group {f['group']} even share {tag}",
                    f"<= {gl.rebalance_max_s} s after READY",
                    v,
                    v is not None and v <= gl.rebalance_max_s,
                )
            )
        for h, s in f["survivors"].items():
            if gl.survivor_slo_goodput_min is not None:
                v = s["slo"]["share"]
                out.append(
                    _goal(
                        f"group {h} SLO goodput {tag}",
                        f">= {gl.survivor_slo_goodput_min}",
                        v,
                        v is not None and v >= gl.survivor_slo_goodput_min,
                    )
                )
            if gl.survivor_goodput_min is not None:
                v = s["goodput_ratio"]
                out.append(
                    _goal(
                        f"group {h} goodput {tag}",
                        f">= {gl.survivor_goodput_min}",
                        v,
                        v is not None and v >= gl.survivor_goodput_min,
                    )
                )
            if gl.survivor_p99_tpot_max_increase is not None:
                v = s["p99_tpot_ratio"]
                lim = 1 + gl.survivor_p99_tpot_max_increase
                out.append(
                    _goal(
                        f"group {h} p99 TPOT ratio {tag}",
                        f"<= {lim:g}",
                        v,
                        v is not None and v <= lim,
                    )
                )
    for f in faults:
        if not f["verified"]:
            out.append(
                _goal(
                    f"fault took effect {f['action']}@{f['scheduled_s']:g}s",
                    True,
                    f["detail"],
                    False,
                )
            )
    if gl.group_failures_max is not None:
        v = sum(report["server"]["group_failures"].values())
        out.append(
            _goal("group failures", f"<= {gl.group_failures_max}", v, v <= gl.group_failures_max)
        )
    if gl.dispatch_within_budget:
        rows = [r for r in report["dispatch"] if r["budget"] is not None]
        over = [
            f"g{r['group']}r{r['rank']}"
            for r in rows
            if r["recv_peak"] > r["budget"]
            or (r["buffer_peak_bytes"] or 0) > (r["buffer_bytes"] or 0)
        ]
        value = (
            "no admission stats (is --dispatch-budget-tokens set?)"
            if not rows
            else (over or "all within")
        )
        out.append(_goal("dispatch within budget", True, value, bool(rows) and not over))
    if gl.rank_memory_spread_max_gib is not None:
        v = memory_spread_gib(report["dispatch"])
        lim = gl.rank_memory_spread_max_gib
        out.append(
            _goal("rank memory growth spread GiB", f"<= {lim}", v, v is not None and v <= lim)
        )
    return out


def memory_growth(r: dict[str, Any]) -> int | None:
    """How far a rank's peak while serving rose above the memory it held when the run began
    (weights, KV cache and admission buffers are allocated before; the rest is transient)."""
    a, b = r.get("memory_bytes_at_start"), r.get("memory_peak_bytes")
    return None if a is None or b is None else b - a


def memory_spread_gib(rows: list[dict[str, Any]]) -> float | None:
    """Per group, (most − least) transient growth of a rank's memory; the worst group."""
    worst = None
    for g in {r["group"] for r in rows}:
        growth = [x for r in rows if r["group"] == g and (x := memory_growth(r)) is not None]
        if len(growth) >= 2:
            spread = (max(growth) - min(growth)) / 2**30
            worst = spread if worst is None else max(worst, spread)
    return None if worst is None else round(worst, 3)


def render(report: dict[str, Any]) -> str:
    req = report["requests"]
    lines = [
        f"scenario {report['scenario']}: {'PASS' if report['ok'] else 'FAIL'} "
        f"({report['elapsed_s']:.0f} s)",
        f"requests: sent {req['sent']}, succeeded {req['succeeded']}, failed {req['failed']}, "
        f"lost {req['lost']}, consistent {_pct(req['consistent'])}"
        + (
            ""
            if req.get("reference_equal") is None
            else f", equal to the lone reference {_pct(req['reference_equal'])}"
        )
        + "; "
        f"migrations {report['server']['migrations']:.0f}, retries {report['server']['retries']:.0f}"
        + f", moved while waiting {report['server'].get('router_picks', {}).get('moved', 0):.0f}",
        "baseline: "
        + ", ".join(
            f"group {g} {_num(b['tokens_per_s'])} tok/s p99 TPOT {_ms(b['p99_tpot_s'])}"
            + (f" SLO {_slo(b['slo'])}" if "slo" in b else "")
            for g, b in report["baseline"].items()
        ),
    ]
    if req.get("not_succeeded_examples"):
        lines.append("not succeeded: " + "; ".join(req["not_succeeded_examples"]))
    if "slo" in report:
        slo = report["slo"]
        lines.append(
            f"SLO (TTFT <= {_s(slo['ttft_s'])}, TPOT <= {_ms(slo['tpot_s'])}): "
            f"overall {_slo(slo['overall'])}"
            + "".join(f"; group {g} {_slo(v)}" for g, v in slo["groups"].items())
        )
    for f in report["faults"]:
        where = f"group {f['group']}" + (f" rank {f['rank']}" if f["rank"] is not None else "")
        if f.get("node") is not None:
            where = f"node {f['node']} (groups {', '.join(map(str, f['groups'] or [])) or '-'})"
        line = f"fault t={f['at_s']:.1f}s {f['action']} {where}: {'ok' if f['verified'] else 'NO EFFECT'}"
        for key in ("detect_s", "failed_s", "node_ready_s", "ready_s", "recovered_s"):
            if key in f:
                line += f", {key[:-2]} {_s(f[key])}"
        for h, s in f["survivors"].items():
            line += (
                f"; group {h} goodput {_pct(s['goodput_ratio'])} "
                f"p99 TPOT {_ms(s['p99_tpot_s'])} (x{_num(s['p99_tpot_ratio'], 2)})"
            )
            if "slo" in s:
                line += f" SLO {_slo(s['slo'])} (x{_num(s['slo_goodput_ratio'], 2)} baseline)"
        if f.get("share"):
            sh = f["share"]
            when = "not within the run" if sh["rebalanced_s"] is None else _s(sh["rebalanced_s"])
            line += (
                f"; group {f['group']} back to an even share of new requests "
                f"({_pct(sh['share'])}) {when} after READY"
            )
        lines.append(line)
    for r in report["dispatch"]:
        if r["budget"] is not None or r["memory_peak_bytes"] is not None:
            lines.append(
                f"group {r['group']} rank {r['rank']}: recv peak {r['recv_peak']} / budget "
                f"{r['budget']}, cut {r['cut']}, memory {_gib(r['memory_bytes_at_start'])} at "
                f"start, peak while serving {_gib(r['memory_peak_bytes'])} ({_growth(r)}; start-up peak {_gib(r['memory_startup_peak_bytes'])})"
            )
    if report.get("balance"):
        lines.append(
            "expert balance (10-pass window, 1 = even): "
            + "; ".join(
                f"group {g} min {b['min']:.2f} max {b['max']:.2f} end {b['end']:.2f}"
                for g, b in sorted(report["balance"].items())
            )
        )
    lines.append("goals:")
    for g in report["goals"]:
        lines.append(
            f"  {'ok  ' if g['ok'] else 'MISS'} {g['goal']}: {g['value']} (target {g['target']})"
        )
    return "\n".join(lines)


def _slo(g: dict[str, Any]) -> str:
    return f"{g['met']}/{g['requests']} met ({_pct(g['share'])}, {_num(g['per_s'], 2)}/s)"


def _num(x: float | None, nd: int = 0) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f} ms"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _growth(r: dict[str, Any]) -> str:
    g = memory_growth(r)
    return "-" if g is None else f"+{g / 2**30:.2f} GiB above its memory at the start"


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f} GiB"


def as_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=1, default=str)


def dump(report: dict[str, Any], path: Path) -> None:
    path.write_text(as_json(report))
