"""One request's life in the frontend: submit to a group, turn its tokens into text deltas, stop
at stop strings, time it, cancel it in its group when the client goes away, and, when its group
fails, continue it on another group as a continuation (prompt + every token already produced,
the remaining `max_tokens`, the same sampling and seed), so the client's stream goes on with no
token lost or repeated. A request that was in flight on a failed group is a suspect: it migrates
onto a group holding no other suspect on probation (until its first token there), and is
quarantined if that group fails during its probation (`safeserve.guards.quarantine`); a group
that failed because a node agent running its ranks was lost makes no suspects (the host failed,
not a request). An engine error in the request alone ends that request (500 `internal_error`);
its group is fine, so it is not retried.

A request that is still waiting in its group (no output received, so no token generated and
nothing sent to its client) may be *moved* once to a group that just became READY
(`Generator.rebalance`): it is aborted in its group and submitted afresh to the other under a
new engine-side id, so a late output of the old submission can never reach it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NoReturn

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from safeserve.config import ServerArgs
from safeserve.guards.quarantine import Quarantine, QueryOfDeath, fingerprint
from safeserve.messages import RequestOutput, SamplingParams, TokenLogprob
from safeserve.model.tokenizer import Tokenizer
from safeserve.server.detokenizer import IncrementalDetokenizer
from safeserve.server.errors import APIError, unavailable
from safeserve.server.group_client import GroupUnavailable
from safeserve.server.metrics import Metrics
from safeserve.server.router import GroupRouter, NoGroupReady
from safeserve.server.supervisor import Supervisor

logger = logging.getLogger(__name__)


@dataclass
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked


# The finish reason of the marker a moved request's old queue gets: its reader goes on with the
# new queue. It never leaves the frontend.
MOVED = "moved"


class _Refailed(Exception):
    """The continuation's group failed too before it produced anything."""


