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
    def __init__(
        self,
        allocator: BlockAllocator,
        max_running_requests: int,
        max_num_batched_tokens: int,
        chunked_prefill_size: int,
    ) -> None:
        self.allocator = allocator
        self.max_running = max_running_requests
        self.token_budget = max_num_batched_tokens
        self.chunk = min(chunked_prefill_size, max_num_batched_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        if req.rid in self.requests:
            raise ValueError(f"duplicate request id {req.rid}")
        max_blocks = self.allocator.num_blocks
        if self.allocator.blocks_needed(req, req.num_tokens + 1) > max_blocks:
            raise ValueError("request does not fit in the KV cache")
        self.requests[req.rid] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.allocator.free(req)
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
        self.allocator.free(req)
        req.num_computed = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _grant(self, req: Request, budget: int) -> int:
        return min(req.num_pending, self.chunk, budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._grant(req, budget)
            if n <= 0:
                i += 1
                continue
            while not self.allocator.can_allocate(req, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            self.allocator.allocate(req, req.num_computed + n)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        # New requests only when nothing had to give way this step.
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_running
        ):
            req = self.waiting[0]
            n = self._grant(req, budget)
            if not self.allocator.can_allocate(req, req.num_computed + n):
                break
            self.waiting.popleft()
            self.allocator.allocate(req, req.num_computed + n)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out
