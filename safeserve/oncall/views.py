"""What the on-call CLI prints: one row per resource, name first; `describe` with its events; and
which runbook a group's state points to."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

RUNBOOK_FOR_VERDICT = {
    "crashed": "query-of-death",  # a rank's own exception: most often a request that crashes it
    "dead": "rank-dead",
    "stalled": "rank-stalled",
    "slow": "rank-slow",
    "corrupt": "rank-corrupt",
}
RECENT_S = 3600.0  # verdicts older than this no longer point to a runbook
# At or below this balancedness (last 10 passes) the routing counts as skewed: for EP2 it means
# one rank gets 5x the pairs of the other; for EP4 and more, well above the 1/ep_size floor.
SKEWED_BALANCEDNESS = 0.6
# KV cache this full, with requests waiting, points to the kv-pressure runbook (so do preemptions).
KV_FULL = 0.9


def table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header, *[["-" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )


def _ago(at: float | None, now: float) -> str:
    if at is None:
        return "-"
    s = max(0.0, now - at)
    return (
        f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.0f}h ago"
    )


def _culprit(verdict: dict[str, Any]) -> str:
    """`rank N`, or `group` for a verdict on the group as a whole (corrupt)."""
    return "group" if verdict.get("rank") is None else f"rank {verdict['rank']}"


def _gib(x: float | None) -> str | None:
    return None if x is None else f"{x / 2**30:.2f}Gi"


def groups_table(groups: list[dict[str, Any]], now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows = []
    for g in groups:
        last = g["verdicts"][-1] if g.get("verdicts") else None
        verdict = f"{last['kind']} {_culprit(last)} {_ago(last['at'], now)}" if last else None
        rows.append(
            [
                g["id"],
                g["state"],
                len(g["ranks"]),
                g["running"],
                g["waiting"],
                g["in_flight"],
                _kv_used(g),
                g.get("preemptions"),
                g["failures"],
                g["restarts"],
                _balance10(g),
                verdict,
            ]
        )
    header = ["GROUP", "STATE", "RANKS", "RUNNING", "WAITING", "IN-FLIGHT", "KV-USED"]
    return table([*header, "PREEMPTED", "FAILURES", "RESTARTS", "BALANCE", "LAST-VERDICT"], rows)


def _kv_share(g: dict[str, Any]) -> float | None:
    total = g.get("kv_blocks_total")
    return g["kv_blocks_used"] / total if total else None


def _kv_used(g: dict[str, Any]) -> str | None:
    """Share of the group's KV blocks in use (None until its engine has reported)."""
    share = _kv_share(g)
    return None if share is None else f"{100 * share:.0f}%"


def _kv_line(g: dict[str, Any]) -> str:
    total = g.get("kv_blocks_total")
    if not total:
        return "-  (no report from the group's engine yet)"
    size = g.get("kv_block_size") or 0
    return (
        f"{g['kv_blocks_used']} of {total} blocks used ({_kv_used(g)}; {total * size} tokens in "
        f"all), {g.get('preemptions', 0)} requests preempted since the group last started"
    )


def _balance10(g: dict[str, Any]) -> str | None:
    """Expert-load balancedness over the last 10 passes (None: one EP rank, or no pass yet)."""
    value = (g.get("eplb_balancedness") or {}).get("10")
    return None if value is None else f"{value:.2f}"


def ranks_table(groups: list[dict[str, Any]]) -> str:
    rows = []
    for g in groups:
        for r in g["ranks"]:
            d = r.get("dispatch") or {}
            recv = (
                f"{d['dispatch_recv_tokens_peak']}/{d['dispatch_budget_tokens']}"
                if "dispatch_budget_tokens" in d
                else None
            )
            rows.append(
                [
                    f"{g['id']}/{r['rank']}",
                    r["pid"],
                    r["device"],
                    r["step"],
                    r["phase"],
                    f"{r['heartbeat_age_s']:.1f}s",
                    f"{100 * r['utilization']:.0f}%",
                    _gib(r.get("memory_bytes")),
                    recv,
                    d.get("dispatch_cut_total"),
                    _graph_replays(r),
                ]
            )
    header = ["GROUP/RANK", "PID", "DEVICE", "STEP", "PHASE", "HEARTBEAT", "UTIL", "MEMORY"]
    return table([*header, "RECV-PEAK/BUDGET", "CUT", "GRAPHS(DECODE/PIECEWISE)"], rows)