class _Refusals:
    """The groups whose leader refused one request's submission, each passed over for that
    request until the group runs another incarnation (a restarted group may take it)."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self._clients: dict[int, object] = {}  # group -> the incarnation (client) that refused

    def add(self, sup: Supervisor, why: Exception) -> None:
        self._clients[sup.group] = sup.client
        self.gen.refused_by(sup, why)

    def groups(self) -> set[int]:
        return {
            s.group
            for s in self.gen.owner.router.supervisors
            if s.client is not None and self._clients.get(s.group) is s.client
        }


class Generation:
    def __init__(
        self,
        gen: Generator,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: list[str],
        fp: str = "",
    ) -> None:
        self.owner = gen
        self.rid = rid
        self.fingerprint = fp  # of the original prompt and sampling, computed at admission
        self.model = gen.model_name
        self.prompt_ids = prompt_ids
        self.params = params
        self.detok = IncrementalDetokenizer(gen.tokenizer, stop)
        self.num_prompt_tokens = len(prompt_ids)
        self.produced: list[int] = []  # every token received, in order (a continuation's prefix)
        # The prompt's logprobs when asked (`echo` with `logprobs`), from the first output.
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.base_outputs = 0  # outputs counted by earlier incarnations (stop tokens included)
        self.num_output_tokens = 0
        self.attempts = 1
        self.moves = 0  # times moved while waiting (at most once)
        self.finished = False
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        # NoGroupReady (no READY group could take it) -> 503 at the edge
        self._place(lambda refused: gen.router.pick(avoid=refused), prompt_ids, params)
        self._pending: RequestOutput | None = None
        gen.metrics.prompt_tokens.inc(len(prompt_ids))

    def _submit(self, sup: Supervisor, prompt: list[int], params: SamplingParams) -> None:
        """Submits to `sup`'s group and remembers the incarnation (its client) it went to: a
        failure is judged by that incarnation's cause, whatever the group is running since."""
        assert sup.client is not None
        try:
            queue = sup.client.submit(self.engine_rid, prompt, params)
        except GroupUnavailable as e:  # nothing sent: as if no group had been READY
            raise NoGroupReady(str(e)) from e
        self.supervisor, self.client, self.queue = sup, sup.client, queue

    def _place(
        self,
        pick: Callable[[set[int]], Supervisor],
        prompt: list[int],
        params: SamplingParams,
    ) -> Supervisor:
        """Submits to the group `pick` chooses (never one it was told to avoid). A group whose
        leader cannot take the request now is passed over for `pick`'s next choice: a leader
        that died a moment ago refuses sends before its watchdog has failed the group, and the
        request must not be refused while another group is READY. NoGroupReady when `pick` has
        no group left."""
        refused = _Refusals(self)
        while True:
            sup = pick(refused.groups())
            try:
                self._submit(sup, prompt, params)
                return sup
            except NoGroupReady as e:
                refused.add(sup, e)

    def refused_by(self, sup: Supervisor, why: Exception) -> None:
        """`sup`'s leader could not take this request: counted and logged."""
        self.owner.metrics.sends_refused.labels(str(sup.group)).inc()
        logger.warning("request %s: %s", self.rid, why)

    @property
    def engine_rid(self) -> str:
        """The id its group knows it by: a moved request is submitted under a new one."""
        return self.rid if self.moves == 0 else f"{self.rid}.m{self.moves}"

    @property
    def movable(self) -> bool:
        """Still waiting where it was first placed: nothing received from its group (so no
        token generated and nothing sent to its client), never migrated or moved."""
        client = self.supervisor.client
        return (
            not self.finished
            and self.attempts == 1
            and self.moves == 0
            and not self.produced
            and self.first_token_at is None
            and self._pending is None
            and self.queue.empty()
            and client is not None
            and client.queues.get(self.engine_rid) is self.queue
        )

    def move_to(self, sup: Supervisor) -> bool:
        """Submits the request afresh to `sup` and aborts it in its group (callers check
        `movable` first, with no await in between); False where `sup` could not take it (it
        stays where it waits)."""
        old_client, old_queue, old_group = self.supervisor.client, self.queue, self.supervisor.group
        assert old_client is not None and sup.client is not None
        old_rid = self.engine_rid
        self.moves += 1
        try:
            self._submit(sup, self.prompt_ids, self.params)
        except NoGroupReady as e:  # `sup` cannot take it now: it keeps waiting where it is
            self.moves -= 1
            self.refused_by(sup, e)
            return False
        old_client.abort(old_rid)
        old_queue.put_nowait(RequestOutput(self.rid, [], MOVED))  # wakes its reader
        self.owner.router.count(sup, "moved")
        logger.info(
            "request %s: still waiting on group %d, moved to group %d",
            self.rid,
            old_group,
            sup.group,
        )
        return True

    async def _next(self) -> RequestOutput:
        if self._pending is not None:
            out, self._pending = self._pending, None
            return out
        return await self.queue.get()

    async def deltas(self) -> AsyncIterator[Delta]:
        m = self.owner.metrics
        try:
            while not self.finished:
                out = await self._next()
                if out.finish_reason == MOVED:
                    continue
                if out.finish_reason == "group_failed":
                    await self._migrate()
                    continue
                if out.finish_reason == "error":  # this request alone failed; its group is fine
                    self.finished = True
                    why = out.error or "the engine ended it with an error and gave no reason"
                    raise APIError(500, f"internal error in this request: {why}", "internal_error")
                now = time.monotonic()
                if out.new_token_ids and self.owner.qod.first_token(self.rid):
                    self.owner.router.notify()  # its group may take the next suspect
                if out.new_token_ids and self.first_token_at is None:
                    self.first_token_at = now
                    m.ttft.observe(now - self.arrival)
                total = self.base_outputs + out.num_output_tokens
                m.generation_tokens.labels(str(self.supervisor.group)).inc(
                    max(0, total - self.num_output_tokens)
                )
                self.num_output_tokens = max(self.num_output_tokens, total)
                self.produced.extend(out.new_token_ids)
                if out.prompt_logprobs is not None and self.prompt_logprobs is None:
                    self.prompt_logprobs = out.prompt_logprobs
                finish = out.finish_reason
                text = self.detok.add(out.new_token_ids, finished=finish is not None)
                if self.detok.stopped:  # a stop string, even one its last allowed token ends
                    if finish is None:
                        self._client_abort()  # the engine stops working on it now
                    finish = "stop"
                if finish is not None:
                    self.finished = True
                    self._observe_end(now)
                yield Delta(text, list(out.new_token_ids), finish, out.logprobs)
        except (APIError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # a bug, not a fault: count it, answer cleanly
            logger.exception("request %s lost", self.rid)
            self.owner.metrics.lost.inc()
            self.finished = True
            raise APIError(500, f"internal error: {type(e).__name__}", "internal_error") from e

    async def _migrate(self) -> None:
        """Continues the request on another READY group, within its attempts: as a suspect
        (on a group holding no other suspect on probation; quarantined if it was on probation
        on the failed group), or, with the query-of-death rule off, within the retry budget."""
        gen, args = self.owner, self.owner.args
        failed_group = self.supervisor.group
        left = args.max_request_attempts - self.attempts
        remaining = self.params.max_tokens - len(self.produced)
        if remaining <= 0:  # everything was produced; only the finish was lost with the group
            self._pending = RequestOutput(self.rid, [], "length", self.num_prompt_tokens, 0)
            return
        # A lost node agent (killed, frozen, cut off) is its host's failure, not a request's:
        # what was in flight there becomes no suspect (a suspect from an earlier failure stays
        # one, and is not quarantined for this one).
        host_failure = self.client.node_lost
        suspect = gen.qod.enabled and (not host_failure or self.rid in gen.qod.suspects)
        if gen.qod.enabled and not host_failure:
            quarantine = gen.qod.group_failed(self.rid, self.fingerprint, failed_group)
            if quarantine is not None:
                self._quarantined(quarantine)
        if left <= 0:
            self._give_up(f"its group failed and it already used {self.attempts} attempts")
        params = dataclasses.replace(
            self.params,
            max_tokens=remaining,
            output_offset=self.params.output_offset + len(self.produced),
            # the prompt's logprobs came with the first output: not again over a longer prompt
            prompt_logprobs=None
            if self.prompt_logprobs is not None
            else self.params.prompt_logprobs,
        )
        prompt = self.prompt_ids + self.produced
        if suspect:
            await self._migrate_suspect(prompt, params, failed_group)
            return
        refused = _Refusals(self)
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(left),
                wait=wait_exponential(multiplier=0.2, max=2.0),
                retry=retry_if_exception_type((NoGroupReady, _Refailed)),
                reraise=True,
            ):
                with attempt:
                    self.attempts += 1
                    gen.metrics.retries.inc()
                    async with gen.router.retry_slot(args.migration_wait_s):
                        sup = await gen.router.wait_pick(
                            args.migration_wait_s,
                            exclude=failed_group,
                            avoid=refused.groups,
                            reason="migrated",
                        )
                        try:
                            self._submit(sup, prompt, params)
                        except NoGroupReady as e:
                            refused.add(sup, e)
                            raise
                        gen.metrics.migrations.inc()
                        logger.info(
                            "request %s: group %d failed after %d tokens; continuing on group %d",
                            self.rid,
                            failed_group,
                            len(self.produced),
                            sup.group,
                        )
                        first = await self.queue.get()  # the slot is held until it moves again
                        if first.finish_reason == "group_failed":
                            failed_group = sup.group
                            raise _Refailed
                        self._pending = first
        except (NoGroupReady, _Refailed, TimeoutError):
            self._give_up("no group could take it over within its attempts")
        self.base_outputs = self.num_output_tokens

    async def _migrate_suspect(
        self, prompt: list[int], params: SamplingParams, failed_group: int
    ) -> None:
        """One attempt, on a READY group that holds no other suspect on probation (waiting for
        one)."""
        gen, args = self.owner, self.owner.args
        self.attempts += 1
        gen.metrics.retries.inc()
        refused = _Refusals(self)
        while True:
            try:
                sup = await gen.router.wait_pick(
                    args.migration_wait_s,
                    exclude=failed_group,
                    avoid=lambda: gen.qod.suspect_groups() | refused.groups(),
                    reason="migrated",
                )
            except NoGroupReady:
                self._give_up(
                    f"no READY group free of other suspects on probation took it within "
                    f"{args.migration_wait_s:g} s"
                )
            try:
                self._submit(sup, prompt, params)
                break
            except NoGroupReady as e:
                refused.add(sup, e)
        gen.qod.place(self.rid, sup.group)  # no await since the pick: no other suspect got it
        gen.metrics.migrations.inc()
        logger.warning(
            "request %s (fingerprint %s) was in flight on group %d when it failed (%d tokens "
            "produced): suspect, continuing on group %d; if that group fails too it is quarantined",
            self.rid,
            self.fingerprint,
            failed_group,
            len(self.produced),
            sup.group,
        )
        self.base_outputs = self.num_output_tokens

    def _quarantined(self, q: Quarantine) -> None:
        self.finished = True
        self.owner.metrics.quarantined.inc()
        a, b = q.groups
        logger.error(
            "request %s quarantined (fingerprint %s): in flight on group %d and then on group %d "
            "when each failed; not retried, identical requests refused for %.0f s",
            self.rid,
            q.fingerprint,
            a,
            b,
            self.owner.args.quarantine_s,
        )
        raise APIError(
            422,
            f"this request was in flight on group {a} and then on group {b} when each failed: "
            f"it is quarantined, not retried, and identical requests (fingerprint "
            f"{q.fingerprint}) are refused for {self.owner.args.quarantine_s:.0f} s",
            "request_quarantined",
        )

    def _give_up(self, why: str) -> NoReturn:
        self.finished = True
        self.owner.metrics.failed_after_retries.inc()
        raise unavailable(
            f"the group serving this request failed and {why}; retry", retry_after=1.0
        )

    def _observe_end(self, now: float) -> None:
        m = self.owner.metrics
        m.e2e.observe(now - self.arrival)
        if self.first_token_at is not None and self.num_output_tokens > 1:
            m.tpot.observe((now - self.first_token_at) / (self.num_output_tokens - 1))

    def _client_abort(self) -> None:
        client = self.supervisor.client
        if client is not None:
            client.abort(self.engine_rid)

    def close(self) -> None:
        """Called when the HTTP response ends: an unfinished request is cancelled in its group."""
        client = self.supervisor.client
        if not self.finished:
            self.finished = True
            if client is not None:
                client.abort(self.engine_rid)
        elif client is not None:
            client.release(self.engine_rid)
        self.owner.active.pop(self.rid, None)
        self.owner.router.active = len(self.owner.active)
        if self.owner.qod.clear(self.rid):
            self.owner.metrics.suspects_cleared.inc()
            self.owner.router.notify()  # its group holds no suspect now


