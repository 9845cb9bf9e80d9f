"""`/openapi.json` from the protocol's own models: request bodies (protocol.py, declared with
`openapi_extra`, since the handlers read and check bodies themselves: media type, JSON depth,
text) and answers (schemas.py), errors included; and `/docs`, Swagger UI over it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from safeserve.server import schemas as S
from safeserve.server.edge import JSON_MEDIA_TYPE

_REF = "#/components/schemas/{model}"

_ERRORS: dict[int, str] = {
    400: "bad input: malformed or too deeply nested JSON, a wrong type, a value out of range, "
    "text that is not Unicode, a field that cannot be honoured",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "body over --max-request-body-bytes",
    415: "Content-Type is not application/json",
    422: "request_quarantined: an identical request crashed two groups (Retry-After)",
    500: "internal_error: this request alone failed in its group (the group serves on)",
    503: "no group can serve (Retry-After)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": S.ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` declaring `model` as the request body."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {JSON_MEDIA_TYPE: {"schema": schema}}}}


def streamed(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A 200 that is `model` as JSON, or with `stream` a server-sent event stream of `chunk`."""
    return {
        200: {
            "model": model,
            "description": f"a {model.__name__}; with stream, server-sent events, each "
            f"`data: <{chunk.__name__}>`, ending with `data: [DONE]`",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    }


def install_openapi(
    app: FastAPI, request_models: list[type[BaseModel]], extra: list[type[BaseModel]], model: str
) -> None:
    """Serves the schema with the request models (and `extra` answer models, such as stream
    chunks, that no route names) in its components; `model` is the one name requests may use."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        _, defs = models_json_schema(
            [(m, "validation") for m in [*request_models, *extra]], ref_template=_REF
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, sub in defs.get("$defs", {}).items():
            components.setdefault(name, sub)
        for m in request_models:  # this server serves one model: say so
            components[m.__name__]["properties"]["model"]["enum"] = [model]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json() -> Any:
        return app.openapi()

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        # Swagger UI's scripts come from a CDN (FastAPI's default): offline, the page loads
        # but stays blank; /openapi.json itself needs nothing from outside.
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} API")