def _graph_replays(rank: dict[str, Any]) -> str | None:
    """Steps the rank replayed as decode / piecewise CUDA graphs; None when it captured none
    (CPU, --disable-cuda-graph, or the capture failed): every step runs eagerly."""
    decode, piecewise = rank.get("cuda_graph_replays"), rank.get("piecewise_graph_replays")
    if decode is None and piecewise is None:
        return None
    return f"{'-' if decode is None else decode}/{'-' if piecewise is None else piecewise}"


def nodes_table(view: dict[str, Any]) -> str:
    """`get nodes`: one row per node agent."""
    if view.get("placement") != "remote":
        return "no node agents: this server places its groups locally (--placement local)"
    rows = []
    for n in view["nodes"]:
        groups = sorted({r["group"] for r in n["ranks"]})
        rows.append(
            [
                n["id"],
                n["state"],
                n["host"],
                ",".join(map(str, n["devices"])),
                len(n["free_devices"]),
                ",".join(map(str, groups)) or None,
                f"{n['beat_age_s']:.1f}s",
                n["agent_pid"],
                n["lost_reason"],
            ]
        )
    header = ["NODE", "STATE", "HOST", "DEVICES", "FREE", "GROUPS", "BEAT", "AGENT-PID", "REASON"]
    return table(header, rows)


def describe_node(view: dict[str, Any], node_id: str, groups: list[dict[str, Any]]) -> str:
    """`describe node NAME`: its devices and ranks, its lease, and the runbook to follow when it
    is lost."""
    n = next(x for x in view["nodes"] if x["id"] == node_id)
    lines = [
        f"Node:        {n['id']} ({n['state']})",
        f"Host:        {n['host']} (agent pid {n['agent_pid']})",
        f"Devices:     {', '.join(map(str, n['devices']))} ({len(n['free_devices'])} free)",
        f"Last beat:   {n['beat_age_s']:.1f}s ago (lease {view['lease_s']:g}s)",
    ]
    if n.get("node_rank") is not None:
        of = f" of {n['nnodes']}" if n.get("nnodes") else ""
        lines.append(f"Set:         {n['node_set'] or '(unnamed)'}, node-rank {n['node_rank']}{of}")
    if n.get("dist_init_addr"):
        lines.append(f"Rendezvous:  {n['dist_init_addr']} (groups whose rank 0 runs here)")
    if n.get("takes_no_group"):
        lines.append(f"No groups:   {n['takes_no_group']}")
    if n["lost_reason"]:
        lines.append(f"Lost:        {n['lost_reason']}")
    lines.append("Ranks:")
    states = {g["id"]: g["state"] for g in groups}
    if not n["ranks"]:
        lines.append("  (none)")
    for r in n["ranks"]:
        state = states.get(r["group"], "?")
        rank = "" if r.get("rank") is None else f" rank {r['rank']}"
        lines.append(
            f"  device {r['device']}: group {r['group']}{rank} ({state}), "
            f"incarnation {r['incarnation']}"
        )
    refused = view.get("refused") or {}
    if refused:
        lines.append(
            "Refused:     "
            + ", ".join(f"{k} {v}" for k, v in sorted(refused.items()))
            + " (frames or handshakes from anyone, not only this node)"
        )
    if n["state"] == "LOST":
        why = n["lost_reason"] or ""
        book = "partition" if "lease" in why else "node-lost"
        lines.append(f"Runbook:     {book} (safeserve oncall runbook {book})")
    return "\n".join(lines)