class Generator:
    def __init__(
        self,
        args: ServerArgs,
        tokenizer: Tokenizer,
        router: GroupRouter,
        metrics: Metrics,
        model_name: str,
    ) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.router = router
        self.metrics = metrics
        self.model_name = model_name
        self.active: dict[str, Generation] = {}
        self.qod = QueryOfDeath(args.quarantine_s)
        metrics.suspects.set_function(lambda: len(self.qod.suspects))
        metrics.quarantine_fingerprints.set_function(lambda: len(self.qod.held()))
        router.on_ready.append(self.rebalance)

    def start(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, stop: list[str]
    ) -> Generation:
        fp = self.admit(prompt_ids, params)
        self._shed_when_full()
        gen = Generation(self, rid, prompt_ids, params, stop, fp)
        self.active[rid] = gen
        self.router.active = len(self.active)
        return gen

    def rebalance(self, target: Supervisor) -> int:
        """`target` just became READY: moves requests still waiting on other groups to it,
        newest first, while the source holds more waiting requests (queued, or sent since its
        last report: `router.score`) than it has moved, and keeps at least as many occupied
        slots as `target` after the move. Returns how many moved."""
        router = self.router
        scores = {s.group: router.score(s) for s in router.ready()}
        if target.group not in scores or target.client is None:
            return 0
        occupied = {g: sc.occupied for g, sc in scores.items()}
        waiting = {g: sc.waiting for g, sc in scores.items()}
        moved = 0
        newest_first = sorted(self.active.values(), key=lambda g: g.arrival, reverse=True)
        for gen in newest_first:
            src = gen.supervisor.group
            if src == target.group or src not in scores or not gen.movable:
                continue
            if waiting[src] <= 0 or occupied[src] - occupied[target.group] < 2:
                continue
            if not gen.move_to(target):
                break  # the target takes no more now
            occupied[src] -= 1
            waiting[src] -= 1
            occupied[target.group] += 1
            moved += 1
        if moved:
            logger.info("group %d READY: moved %d waiting request(s) to it", target.group, moved)
        return moved

    def _shed_when_full(self) -> None:
        """503 with Retry-After while --max-queued-requests wait for a decode slot on the READY
        groups together (queued at their last report, or sent beyond their slots since:
        `router.score`)."""
        cap = self.args.max_queued_requests
        if cap <= 0:
            return
        waiting = sum(self.router.score(s).queued for s in self.router.ready())
        if waiting >= cap:
            self.metrics.shed.inc()
            raise unavailable(
                f"{waiting} requests already wait for a decode slot (--max-queued-requests "
                f"{cap}); retry later",
                retry_after=1.0,
            )

    def admit(self, prompt_ids: list[int], params: SamplingParams) -> str:
        """The request's fingerprint; 422 `request_quarantined` (with Retry-After) if an
        identical request is quarantined. `start` calls it; the edge may call it first, so a
        quarantined request is refused even while no group is READY."""
        fp = fingerprint(prompt_ids, params)
        if (q := self.qod.refusal(fp)) is not None:
            self.metrics.quarantine_refusals.inc()
            left = self.qod.remaining_s(q)
            raise APIError(
                422,
                f"an identical request (fingerprint {fp}) was in flight on groups {q.groups[0]} "
                f"and {q.groups[1]} when each failed: refused for another {left:.0f} s "
                "(an operator can lift it: safeserve oncall lift quarantine)",
                "request_quarantined",
                retry_after=max(1.0, left),
            )
        return fp
