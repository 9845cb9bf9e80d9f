"""One request's life in the frontend: submit to a group, turn its tokens into text deltas, stop
at stop strings, time it, and cancel it in the group when the client goes away.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from safeserve.messages import SamplingParams
from safeserve.model.tokenizer import Tokenizer
from safeserve.server.detokenizer import IncrementalDetokenizer
from safeserve.server.errors import APIError, unavailable
from safeserve.server.group_client import GroupClient
from safeserve.server.metrics import Metrics


@dataclass
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class Generation:
    def __init__(
        self,
        gen: Generator,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: list[str],
    ) -> None:
        self.owner = gen
        self.rid = rid
        self.model = gen.model_name
        self.prompt_ids = prompt_ids
        self.params = params
        self.detok = IncrementalDetokenizer(gen.tokenizer, stop)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_output_tokens = 0
        self.finished = False
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.queue = gen.group.submit(rid, prompt_ids, params)
        gen.metrics.prompt_tokens.inc(len(prompt_ids))

    async def deltas(self) -> AsyncIterator[Delta]:
        m = self.owner.metrics
        while not self.finished:
            out = await self.queue.get()
            if out.finish_reason in ("group_failed", "error"):
                self.finished = True
                if out.finish_reason == "group_failed":
                    raise unavailable(
                        "the group serving this request failed; retry", retry_after=1.0
                    )
                raise APIError(500, "the engine refused this request", "engine_error")
            now = time.monotonic()
            if out.new_token_ids and self.first_token_at is None:
                self.first_token_at = now
                m.ttft.observe(now - self.arrival)
            m.generation_tokens.inc(max(0, out.num_output_tokens - self.num_output_tokens))
            self.num_output_tokens = max(self.num_output_tokens, out.num_output_tokens)
            finish = out.finish_reason
            text = self.detok.add(out.new_token_ids, finished=finish is not None)
            if self.detok.stopped and finish is None:
                finish = "stop"
                self.owner.group.abort(self.rid)  # the engine stops working on it now
            if finish is not None:
                self.finished = True
                self._observe_end(now)
            yield Delta(text, list(out.new_token_ids), finish)

    def _observe_end(self, now: float) -> None:
        m = self.owner.metrics
        m.e2e.observe(now - self.arrival)
        if self.first_token_at is not None and self.num_output_tokens > 1:
            m.tpot.observe((now - self.first_token_at) / (self.num_output_tokens - 1))

    def close(self) -> None:
        """Called when the HTTP response ends: an unfinished request is cancelled in the group."""
        if not self.finished:
            self.finished = True
            self.owner.group.abort(self.rid)
        else:
            self.owner.group.release(self.rid)
        self.owner.active.pop(self.rid, None)


class Generator:
    def __init__(
        self, tokenizer: Tokenizer, group: GroupClient, metrics: Metrics, model_name: str
    ) -> None:
        self.tokenizer = tokenizer
        self.group = group
        self.metrics = metrics
        self.model_name = model_name
        self.active: dict[str, Generation] = {}

    def start(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, stop: list[str]
    ) -> Generation:
        gen = Generation(self, rid, prompt_ids, params, stop)
        self.active[rid] = gen
        return gen
