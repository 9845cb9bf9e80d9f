"""`safeserve:requests_total` counts every answer once, in-process (no server): a 200, a 404 of
a path nobody serves (`unmatched`), a 405, a 413 of the body limit, a 415, a bug's 500 (in the
OpenAI error shape, not plain text), and a stream's final status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from safeserve.server.body_limit import BodySizeLimit
from safeserve.server.edge import check_content_type
from safeserve.server.errors import APIError, install_error_handlers
from safeserve.server.metrics import Metrics
from safeserve.server.request_count import RequestCounter, set_final_status


def _app(metrics: Metrics) -> FastAPI:
    app = FastAPI()
    app.add_middleware(BodySizeLimit, max_bytes=100)
    app.add_middleware(RequestCounter, counter=metrics.requests, routes=app.router.routes)

    install_error_handlers(app)

    @app.post("/v1/echo")
    async def echo(request: Request) -> Response:
        check_content_type(request.headers.get("content-type"))
        return JSONResponse({"n": len(await request.body())})

    @app.get("/v1/items/{item_id}")
    async def item(item_id: str) -> Response:
        raise APIError(404, f"no item {item_id}", "not_found")

    @app.get("/v1/bug")
    async def bug() -> Response:
        raise ZeroDivisionError("a bug")

    @app.get("/v1/stream")
    async def stream(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            set_final_status(request.scope, 503)  # as a stream whose group failed ends

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def _counts(metrics: Metrics) -> dict[tuple[str, str], float]:
    out = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "safeserve:requests_total":
                out[(s.labels["endpoint"], s.labels["status"])] = s.value
    return out


def test_every_answer_is_counted_once_under_its_route() -> None:
    metrics = Metrics()

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=_app(metrics), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            json_h = {"Content-Type": "application/json; charset=utf-8"}
            return [
                await c.post("/v1/echo", content=b"{}", headers=json_h),
                await c.post("/v1/echo", content=b"x" * 500, headers=json_h),
                await c.post("/v1/echo", content=b"{}", headers={"Content-Type": "text/plain"}),
                await c.get("/v1/echo"),
                await c.get("/v1/items/abc"),
                await c.get("/v1/items/def"),
                await c.get("/nowhere/1"),
                await c.get("/nowhere/2"),
                await c.get("/v1/bug"),
                await c.get("/v1/stream"),
            ]

    rs = asyncio.run(run())
    assert [r.status_code for r in rs] == [200, 413, 415, 405, 404, 404, 404, 404, 500, 200]
    for r in rs[1:9]:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert rs[2].json()["error"]["code"] == "unsupported_media_type"
    assert rs[8].json()["error"]["code"] == "internal_error"
    assert _counts(metrics) == {
        ("/v1/echo", "200"): 1,
        ("/v1/echo", "413"): 1,
        ("/v1/echo", "415"): 1,
        ("/v1/echo", "405"): 1,
        ("/v1/items/{item_id}", "404"): 2,  # the template, not the ids clients send
        ("unmatched", "404"): 2,
        ("/v1/bug", "500"): 1,
        ("/v1/stream", "503"): 1,
    }