def runbooks_for(
    g: dict[str, Any], all_groups: list[dict[str, Any]], now: float
) -> list[tuple[str, str]]:
    """(runbook, why) for what this group shows, most pressing first."""
    out: list[tuple[str, str]] = []
    if g.get("crash_loop"):
        out.append(("crash-loop", f"group {g['id']} failed repeatedly and stays FAILED"))
    seen = set()
    for v in reversed(g.get("verdicts", [])):
        name = RUNBOOK_FOR_VERDICT.get(v["kind"])
        if v["kind"] == "dead" and "node " in v.get("reason", "") and " lost" in v["reason"]:
            name = "node-lost"  # the rank's node agent was lost (killed, frozen, cut off)
        if name and name not in seen and now - v["at"] <= RECENT_S:
            seen.add(name)
            out.append(
                (name, f"watchdog verdict {v['kind']} on {_culprit(v)} {_ago(v['at'], now)}")
            )
    cut = sum((r.get("dispatch") or {}).get("dispatch_cut_total", 0) or 0 for r in g["ranks"])
    skew = []
    if cut:
        skew.append(f"{cut} dispatches cut into admission rounds")
    balance = (g.get("eplb_balancedness") or {}).get("10")
    if balance is not None and balance <= SKEWED_BALANCEDNESS:
        skew.append(f"expert load balancedness {_balance10(g)} over the last 10 passes")
        eplb = g.get("eplb") or {}
        if eplb.get("enabled") and eplb.get("rebalances"):
            skew.append("it stays low after EPLB's rebalances")
    if (g.get("eplb") or {}).get("overdue"):
        skew.append("an EPLB rebalance check was due and did not run")
    if skew:
        out.append(("dispatch-skew", "; ".join(skew) + ": routing is skewed"))
    kv = []
    if g.get("preemptions"):
        kv.append(f"{g['preemptions']} requests preempted since the group last started")
    share = _kv_share(g)
    if share is not None and share >= KV_FULL and g["waiting"]:
        kv.append(f"KV cache {_kv_used(g)} used with {g['waiting']} requests waiting")
    if kv:
        out.append(("kv-pressure", "; ".join(kv)))
    if g.get("quarantined"):
        fps = ", ".join(q["fingerprint"] for q in g["quarantined"])
        why = f"quarantined requests crashed this group and another: {fps}"
        prior = [i for i, (name, _) in enumerate(out) if name == "query-of-death"]
        if prior:  # one line per runbook: the verdict's reason and this one
            out[prior[0]] = ("query-of-death", f"{why}; {out[prior[0]][1]}")
        else:
            out.append(("query-of-death", why))
    if not any(x["state"] == "READY" for x in all_groups):
        out.append(("no-ready-group", "no group is READY: new requests get 503"))
    return out


def _balance(windows: dict[str, float]) -> str:
    if not windows:
        return "-  (one expert-parallel rank, or no MoE pass yet)"
    parts = ", ".join(f"{windows[w]:.2f} last {w}" for w in sorted(windows, key=int))
    return f"{parts} passes  (1.00 = even; 1/ep_size = all on one rank)"


def _eplb_line(e: dict[str, Any] | None, now: float) -> str:
    """The group's rebalancing: off, or its counts, the last rebalance and the last check."""
    if e is None or not e.get("enabled"):
        return "off" if e is not None else "-  (no routed experts, or no report yet)"
    parts = [
        f"{e['rebalances']} rebalances, {e['skipped']} skipped, every "
        f"{e['interval_passes']} passes ({e['passes_since_check']} since the last check"
        + ("; OVERDUE" if e.get("overdue") else "")
        + f"); {e['num_physical']} slots for {e['num_logical']} experts"
    ]
    done = e.get("last_rebalance")
    if done is not None:
        after = done.get("balancedness_after")
        parts.append(
            f"last rebalance {_ago(done['at'], now)}: {done['layers_moved']} layers, "
            f"{done['moved_bytes'] / 2**20:.1f} MiB in {done['duration_s'] or 0:.2f} s (longest "
            f"step {1e3 * (done['longest_pause_s'] or 0):.0f} ms); balancedness "
            f"{done['balancedness_before']:.2f} before, "
            + (f"{after:.2f} since" if after is not None else "not measured since")
        )
    last = e.get("last")
    if last is not None and last is not done and last != done:
        parts.append(f"last check {_ago(last['at'], now)}: {last['outcome']}: {last['reason']}")
    return "\n              ".join(parts)


