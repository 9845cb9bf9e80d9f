"""Every HTTP answer counted once in `safeserve:requests_total{endpoint, status}`: a pure ASGI
middleware outside every other one, so a 413 of the body limit, a 415, a 500 of a bug and a
404 of a path nobody serves are counted as a 200 is.

`endpoint` is the route's path template (`/v1/models/{model_id}`, not what the client sent) or
`unmatched` for a path the app does not serve, so clients cannot make new series. A stream's
status is the one it ended with (an error event's, or 499 when the client went away), which
the stream leaves with `set_final_status`; a bug that escapes before a response began is
answered here, as a 500 in the OpenAI error shape, not as plain text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import Counter
from starlette.routing import BaseRoute, Match

from safeserve.server.errors import APIError

logger = logging.getLogger(__name__)

UNMATCHED = "unmatched"
_FINAL_STATUS = "safeserve.final_status"  # key in the ASGI scope's state


def set_final_status(scope: dict, status: int) -> None:
    """The status a streamed answer ended with (its response began as a 200)."""
    scope.setdefault("state", {})[_FINAL_STATUS] = status


class RequestCounter:
    def __init__(self, app: Any, counter: Counter, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.counter = counter
        self.routes = routes  # the app's own list: routes added later are seen

    def endpoint(self, scope: dict) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:  # PARTIAL: the path, another method (405)
                return str(getattr(route, "path_format", None) or getattr(route, "path", UNMATCHED))
        return UNMATCHED

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = self.endpoint(scope)
        scope.setdefault("state", {})
        status: int | None = None

        async def counted_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        except Exception:
            if status is not None:  # the answer began: nothing to do but cut it
                status = 500
                raise
            logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            status = 500
            error = APIError(500, "internal server error", "internal_error")
            await error.response()(scope, receive, send)
        finally:
            final = scope["state"].get(_FINAL_STATUS, status)
            self.counter.labels(endpoint, str(final if final is not None else 500)).inc()
