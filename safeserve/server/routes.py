"""The HTTP handlers of the public port: `/health`, `/ready`, `/health/generate`, `/metrics`,
`/v1/models[/{id}]`,
`/v1/completions` and `/v1/chat/completions`.

Each handler stays thin: the key (401), then the front door's media type check in `edge.py`
(415), then the body (400) and its validation in `protocol.py`; limits and sampling parameters
in `intake.py`, generation in `generate.py`, the streamed or collected answer in `responses.py`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from safeserve.server import intake as I
from safeserve.server import protocol as P
from safeserve.server import schemas as S
from safeserve.server.edge import check_content_type
from safeserve.server.errors import bad_request, require_bearer, unavailable
from safeserve.server.gauges import refresh_gauges
from safeserve.server.openapi import error_responses, json_body, streamed
from safeserve.server.responses import collect_response, stream_response
from safeserve.server.state import ServerState
from safeserve.server.supervisor import Supervisor


def install_routes(app: FastAPI, state: ServerState) -> None:
    """Adds the handlers above to `app`; each reads `state`."""

    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)
    async def health() -> Response:
        # Liveness: the frontend can make progress unless every group is FAILED for good.
        if state.supervisors and all(s.crash_loop for s in state.supervisors):
            reasons = "; ".join(f"group {s.group}: {s.last_reason}" for s in state.supervisors)
            return JSONResponse({"status": "unhealthy", "reason": reasons}, status_code=503)
        return JSONResponse({"status": "ok", "groups": _group_states(state)})

    @app.api_route("/ready", methods=["GET", "HEAD"], include_in_schema=False)
    async def ready() -> Response:
        n = sum(1 for s in state.supervisors if s.ready)
        body = {
            "status": "ready" if n else "not ready",
            "groups_ready": n,
            "groups": _group_states(state),
        }
        return JSONResponse(body, status_code=200 if n else 503)

    @app.get("/health/generate", include_in_schema=False)
    async def health_generate(request: Request) -> Response:
        # A real forward pass: the canary (guards/canary.py) on one READY group, `?group=N` or
        # the least loaded. A wrong answer twice in a row fences that group (`corrupt`).
        _check_auth(state, request)
        sup = _canary_group(state, request.query_params.get("group"))
        assert sup.client is not None
        run = await sup.client.run_canary()
        ok = run.result in ("ok", "reference")
        body = {
            "status": "ok" if ok else run.result,
            "group": run.group,
            "tokens": run.tokens,
            "latency_s": round(run.latency_s, 4),
            "reason": run.reason,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        refresh_gauges(state)
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
        # tokenized on a worker thread: a long prompt never stalls the streams of others
        prompt_ids = await asyncio.to_thread(I.completion_prompt_ids, state, req.prompt)
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
        prompt_ids = await asyncio.to_thread(I.chat_prompt_ids, state, req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        shape = I.chat_shape(req)
        gen = I.start(state, "chatcmpl-", prompt_ids, req, max_tokens, shape, True)
        answer = stream_response if req.stream else collect_response
        return await answer(request, state, gen, shape)


def _canary_group(state: ServerState, raw: str | None) -> Supervisor:
    ready = {s.group: s for s in state.supervisors if s.ready}
    if raw is not None:
        if not raw.isdigit() or int(raw) not in ready:
            raise bad_request(f"group must be one of the READY groups {sorted(ready)}", "group")
        return ready[int(raw)]
    if not ready or state.router is None:
        raise unavailable("no group is READY", retry_after=5.0)
    return state.router.pick(reason="canary")


def _group_states(state: ServerState) -> dict[str, str]:
    return {str(s.group): s.state.value for s in state.supervisors}


def _check_auth(state: ServerState, request: Request) -> None:
    require_bearer(request.headers.get("authorization", ""), state.args.api_key)


async def _json_body(state: ServerState, request: Request) -> Any:
    """The key first (401), then the media type (415), then the body (400)."""
    _check_auth(state, request)
    check_content_type(request.headers.get("content-type"))
    return P.decode_json(await request.body())


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
