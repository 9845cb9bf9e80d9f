"""The HTTP frontend, assembled: `build_app(args)` is the OpenAI-compatible app of the public
port, with health, readiness and metrics.

It puts together the server's state (`state.py`), the lifespan that starts the groups and the
admin API and checks that the server can serve (`startup.py`), the request-body limit
(`body_limit.py`), the count of every answer (`request_count.py`), the error answers
(`errors.py`), the schema (`openapi.py`) and the handlers (`routes.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from safeserve.config import ServerArgs
from safeserve.server import protocol as P
from safeserve.server import schemas as S
from safeserve.server.body_limit import BodySizeLimit
from safeserve.server.errors import install_error_handlers
from safeserve.server.openapi import install_openapi
from safeserve.server.request_count import RequestCounter
from safeserve.server.routes import install_routes
from safeserve.server.startup import lifespan
from safeserve.server.state import ServerState


def build_app(args: ServerArgs, on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """`on_fatal(reason)` is called when the server cannot serve at all (the CLI exits non-zero)."""
    state = ServerState(args, on_fatal or (lambda reason: None))
    app = FastAPI(
        title="safeserve",
        version=_version(),
        description="OpenAI-compatible API of a fault-tolerant MoE inference server",
        lifespan=lifespan(state),
        openapi_url=None,  # served by install_openapi, with the request bodies' schemas
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(BodySizeLimit, max_bytes=args.max_request_body_bytes)
    # Outermost: counts every answer once, the body limit's 413 and a bug's 500 included.
    app.add_middleware(RequestCounter, counter=state.metrics.requests, routes=app.router.routes)
    app.state.safeserve = state

    install_error_handlers(app)
    install_openapi(
        app,
        [P.CompletionRequest, P.ChatCompletionRequest],
        [S.CompletionChunk, S.ChatCompletionChunk],
        args.model_name,
    )
    install_routes(app, state)
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("safeserve")
    except PackageNotFoundError:
        return "0"
