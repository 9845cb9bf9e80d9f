"""Streaming load, every token timed on arrival: closed loop (`concurrency` clients, each
sending its next greedy completion as soon as the last one ends) or open loop (completions
arriving as a Poisson process of `rate` per second, seeded, whatever the server answers).

Prompts are token ids (exact lengths with any tokenizer) drawn from a fixed seed and cycled over
`distinct_prompts`, so that greedy outputs of the same prompt can be compared across the run:
a migrated request whose tokens differ from its prompt's usual output lost or repeated one.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from safeserve.chaos.scenario import LoadSpec

PROMPT_TOKEN_RANGE = (10, 250)  # ids every vocabulary has (the byte-level tiny model's too)


@dataclass
class RequestRecord:
    index: int
    prompt: int  # which of the distinct prompts
    start: float  # seconds since the load started
    group: int | None = (
        None  # the group that served it (X-Safeserve-Group; streams: its first token's)
    )
    status: int | None = None  # HTTP status; None: no response at all
    token_ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # arrival of each token
    finish_reason: str | None = None
    error: str | None = None  # an error the server told the client (status or stream event)
    broken: str | None = None  # the stream ended without an answer (connection lost...)

    @property
    def end(self) -> float:
        return self.times[-1] if self.times else self.start

    def ttft(self) -> float | None:
        return self.times[0] - self.start if self.times else None

    def tpot(self) -> float | None:
        if len(self.times) < 2:
            return None
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1)


def prompts(spec: LoadSpec, seed: int = 1234) -> list[list[int]]:
    lo, hi = PROMPT_TOKEN_RANGE
    out = []
    for i in range(spec.distinct_prompts):
        rng = random.Random(seed + i)
        out.append([rng.randrange(lo, hi) for _ in range(spec.prompt_tokens)])
    return out


class Load:
    def __init__(self, url: str, spec: LoadSpec, model: str, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.spec = spec
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.prompts = prompts(spec)
        self.records: list[RequestRecord] = []
        self.t0 = 0.0
        self._stop_at = 0.0
        self.in_flight = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _http(self) -> httpx.AsyncClient:
        # open loop: no client-side queue (it would hide the server's)
        most = None if self.spec.mode == "open" else self.spec.concurrency + 4
        limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
        timeout = httpx.Timeout(self.spec.request_timeout_s, connect=10.0)
        return httpx.AsyncClient(limits=limits, timeout=timeout)

    async def run(self, t0: float) -> None:
        """Runs until `duration_s` after t0, then lets the requests in flight finish."""
        self.t0 = t0
        self._stop_at = self.spec.duration_s
        async with self._http() as client:
            if self.spec.mode == "open":
                await self._arrivals(client)
                return
            n = self.spec.concurrency
            await asyncio.gather(
                *(self._client(client, i * self.spec.ramp_s / n) for i in range(n))
            )

    async def reference(self) -> dict[int, list[int]]:
        """Each prompt the run sent, once more, alone (one request at a time): its tokens when
        nothing shares its batches and no fault is injected. Prompts whose lone answer did not
        succeed are left out."""
        out: dict[int, list[int]] = {}
        async with self._http() as client:
            for prompt in sorted({r.prompt for r in self.records}):
                rec = RequestRecord(-1, prompt, self.now())
                await self._one(client, rec)
                if rec.status == 200 and rec.finish_reason and not (rec.error or rec.broken):
                    out[prompt] = rec.token_ids
        return out

    async def one_round(self, t0: float) -> None:
        """Each of the `concurrency` clients sends one request, all at once, and waits for its
        end (kernels/bench_serve.py: a batch that starts together, as `safeserve bench`'s)."""
        self.t0 = t0
        async with self._http() as client:
            await asyncio.gather(*(self._request(client) for _ in range(self.spec.concurrency)))

    def arrival_times(self) -> list[float]:
        """Open loop: the seconds (since the start) at which requests are sent, a Poisson
        process of `rate` per second drawn from `seed`, up to `duration_s`."""
        assert self.spec.rate is not None
        rng = random.Random(self.spec.seed)
        out, t = [], rng.expovariate(self.spec.rate)
        while t < self.spec.duration_s:
            out.append(t)
            t += rng.expovariate(self.spec.rate)
        return out

    async def _arrivals(self, client: httpx.AsyncClient) -> None:
        tasks = []
        for at in self.arrival_times():
            await asyncio.sleep(max(0.0, at - self.now()))
            tasks.append(asyncio.create_task(self._request(client)))
        await asyncio.gather(*tasks)

    async def _client(self, client: httpx.AsyncClient, start_at: float) -> None:
        await asyncio.sleep(max(0.0, start_at - self.now()))
        while self.now() < self._stop_at:
            rec = await self._request(client)
            if rec.error and rec.status in (429, 503):
                await asyncio.sleep(0.2)  # told to back off: do, as a real client would

    async def _request(self, client: httpx.AsyncClient) -> RequestRecord:
        rec = RequestRecord(len(self.records), 0, self.now())
        rec.prompt = rec.index % len(self.prompts)
        self.records.append(rec)
        self.in_flight += 1
        try:
            await self._one(client, rec)
        finally:
            self.in_flight -= 1
        return rec

    async def _one(self, client: httpx.AsyncClient, rec: RequestRecord) -> None:
        body = {
            "model": self.model,
            "prompt": self.prompts[rec.prompt],
            "max_tokens": self.spec.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
        }
        try:
            async with client.stream(
                "POST", self.url + "/v1/completions", json=body, headers=self.headers
            ) as r:
                rec.status = r.status_code
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return
                rec.group = int(r.headers.get("x-safeserve-group", -1))
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                        continue
                    choice = chunk["choices"][0]
                    ids = choice.get("token_ids") or []
                    now = self.now()
                    rec.token_ids.extend(ids)
                    rec.times.extend([now] * len(ids))
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as e:
            rec.broken = f"{type(e).__name__}: {e}"[:200]
        if rec.status == 200 and rec.finish_reason is None and not rec.error and not rec.broken:
            rec.broken = "the stream ended without a finish reason"
