"""The admin API's expert-placement routes (EPLB), on the admin port behind `--admin-api-key`:

- `GET /admin/eplb`: every group's placement summary and rebalancing (`messages.EplbStatus`):
  slots, replicas, rebalances done and skipped, moved bytes, the last check (when, over how many
  passes, the outcome and why) and the last rebalance (how long, its longest step, balancedness
  before, predicted and measured after); `overdue` when a check was due and did not run.
- `GET /admin/eplb/map[?group=N]`: a group's current physical-to-logical map, as the file
  `--init-expert-location` reads.
- `POST /admin/expert_distribution/start|stop|dump`: recording of the routed tokens per logical
  expert on every READY group. `dump` answers the sum over groups as the distribution file
  `--init-expert-location` reads (save the body), and writes it on the server's host too when
  the body names an absolute `path`.

Each command goes to a group's leader (`GroupClient.eplb_command`) and is answered between two of
its steps.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from safeserve.messages import EplbReply
from safeserve.moe.eplb.distribution import FORMAT as DISTRIBUTION_FORMAT
from safeserve.moe.eplb.distribution import write_expert_distribution
from safeserve.moe.eplb.location import MAP_FORMAT
from safeserve.server.errors import APIError, bad_request, unavailable
from safeserve.server.group_client import GroupClient, GroupUnavailable
from safeserve.server.protocol import decode_json
from safeserve.server.state import ServerState

# How long an admin command waits for a group's leader (it answers between two steps).
COMMAND_TIMEOUT_S = 30.0
DISTRIBUTION_OPS = ("start", "stop", "dump")


def eplb_summary(client: GroupClient | None) -> dict[str, Any] | None:
    """A group's EplbStatus as JSON, with `overdue`: a rebalance check was due (more passes
    than --eplb-rebalance-num-iterations since the last) and did not run. None: the model has
    no routed experts, or the group has not reported yet."""
    st = client.stats.eplb if client is not None else None
    if st is None:
        return None
    overdue = st.enabled and st.passes_since_check > st.interval_passes
    return {**asdict(st), "overdue": overdue}


def eplb_view(state: ServerState) -> list[dict[str, Any]]:
    """GET /admin/eplb's groups: id, state and `eplb_summary`."""
    return [
        {"id": sup.group, "state": sup.state.value, "eplb": eplb_summary(sup.client)}
        for sup in state.supervisors
    ]


def _ready_groups(state: ServerState) -> list[GroupClient]:
    groups = [s.client for s in state.supervisors if s.ready and s.client is not None]
    if not groups:
        raise unavailable("no group is READY to answer", retry_after=5.0)
    return groups


async def _ask(groups: list[GroupClient], op: str) -> list[EplbReply]:
    """`op` on every group at once; 503 when one fails or does not answer, 409 with the
    group's reason when it refuses."""

    async def one(g: GroupClient) -> EplbReply:
        try:
            return await g.eplb_command(op, COMMAND_TIMEOUT_S)
        except TimeoutError as e:
            raise unavailable(
                f"group {g.group} did not answer within {COMMAND_TIMEOUT_S:g} s"
            ) from e
        except GroupUnavailable as e:
            raise unavailable(str(e)) from e

    replies = await asyncio.gather(*(one(g) for g in groups))
    for g, r in zip(groups, replies, strict=True):
        if r.error is not None:
            raise APIError(409, f"group {g.group}: {r.error}", "conflict")
    return replies


def _dump_path(body: Any) -> Path | None:
    if body is None:
        return None
    if not isinstance(body, dict) or set(body) - {"path"}:
        raise bad_request("the body may hold only 'path'", "path")
    path = body.get("path")
    if path is None:
        return None
    if not isinstance(path, str) or not os.path.isabs(path):
        raise bad_request("path must be an absolute path on the server's host", "path")
    return Path(path)


def install_eplb_routes(app: FastAPI, state: ServerState, check_admin: Any) -> None:
    """Adds the routes above to the admin app; `check_admin(request)` raises 401."""

    @app.get("/admin/eplb")
    async def eplb(request: Request) -> Response:
        check_admin(request)
        return JSONResponse({"groups": eplb_view(state)})

    @app.get("/admin/eplb/map")
    async def eplb_map(request: Request) -> Response:
        check_admin(request)
        groups = _ready_groups(state)
        raw = request.query_params.get("group")
        if raw is not None:
            by_id = {g.group: g for g in groups}
            if not raw.isdigit() or int(raw) not in by_id:
                raise bad_request(f"group must be one of the READY groups {sorted(by_id)}", "group")
            groups = [by_id[int(raw)]]
        (reply,) = await _ask(groups[:1], "map")
        assert reply.phy2log is not None
        cfg = state.model_config
        return JSONResponse(
            {
                "format": MAP_FORMAT,
                "num_layers": len(reply.phy2log),
                "num_logical_experts": cfg.num_experts,
                "phy2log": reply.phy2log,
                "group": groups[0].group,
            }
        )

    @app.post("/admin/expert_distribution/{op}")
    async def distribution(op: str, request: Request) -> Response:
        check_admin(request)
        if op not in DISTRIBUTION_OPS:
            raise APIError(404, f"op must be one of {', '.join(DISTRIBUTION_OPS)}", "not_found")
        raw = await request.body()
        path = _dump_path(decode_json(raw) if raw.strip() else None) if op == "dump" else None
        groups = _ready_groups(state)
        replies = await _ask(groups, op)
        ids = [g.group for g in groups]
        if op != "dump":
            return JSONResponse({"ok": True, "recording": op == "start", "groups": ids})
        counts = [r.logical_count for r in replies]
        assert all(c is not None for c in counts)
        total = [
            [sum(col) for col in zip(*rows, strict=True)]
            for rows in zip(*counts, strict=True)  # type: ignore[misc]
        ]
        doc = {
            "format": DISTRIBUTION_FORMAT,
            "num_layers": len(total),
            "num_logical_experts": len(total[0]) if total else 0,
            "logical_count": total,
            "passes": sum(r.passes for r in replies),
            "groups": ids,
            "recording": any(r.recording for r in replies),
        }
        if path is not None:
            try:
                write_expert_distribution(path, torch.tensor(total, dtype=torch.int64))
            except OSError as e:
                raise APIError(
                    409, f"cannot write {path}: {e.strerror or e}", "conflict", "path"
                ) from e
            doc["path"] = str(path)
        return JSONResponse(doc)
