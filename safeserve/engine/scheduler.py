"""Who runs this step, and with how many tokens.

There is no prefill or decode phase: each request has tokens computed and tokens it still needs,
and each step grants tokens under a budget (vLLM v1's model). Chunked prefill is granting fewer
than a prompt needs. Running requests come first, in arrival order; when KV blocks run out the
most recently admitted running request is preempted (its blocks freed, recomputed later from its
tokens), so no request's cache is ever overwritten.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from safeserve.engine.kv_cache import BlockAllocator
from safeserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    req: Request
    num_tokens: int  # tokens computed this step, starting at req.num_computed

    @property
    def samples(self) -> bool:
        """The step reaches the end of the request's tokens, so it samples the next one."""
        return self.req.num_computed + self.num_tokens == self.req.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    """One scheduler per group (on its leader); with attention data-parallel it keeps one KV
    allocator and one token budget per attention rank, and a request stays on the rank it was
    admitted to until it finishes or is preempted."""

    def __init__(
        self,
        allocators: list[BlockAllocator],
        max_running_requests: int,
        max_num_batched_tokens: int,
        chunked_prefill_size: int,
    ) -> None:
        self.allocators = allocators
        self.max_running = max_running_requests
        self.token_budget = max_num_batched_tokens
        self.chunk = min(chunked_prefill_size, max_num_batched_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    @property
    def dp_size(self) -> int:
        return len(self.allocators)

    @property
    def num_blocks_used(self) -> int:
        return sum(a.num_used for a in self.allocators)

    @property
    def num_blocks_total(self) -> int:
        return sum(a.num_blocks for a in self.allocators)

    def add(self, req: Request) -> None:
        if req.rid in self.requests:
            raise ValueError(f"duplicate request id {req.rid}")
        alloc = self.allocators[0]
        if alloc.blocks_needed(req, req.num_tokens + 1) > alloc.num_blocks:
            raise ValueError("request does not fit in the KV cache")
        self.requests[req.rid] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.allocators[req.dp_rank].free(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.rid, None)

    def abort(self, rid: str) -> Request | None:
        req = self.requests.get(rid)
        if req is not None:
            self.finish(req, "abort")
        return req

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.allocators[req.dp_rank].free(req)
        req.num_computed = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = [self.token_budget] * self.dp_size
        i = 0
        while i < len(self.running):
            req = self.running[i]
            r = req.dp_rank
            n = min(req.num_pending, self.chunk, budget[r])
            if n <= 0:
                i += 1
                continue
            alloc = self.allocators[r]
            while not alloc.can_allocate(req, req.num_computed + n):
                # The newest running request on the same attention rank gives way.
                victim = next(v for v in reversed(self.running) if v.dp_rank == r)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted itself; self.running shifted, `i` now points at the next
            alloc.allocate(req, req.num_computed + n)
            out.scheduled.append(ScheduledRequest(req, n))
            budget[r] -= n
            i += 1
        # New requests only when nothing had to give way this step.
        while not out.preempted and self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            r = self._pick_rank(req, budget)
            if r is None:
                break
            n = min(req.num_pending, self.chunk, budget[r])
            self.waiting.popleft()
            req.dp_rank = r
            self.allocators[r].allocate(req, req.num_computed + n)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget[r] -= n
        return out

    def _pick_rank(self, req: Request, budget: list[int]) -> int | None:
        """The attention rank with the fewest running requests that has budget and blocks."""
        load = [0] * self.dp_size
        for r in self.running:
            load[r.dp_rank] += 1
        for r in sorted(range(self.dp_size), key=lambda k: (load[k], k)):
            n = min(req.num_pending, self.chunk, budget[r])
            if n > 0 and self.allocators[r].can_allocate(req, req.num_computed + n):
                return r
        return None
