"""The request-body limit: an ASGI middleware that answers 413 before any handler reads a body
over `--max-request-body-bytes`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from safeserve.server.errors import APIError


class BodySizeLimit:
    """Pure ASGI middleware: a body over the limit gets 413 before any handler reads it."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = APIError(413, f"request body exceeds {self.max_bytes} bytes", "request_too_large")
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                await too_big.response()(scope, receive, send)
                return
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return msg

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await too_big.response()(scope, receive, send)


class _BodyTooLarge(Exception):
    pass
