"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code or self.status,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = dict(headers or {})
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def require_bearer(authorization: str, key: str | None, what: str = "API key") -> None:
    """401 unless `Authorization: Bearer <key>` matches (no key configured: open)."""
    if not key:
        return
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401, f"missing or invalid {what} (send Authorization: Bearer <key>)", "invalid_api_key"
        )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request", param)


def unavailable(message: str, retry_after: float = 1.0) -> APIError:
    return APIError(503, message, "service_unavailable", retry_after=retry_after)


def install_error_handlers(app: FastAPI) -> None:
    """An APIError raised anywhere answers as itself; a path the app does not serve (404), a
    method it does not take there (405) or a path parameter of the wrong type (400) answers in
    the same OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _route_error(request: Request, exc: HTTPException) -> Response:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            err = APIError(404, f"no such endpoint: {where}", "not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"method not allowed: {where}", "method_not_allowed")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        return err.response(dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def _path_error(request: Request, exc: RequestValidationError) -> Response:
        # a path parameter of the wrong type (bodies are validated by the endpoints themselves)
        first = exc.errors()[0] if exc.errors() else {}
        field = str(first.get("loc", ["", "?"])[-1])
        return bad_request(f"{field}: {first.get('msg', 'invalid')}", field).response()