def describe_group(
    g: dict[str, Any], all_groups: list[dict[str, Any]], now: float | None = None
) -> str:
    now = time.time() if now is None else now
    lines = [
        f"Group:        {g['id']}",
        f"State:        {g['state']}" + ("  (crash loop)" if g.get("crash_loop") else ""),
        f"Requests:     {g['running']} running, {g['waiting']} waiting, {g['in_flight']} in flight",
        f"KV cache:     {_kv_line(g)}",
        f"Failures:     {g['failures']} ({g['restarts']} restarts)",
        f"Last failure: {g.get('last_failure') or '-'}",
        f"Balance:      {_balance(g.get('eplb_balancedness') or {})}",
        f"EPLB:         {_eplb_line(g.get('eplb'), now)}",
        "Ranks:",
        *("  " + line for line in ranks_table([g]).splitlines()),
        "Verdicts:",
    ]
    lines += [
        f"  {_ago(v['at'], now):>9}  {v['kind']:<8} {_culprit(v)}: {v['reason']}"
        for v in g.get("verdicts", [])
    ] or ["  <none>"]
    lines.append("Suspects:")  # a request that was on a failed group, running here now
    lines += [
        f"  {s['rid']}  fingerprint {s['fingerprint']}, was on group {s['failed_group']} when it "
        f"failed, {_ago(s['since'], now)}"
        + ("; on probation (no token here yet)" if s.get("probation") else "")
        for s in g.get("suspects", [])
    ] or ["  <none>"]
    lines.append("Quarantined:")
    lines += [
        f"  {q['fingerprint']}  {q['rid']} crashed groups {q['groups'][0]} and {q['groups'][1]} "
        f"{_ago(q['at'], now)}; refused {q['refused']} times, {q['expires_in_s']:.0f} s left"
        for q in g.get("quarantined", [])
    ] or ["  <none>"]
    lines.append("Events:")
    lines += [f"  {_ago(e['at'], now):>9}  {e['state']}" for e in g.get("events", [])] or [
        "  <none>"
    ]
    books = runbooks_for(g, all_groups, now)
    lines.append("Runbooks:")
    lines += [f"  {name:<15} {why}  (safeserve oncall runbook {name})" for name, why in books] or [
        "  <none: nothing points to a known failure>"
    ]
    return "\n".join(lines)


def suspects_table(q: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows = [
        [
            s["rid"],
            s["fingerprint"],
            s["failed_group"],
            s["group"],
            "yes" if s.get("probation") else "no",
            _ago(s["since"], now),
        ]
        for s in q["suspects"]
    ]
    return table(["RID", "FINGERPRINT", "FAILED-GROUP", "NOW-ON", "PROBATION", "SINCE"], rows)


def quarantine_table(q: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows = [
        [
            x["fingerprint"],
            x["rid"],
            ",".join(map(str, x["groups"])),
            _ago(x["at"], now),
            f"{x['expires_in_s']:.0f}s",
            x["refused"],
        ]
        for x in q["quarantined"]
    ]
    return table(["FINGERPRINT", "RID", "GROUPS", "QUARANTINED", "EXPIRES-IN", "REFUSED"], rows)


def lift_lines(r: dict[str, Any]) -> str:
    fps = ", ".join(q["fingerprint"] for q in r["lifted"]) or "none"
    if r["dry_run"]:
        return f"would lift {len(r['lifted'])} quarantine(s): {fps}"
    return f"lifted {len(r['lifted'])} quarantine(s): {fps}; identical requests are admitted again"


def runbook_dirs(explicit: Path | None) -> list[Path]:
    import os

    cands = [explicit] if explicit else []
    if env := os.environ.get("SAFESERVE_RUNBOOKS"):
        cands.append(Path(env))
    cands += [Path("runbooks"), Path(__file__).resolve().parents[2] / "runbooks"]
    return [c for c in cands if c is not None]


def find_runbooks(explicit: Path | None) -> Path | None:
    for d in runbook_dirs(explicit):
        if d.is_dir() and any(d.glob("*.md")):
            return d
    return None


def runbook_title(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem
