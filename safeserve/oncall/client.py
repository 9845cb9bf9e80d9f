"""The admin API, as the on-call CLI sees it: a thin client, all logic stays in the server."""

from __future__ import annotations

import os
from typing import Any

import httpx

DEFAULT_ADMIN_URL = "http://127.0.0.1:8001"
URL_ENV = "SAFESERVE_ADMIN_URL"
KEY_ENV = "SAFESERVE_ADMIN_API_KEY"


class Unreachable(RuntimeError):
    """No admin API answered at that address."""


class Refused(RuntimeError):
    """The admin API answered with an error (its message is the server's)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class AdminClient:
    def __init__(self, url: str | None = None, key: str | None = None, timeout: float = 10.0):
        self.url = (url or os.environ.get(URL_ENV) or DEFAULT_ADMIN_URL).rstrip("/")
        key = key or os.environ.get(KEY_ENV)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout = timeout

    def _call(self, method: str, path: str) -> Any:
        try:
            r = httpx.request(method, self.url + path, headers=self.headers, timeout=self.timeout)
        except httpx.HTTPError as e:
            raise Unreachable(f"no admin API at {self.url} ({type(e).__name__}: {e})") from None
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:200] or r.reason_phrase
            raise Refused(r.status_code, message)
        return r.json()

    def groups(self) -> list[dict[str, Any]]:
        return self._call("GET", "/admin/groups")["groups"]

    def nodes(self) -> dict[str, Any]:
        """The node agents (--placement remote): placement, lease, nodes, refused frames."""
        return self._call("GET", "/admin/nodes")

    def config(self) -> dict[str, Any]:
        return self._call("GET", "/admin/config")

    def quarantine(self) -> dict[str, Any]:
        """Suspects and quarantined fingerprints (the query-of-death rule)."""
        return self._call("GET", "/admin/quarantine")

    def lift(self, fingerprint: str | None, dry_run: bool = False) -> dict[str, Any]:
        """Lifts one quarantine (every one when None); with `dry_run` the server only names them."""
        path = "/admin/quarantine" + (f"/{fingerprint}" if fingerprint else "")
        return self._call("DELETE", path + ("?dry_run=1" if dry_run else ""))

    def act(self, group_id: int, action: str, dry_run: bool = False) -> dict[str, Any]:
        """drain / undrain / restart; with `dry_run` the server only checks it."""
        query = "?dry_run=1" if dry_run else ""
        return self._call("POST", f"/admin/groups/{group_id}/{action}{query}")
