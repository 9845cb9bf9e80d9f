"""The admin API (`/admin/*`), served on its own port, bound to loopback unless told otherwise.

Behind `--admin-api-key` (Bearer) when one is set. `POST /admin/faults` exists only with
`--enable-fault-injection`. The expert-placement routes (`/admin/eplb`,
`/admin/expert_distribution/*`) are in `eplb_admin.py`. `GET /admin/quarantine` shows the query-of-death state (suspects,
quarantined fingerprints); `DELETE /admin/quarantine[/{fingerprint}]` lifts quarantines
(`?dry_run=1`: says which, lifts none).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from safeserve.config import TBO_RULE
from safeserve.messages import FAULT_KINDS, DispatchStats, GuardSizing, InjectFault
from safeserve.moe.eplb.balancedness import group_balancedness
from safeserve.server.eplb_admin import eplb_summary, install_eplb_routes
from safeserve.server.errors import APIError, bad_request, install_error_handlers, require_bearer
from safeserve.server.nodes import Node, NodeHub, RemoteRank
from safeserve.server.protocol import decode_json
from safeserve.server.state import ServerState

MAX_FAULT_DELAY_S = 60.0

logger = logging.getLogger(__name__)


def _check_admin(state: ServerState, request: Request) -> None:
    require_bearer(
        request.headers.get("authorization", ""), state.args.admin_api_key, "admin API key"
    )


def _quarantine_view(state: ServerState) -> dict[str, Any]:
    gen = state.generator
    if gen is None:
        return {"quarantine_s": state.args.quarantine_s, "suspects": [], "quarantined": []}
    return gen.qod.view()


def group_view(state: ServerState) -> list[dict[str, Any]]:
    out = []
    now = time.time()
    qod = _quarantine_view(state)
    for sup in state.supervisors:
        g = sup.client
        ranks = []
        for r, st in sorted(g.ranks.items()) if g is not None else []:
            s = st.stats
            ranks.append(
                {
                    "rank": r,
                    "pid": st.pid,
                    "device": s.device if s.device is not None else state.args.device,
                    "step": st.step,
                    "phase": st.phase,
                    "phase_age_s": round(max(0.0, now - st.phase_since), 3),
                    "heartbeat_age_s": round(max(0.0, now - st.received_at), 3),
                    "utilization": round(st.utilization, 3),
                    # a remote rank's pid is another host's: no local memory reading
                    "memory_bytes": s.memory_bytes
                    if s.memory_bytes is not None or state.args.placement == "remote"
                    else _rss(st.pid),
                    "node": _node_of(g, r),
                    "memory_peak_bytes": s.memory_peak_bytes,
                    "memory_startup_peak_bytes": s.memory_startup_peak_bytes,
                    "cuda_graph_replays": s.cuda_graph_replays,
                    "piecewise_graph_replays": s.piecewise_graph_replays,
                    "dispatch": _dispatch_view(s.dispatch),
                }
            )
        verdicts = sup.verdicts()[-10:]
        out.append(
            {
                "id": sup.group,
                **sup.describe(),
                "reason": g.fatal if g is not None else None,
                "running": g.stats.num_running if g is not None else 0,
                "waiting": g.stats.num_waiting if g is not None else 0,
                "in_flight": sup.load,
                # the KV cache of the group's current incarnation (0 until it reports)
                "kv_blocks_used": g.stats.kv_blocks_used if g is not None else 0,
                "kv_blocks_total": g.stats.kv_blocks_total if g is not None else 0,
                "kv_block_size": state.args.block_size,
                "preemptions": g.stats.num_preemptions if g is not None else 0,
                "eplb_balancedness": {
                    str(w): round(v, 4)
                    for w, v in group_balancedness(
                        [st.stats for _, st in sorted(g.ranks.items())] if g is not None else []
                    ).items()
                },
                "eplb": eplb_summary(g),
                "ranks": ranks,
                "verdicts": [
                    {
                        "kind": v.kind,
                        "rank": v.rank,
                        "reason": v.reason,
                        "at": v.at,
                        "exit_code": v.exit_code,
                        "signal": v.signal,
                        "error": v.error,
                    }
                    for v in verdicts
                ],
                # requests in flight on a failed group that continue on this one (one at most)
                "suspects": [x for x in qod["suspects"] if x["group"] == sup.group],
                # live quarantines of requests in flight on this group when it failed
                "quarantined": [q for q in qod["quarantined"] if sup.group in q["groups"]],
                "events": [{"at": at, "state": st} for at, st in sup.events],
            }
        )
    return out


def _dispatch_view(d: DispatchStats | None) -> dict[str, int]:
    """A rank's dispatch admission numbers as /admin/groups shows them (`dispatch_*` keys)."""
    return {} if d is None else {f"dispatch_{k}": v for k, v in asdict(d).items()}


