"""What the server starts when the app starts, and what it verifies at launch and after.

`lifespan(state)` builds the router, one supervisor per group (which spawns the group's ranks)
and the generator; it starts the admin API on its own port and a watcher, and stops them all
when the app stops. A launch that cannot serve calls `state.on_fatal(reason)` (the CLI exits
non-zero): the admin API cannot bind its address, no group ever started, or, with
`--exit-on-no-groups`, every group is in a crash loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import uvicorn
from fastapi import FastAPI

from safeserve.server.admin import build_admin_app
from safeserve.server.generate import Generator
from safeserve.server.nodes import NodeHub
from safeserve.server.router import GroupRouter
from safeserve.server.state import ServerState
from safeserve.server.supervisor import Supervisor, SupervisorState

logger = logging.getLogger(__name__)


def lifespan(state: ServerState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the groups, the admin API and the watcher run while the app does."""
    args = state.args

    @contextlib.asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        router = GroupRouter([], state.metrics)
        state.router = router
        if args.placement == "remote":
            state.hub = NodeHub(args, on_change=router.notify)
            state.hub.start()
            logger.info(
                "waiting for node agents on %s:%d (%d groups of %d ranks)",
                args.node_host,
                args.node_port,
                args.num_groups,
                args.tp_size,
            )
        state.supervisors = [
            Supervisor(args, g, state.metrics, on_change=router.notify, hub=state.hub)
            for g in range(args.num_groups)
        ]
        router.supervisors = state.supervisors
        state.generator = Generator(args, state.tokenizer, router, state.metrics, args.model_name)
        for sup in state.supervisors:
            sup.start()
        watcher = asyncio.create_task(_watch_groups(state))
        admin = await _start_admin(state)
        try:
            yield
        finally:
            watcher.cancel()
            if admin is not None:
                state.admin_server.should_exit = True
                await admin
            await asyncio.gather(*(sup.stop() for sup in state.supervisors))
            if state.hub is not None:
                await state.hub.stop()

    return run


async def _start_admin(state: ServerState) -> asyncio.Task | None:
    """The admin API on its own port and address (loopback unless --admin-host says otherwise)."""
    args = state.args
    config = uvicorn.Config(
        build_admin_app(state),
        host=args.admin_host,
        port=args.admin_port_effective,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
    server = uvicorn.Server(config)
    state.admin_server = server
    # `_serve` skips installing signal handlers: the main server owns them.
    task = asyncio.create_task(server._serve())
    for _ in range(100):
        if server.started or task.done():
            break
        await asyncio.sleep(0.05)
    if task.done() or not server.started:
        state.on_fatal(f"admin API could not bind {args.admin_host}:{args.admin_port_effective}")
        return None
    logger.info("admin API on http://%s:%d/admin/", args.admin_host, args.admin_port_effective)
    return task


async def _watch_groups(state: ServerState) -> None:
    """Exits the server (non-zero) when it cannot serve at all: no group ever started, or every
    group is in a crash loop and --exit-on-no-groups is set."""
    sups = state.supervisors
    while True:
        await asyncio.sleep(0.5)
        if not sups or not all(s.state is SupervisorState.FAILED and s.crash_loop for s in sups):
            continue
        reasons = "; ".join(f"group {s.group}: {s.last_reason}" for s in sups)
        if not any(s.ever_ready for s in sups):
            state.on_fatal(f"no group could start: {reasons}")
            return
        if state.args.exit_on_no_groups:
            state.on_fatal(f"every group is in a crash loop: {reasons}")
            return
