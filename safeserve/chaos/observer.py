"""What the server says about itself during a run: `/metrics` and `/admin/groups`, polled (and
`/admin/nodes` in a run on node agents: when a node was LOST is only seen while it is)."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

POLL_S = 0.25
_SAMPLE = re.compile(r"^safeserve:(\w+?)(?:\{([^}]*)\})? (\S+)$", re.M)


def parse_metrics(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """`name -> {sorted label pairs -> value}` for every `safeserve:` sample."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for name, labels, value in _SAMPLE.findall(text):
        pairs = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels or "")))
        out.setdefault(name, {})[pairs] = float(value)
    return out


def metric_total(m: dict, name: str, **match: str) -> float:
    """Sum of `name` over the samples whose labels include `match`."""
    return sum(
        v
        for labels, v in m.get(name, {}).items()
        if all((k, val) in labels for k, val in match.items())
    )


@dataclass
class Sample:
    t: float  # seconds since the load started
    tokens: dict[int, float]  # generation_tokens_total by group
    groups: list[dict[str, Any]]
    nodes: list[dict[str, Any]] = field(default_factory=list)  # /admin/nodes (node runs)
    wall: float = 0.0  # time.time() when taken


@dataclass
class Observer:
    url: str
    admin_url: str
    admin_key: str | None = None
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    watch_nodes: bool = False  # also poll /admin/nodes

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    async def metrics(self, client: httpx.AsyncClient) -> dict:
        r = await client.get(self.url + "/metrics")
        r.raise_for_status()
        return parse_metrics(r.text)

    async def groups(self, client: httpx.AsyncClient) -> list[dict[str, Any]]:
        r = await client.get(self.admin_url + "/admin/groups", headers=self.headers)
        r.raise_for_status()
        return r.json()["groups"]

    async def nodes(self, client: httpx.AsyncClient) -> list[dict[str, Any]]:
        r = await client.get(self.admin_url + "/admin/nodes", headers=self.headers)
        r.raise_for_status()
        return r.json()["nodes"]

    async def _no_nodes(self) -> list[dict[str, Any]]:
        return []

    async def sample(self, client: httpx.AsyncClient, t: float) -> Sample:
        wall = time.time()
        m, groups, nodes = await asyncio.gather(
            self.metrics(client),
            self.groups(client),
            self.nodes(client) if self.watch_nodes else self._no_nodes(),
        )
        tokens = {
            int(dict(k).get("group", -1)): v
            for k, v in m.get("generation_tokens_total", {}).items()
        }
        s = Sample(t, tokens, groups, nodes, wall)
        self.samples.append(s)
        return s

    async def poll(self, t0: float, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            while not stop.is_set():
                try:
                    await self.sample(client, time.monotonic() - t0)
                except (httpx.HTTPError, ValueError, KeyError):
                    self.errors += 1  # a busy server can miss a poll; the series has gaps
                try:
                    await asyncio.wait_for(stop.wait(), POLL_S)
                except TimeoutError:
                    pass

    def tokens_at(self, group: int, t: float) -> float | None:
        """The group's cumulative generated tokens at time t (linear between samples)."""
        pts = [(s.t, s.tokens[group]) for s in self.samples if group in s.tokens]
        if not pts or t < pts[0][0] or t > pts[-1][0]:
            return None
        for (ta, va), (tb, vb) in zip(pts, pts[1:], strict=False):
            if ta <= t <= tb:
                return va if tb == ta else va + (vb - va) * (t - ta) / (tb - ta)
        return pts[-1][1]

    def rate(self, group: int, a: float, b: float) -> float | None:
        """The group's tokens per second over [a, b]."""
        if b <= a:
            return None
        ta, tb = self.tokens_at(group, a), self.tokens_at(group, b)
        return None if ta is None or tb is None else (tb - ta) / (b - a)