def _guards_view(guards: GuardSizing) -> dict[str, Any]:
    """A group's guard sizing as /admin/config shows it."""
    out: dict[str, Any] = {"dispatch_budget_tokens": guards.dispatch_budget_tokens}
    if guards.dispatch is not None:
        d = guards.dispatch
        out.update(
            dispatch_buffer_bytes=d.buffer_bytes,
            bytes_per_recv_row=d.bytes_per_recv_row,
            attention_groups=d.attention_groups,
            top_k=d.top_k,
            local_experts=d.local_experts,
        )
    if guards.prefill is not None:
        out["prefill"] = guards.prefill.to_dict()
    return out


def _overlap_view(state: ServerState) -> dict[str, Any]:
    """Two-batch and single-batch overlap as /admin/config shows them: the flags and the rule
    that decides which steps run split."""
    a = state.args
    return {
        "enable_two_batch_overlap": a.enable_two_batch_overlap,
        "enable_single_batch_overlap": a.enable_single_batch_overlap,
        "tbo_token_distribution_threshold": a.tbo_token_distribution_threshold,
        "tbo_min_decode_batch": a.tbo_min_decode_batch,
        "rule": TBO_RULE,
    }


_YES = ("", "1", "true", "yes", "on")  # a bare `?dry_run` asks for one
_NO = ("0", "false", "no", "off")


def dry_run_asked(request: Request) -> bool:
    """`?dry_run=...`: a value that is neither yes nor no is a 400, never taken for a no (an
    operator who asked for a dry run gets one or nothing)."""
    value = request.query_params.get("dry_run")
    if value is None:
        return False
    said = value.strip().lower()
    if said in _YES:
        return True
    if said in _NO:
        return False
    raise bad_request(
        f"dry_run must be one of 1, true, yes, on (or empty) or 0, false, no, off; got {value!r}",
        "dry_run",
    )


def _lift(state: ServerState, request: Request, fp: str | None) -> Response:
    """Ends quarantines (identical requests are admitted again); a dry run only names them."""
    dry_run = dry_run_asked(request)
    gen = state.generator
    lifted = gen.qod.lift(fp, dry_run) if gen is not None else []
    if fp is not None and not lifted:
        raise APIError(404, f"no quarantine of fingerprint {fp}", "quarantine_not_found")
    if lifted and not dry_run:
        logger.warning(
            "quarantine lifted by the admin API: %s", ", ".join(q.fingerprint for q in lifted)
        )
    now = gen.qod.clock() if gen is not None else 0.0
    return JSONResponse({"ok": True, "dry_run": dry_run, "lifted": [q.view(now) for q in lifted]})


def _node_of(client: Any, rank: int) -> str | None:
    """The node agent running a rank (None: this host)."""
    procs = client.processes
    if rank < len(procs) and isinstance(procs[rank], RemoteRank):
        return procs[rank].node.node_id
    return None


def node_view(state: ServerState) -> dict[str, Any]:
    """The node agents (--placement remote) as GET /admin/nodes shows them."""
    hub = state.hub
    if hub is None:
        return {"placement": state.args.placement, "nodes": [], "refused": {}}
    now = time.monotonic()
    nodes = []
    for n in sorted(hub.nodes.values(), key=lambda n: n.node_id):
        nodes.append(
            {
                "id": n.node_id,
                "state": "LOST" if n.lost is not None else "READY",
                "lost_reason": n.lost,
                "lost_at": n.lost_at,
                "host": n.host,
                "agent_pid": n.pid,
                "devices": n.devices,
                "free_devices": n.free,
                "node_set": n.node_set,
                "node_rank": n.node_rank,
                "nnodes": n.nnodes,
                "dist_init_addr": n.dist_init_addr,
                # why it takes no group under --nnodes (None: it may)
                "takes_no_group": hub.span_refusal(n),
                "ranks": [_rank_on(hub, n, d, g, inc) for d, (g, inc) in sorted(n.used.items())],
                "beat_age_s": round(max(0.0, now - n.last_beat), 3),
                "connected_at": n.connected_at,
            }
        )
    refused = dict(hub.reader.refused) | dict(hub.handshakes)
    return {
        "placement": "remote",
        "lease_s": state.args.node_lease_s,
        "nnodes": state.args.nnodes,
        "nodes": nodes,
        "refused": refused,
    }


def _rank_on(hub: NodeHub, node: Node, device: int, group: int, incarnation: int) -> dict[str, Any]:
    """A rank a node runs: its device, group, incarnation, rank in the group and the group's
    rendezvous."""
    link = hub.links.get((group, incarnation))
    rank = None
    if link is not None:
        rank = next((r.rank for r in link.ranks if r.node is node and r.device == device), None)
    return {
        "device": device,
        "group": group,
        "incarnation": incarnation,
        "rank": rank,
        "rendezvous": None if link is None else link.init_method,
    }


