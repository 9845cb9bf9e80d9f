"""The HTTP frontend: OpenAI-compatible routes, health, readiness and metrics.

Route handlers stay thin: the front door's checks in `edge.py` (media type, JSON depth, text),
validation in `protocol.py`, limits and sampling parameters in `intake.py`, generation in
`generate.py`, streamed and collected responses in `responses.py`, the request-body limit in
`body_limit.py`, the count of every answer in `request_count.py`, the schema in `openapi.py`,
the group's processes behind `GroupClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from safeserve.config import ServerArgs
from safeserve.model.checkpoint import load_model_config
from safeserve.model.tokenizer import Tokenizer, load_tokenizer
from safeserve.moe.eplb.balancedness import WINDOWS as BALANCE_WINDOWS
from safeserve.moe.eplb.balancedness import group_balancedness
from safeserve.server import intake as I
from safeserve.server import protocol as P
from safeserve.server import schemas as S
from safeserve.server.body_limit import BodySizeLimit
from safeserve.server.edge import check_content_type
from safeserve.server.errors import APIError, install_route_errors, require_bearer
from safeserve.server.generate import Generator
from safeserve.server.group_client import GroupClient
from safeserve.server.metrics import Metrics
from safeserve.server.openapi import error_responses, install_openapi, json_body, streamed
from safeserve.server.request_count import RequestCounter
from safeserve.server.responses import collect_response, stream_response
from safeserve.server.router import GroupRouter
from safeserve.server.supervisor import Supervisor, SupervisorState

logger = logging.getLogger(__name__)


class ServerState:
    @property
    def groups(self) -> list[GroupClient]:
        """The current incarnation of every group."""
        return [s.client for s in self.supervisors if s.client is not None]

    def __init__(self, args: ServerArgs, on_fatal: Callable[[str], None]) -> None:
        self.args = args
        self.model_config = load_model_config(args.model)
        self.tokenizer: Tokenizer = load_tokenizer(
            args.model, self.model_config.eos_token_ids, args.load_format == "dummy"
        )
        self.metrics = Metrics()
        self.on_fatal = on_fatal
        self.supervisors: list[Supervisor] = []
        self.router: GroupRouter | None = None
        self.admin_server: Any = None
        self.generator: Generator | None = None
        self.started = time.time()


def build_app(args: ServerArgs, on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """`on_fatal(reason)` is called when the server cannot serve at all (the CLI exits non-zero)."""
    state = ServerState(args, on_fatal or (lambda reason: None))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router = GroupRouter([])
        state.router = router
        state.supervisors = [
            Supervisor(args, g, state.metrics, on_change=router.notify)
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

    app = FastAPI(
        title="safeserve",
        version=_version(),
        description="OpenAI-compatible API of a fault-tolerant MoE inference server",
        lifespan=lifespan,
        openapi_url=None,  # served by install_openapi, with the request bodies' schemas
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(BodySizeLimit, max_bytes=args.max_request_body_bytes)
    # Outermost: counts every answer once, the body limit's 413 and a bug's 500 included.
    app.add_middleware(RequestCounter, counter=state.metrics.requests, routes=app.router.routes)
    app.state.safeserve = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    install_route_errors(app)
    install_openapi(
        app,
        [P.CompletionRequest, P.ChatCompletionRequest],
        [S.CompletionChunk, S.ChatCompletionChunk],
        args.model_name,
    )

    @app.get("/health", include_in_schema=False)
    async def health() -> Response:
        # Liveness: the frontend can make progress unless every group is FAILED for good.
        if state.supervisors and all(s.crash_loop for s in state.supervisors):
            reasons = "; ".join(f"group {s.group}: {s.last_reason}" for s in state.supervisors)
            return JSONResponse({"status": "unhealthy", "reason": reasons}, status_code=503)
        return JSONResponse({"status": "ok", "groups": _group_states(state)})

    @app.get("/ready", include_in_schema=False)
    async def ready() -> Response:
        n = sum(1 for s in state.supervisors if s.ready)
        body = {
            "status": "ready" if n else "not ready",
            "groups_ready": n,
            "groups": _group_states(state),
        }
        return JSONResponse(body, status_code=200 if n else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        _refresh_gauges(state)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses={200: {"model": S.ModelList}, **error_responses(401)})
    async def models(request: Request) -> Response:
        _check_auth(state, request)
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get(
        "/v1/models/{model_id:path}",
        responses={200: {"model": S.Model}, **error_responses(401, 404)},
    )
    async def model(request: Request, model_id: str) -> Response:
        _check_auth(state, request)
        _check_model(state, model_id)
        return JSONResponse(_model_card(state))

    @app.post(
        "/v1/completions",
        openapi_extra=json_body(P.CompletionRequest),
        responses={
            **streamed(S.Completion, S.CompletionChunk),
            **error_responses(400, 401, 404, 413, 415, 422, 500, 503),
        },
    )
    async def completions(request: Request) -> Response:
        req: P.CompletionRequest = P.parse(P.CompletionRequest, await _json_body(state, request))
        _check_model(state, req.model)
        prompt_ids = I.completion_prompt_ids(state, req.prompt)
        shape = I.completion_shape(state, req, prompt_ids)
        gen = I.start(state, "cmpl-", prompt_ids, req, req.max_tokens, shape, False)
        answer = stream_response if req.stream else collect_response
        return await answer(request, state, gen, shape)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=json_body(P.ChatCompletionRequest),
        responses={
            **streamed(S.ChatCompletion, S.ChatCompletionChunk),
            **error_responses(400, 401, 404, 413, 415, 422, 500, 503),
        },
    )
    async def chat_completions(request: Request) -> Response:
        body = await _json_body(state, request)
        req: P.ChatCompletionRequest = P.parse(P.ChatCompletionRequest, body)
        _check_model(state, req.model)
        prompt_ids = I.chat_prompt_ids(state, req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        shape = I.chat_shape(req)
        gen = I.start(state, "chatcmpl-", prompt_ids, req, max_tokens, shape, True)
        answer = stream_response if req.stream else collect_response
        return await answer(request, state, gen, shape)

    return app


# -- helpers ------------------------------------------------------------------------------------
async def _start_admin(state: ServerState) -> asyncio.Task | None:
    """The admin API on its own port and address (loopback unless --admin-host says otherwise)."""
    import uvicorn

    from safeserve.server.admin import build_admin_app

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


def _group_states(state: ServerState) -> dict[str, str]:
    return {str(s.group): s.state.value for s in state.supervisors}


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


def _check_auth(state: ServerState, request: Request) -> None:
    require_bearer(request.headers.get("authorization", ""), state.args.api_key)


async def _json_body(state: ServerState, request: Request) -> Any:
    """The key first (401), then the media type (415), then the body (400)."""
    _check_auth(state, request)
    check_content_type(request.headers.get("content-type"))
    return P.decode_json(await request.body())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("safeserve")
    except PackageNotFoundError:
        return "0"


def _check_model(state: ServerState, name: str) -> None:
    if name != state.args.model_name:
        raise P.not_found_model(name, state.args.model_name)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.args.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "safeserve",
        "max_model_len": I.max_model_len(state),
    }


def _refresh_gauges(state: ServerState) -> None:
    m = state.metrics
    now = time.time()
    for sup in state.supervisors:
        g = sup.client
        label = str(sup.group)
        m.group_ready.labels(label).set(1 if sup.ready else 0)
        if g is None:
            continue
        m.running.labels(label).set(g.stats.num_running)
        m.waiting.labels(label).set(g.stats.num_waiting)
        m.kv_used.labels(label).set(g.stats.kv_blocks_used)
        m.kv_total.labels(label).set(g.stats.kv_blocks_total)
        m.preemptions.labels(label).set(g.stats.num_preemptions)
        for r in g.ranks.values():
            rank = str(r.rank)
            m.heartbeat_age.labels(label, rank).set(max(0.0, now - r.received_at))
            m.rank_utilization.labels(label, rank).set(r.utilization)
            if "memory_bytes" in r.stats:
                m.rank_memory.labels(label, rank).set(r.stats["memory_bytes"])
            for gauge, key in (
                (m.dispatch_budget, "dispatch_budget_tokens"),
                (m.dispatch_recv_peak, "dispatch_recv_tokens_peak"),
                (m.dispatch_rounds, "dispatch_rounds_total"),
                (m.dispatch_cut, "dispatch_cut_total"),
                (m.dispatch_buffer_bytes, "dispatch_buffer_bytes"),
                (m.dispatch_buffer_peak_bytes, "dispatch_buffer_peak_bytes"),
            ):
                if key in r.stats:
                    gauge.labels(label, rank).set(r.stats[key])
        ranks = [st.stats for _, st in sorted(g.ranks.items())]
        balance = group_balancedness(ranks)
        for window in BALANCE_WINDOWS:
            if window in balance:
                m.eplb_balancedness.labels(label, str(window)).set(balance[window])
            else:  # none yet (a restarted group before its first pass): no stale series
                with contextlib.suppress(KeyError):
                    m.eplb_balancedness.remove(label, str(window))
    m.in_flight.set(len(state.generator.active) if state.generator else 0)