def _rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:
        return None


def build_admin_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="safeserve admin", docs_url=None, redoc_url=None)

    install_error_handlers(app)

    @app.get("/admin/groups")
    async def groups(request: Request) -> Response:
        _check_admin(state, request)
        return JSONResponse({"groups": group_view(state)})

    @app.post("/admin/groups/{group_id}/{action}")
    async def group_action(group_id: int, action: str, request: Request) -> Response:
        _check_admin(state, request)
        sups = {s.group: s for s in state.supervisors}
        if group_id not in sups:
            raise APIError(
                404, f"no group {group_id}; groups are {sorted(sups)}", "group_not_found"
            )
        if action not in ("drain", "undrain", "restart"):
            raise APIError(404, "action must be drain, undrain or restart", "not_found")
        sup = sups[group_id]
        dry_run = dry_run_asked(request)
        if dry_run:
            # Server-side dry run: the same checks as the action, and nothing changes.
            why = sup.refusal(action)
            if why is not None:
                raise APIError(409, why, "conflict")
        else:
            try:
                getattr(sup, action)()
            except ValueError as e:
                raise APIError(409, str(e), "conflict") from e
        others = [s.group for s in state.supervisors if s is not sup and s.ready]
        return JSONResponse(
            {
                "ok": True,
                "group": group_id,
                "action": action,
                "dry_run": dry_run,
                "state": sup.state.value,
                "in_flight": sup.load,
                "other_ready_groups": others,
            }
        )

    @app.get("/admin/quarantine")
    async def quarantine(request: Request) -> Response:
        _check_admin(state, request)
        return JSONResponse(_quarantine_view(state))

    @app.delete("/admin/quarantine")
    async def lift_all(request: Request) -> Response:
        _check_admin(state, request)
        return _lift(state, request, None)

    @app.delete("/admin/quarantine/{fp}")
    async def lift_one(fp: str, request: Request) -> Response:
        _check_admin(state, request)
        return _lift(state, request, fp)

    @app.get("/admin/nodes")
    async def nodes(request: Request) -> Response:
        _check_admin(state, request)
        return JSONResponse(node_view(state))

    @app.get("/admin/config")
    async def config(request: Request) -> Response:
        _check_admin(state, request)
        guards = {
            str(g.group): (_guards_view(g.ready_info.guards) if g.ready_info else None)
            for g in state.groups
        }
        return JSONResponse(
            {"args": state.args.to_dict(), "guards": guards, "overlap": _overlap_view(state)}
        )

    install_eplb_routes(app, state, lambda request: _check_admin(state, request))

    if state.args.enable_fault_injection:

        @app.post("/admin/faults")
        async def faults(request: Request) -> Response:
            _check_admin(state, request)
            body = decode_json(await request.body())
            fault, targets = _parse_fault(state, body)
            for g in targets:
                g.inject_fault(fault)
            return JSONResponse(
                {"ok": True, "fault": fault.__dict__, "groups": [g.group for g in targets]}
            )

    return app


def _parse_fault(state: ServerState, body: Any) -> tuple[InjectFault, list]:
    if not isinstance(body, dict) or body.get("kind") not in FAULT_KINDS:
        raise bad_request(f"kind must be one of {', '.join(FAULT_KINDS)}", "kind")
    kind = body["kind"]
    groups = state.groups
    if kind == "clear":
        return InjectFault("clear"), groups
    if kind == "route_skew":
        expert = body.get("expert")
        experts = state.model_config.num_experts
        if not isinstance(expert, int) or isinstance(expert, bool) or not 0 <= expert < experts:
            raise bad_request(f"expert must be an integer in [0, {experts})", "expert")
        return InjectFault("route_skew", expert=expert), groups
    group, rank, delay = body.get("group", 0), body.get("rank"), body.get("delay_s")
    ids = {g.group: g for g in groups}
    if not isinstance(group, int) or group not in ids:
        raise bad_request(f"group must be one of {sorted(ids)}", "group")
    if not isinstance(rank, int) or not 0 <= rank < state.args.tp_size:
        raise bad_request(f"rank must be an integer in [0, {state.args.tp_size})", "rank")
    if kind == "corrupt":
        return InjectFault("corrupt", rank=rank), [ids[group]]
    if not isinstance(delay, (int, float)) or not 0 <= delay <= MAX_FAULT_DELAY_S:
        raise bad_request(f"delay_s must be a number in [0, {MAX_FAULT_DELAY_S:g}]", "delay_s")
    return InjectFault("slow_rank", rank=rank, delay_s=float(delay)), [ids[group]]
