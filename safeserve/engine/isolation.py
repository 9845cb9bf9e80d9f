"""Keeping a failed step's exception with the request(s) it comes from.

When a step raises on some rank (and every rank got past it: outcome.py says which exceptions
those are), the leader re-runs the step's scheduled requests in halves, recursively, until each
failing part is one request: those are the culprits, failed alone with an error output; every
other request's results come from the sub-step that ran it, exactly what the unfailed step
would have given. Re-running is safe because nothing of the failed attempt is kept: a request's
`num_computed` only advances in postprocessing, so the K/V the failed attempt wrote is
overwritten by the re-run at the same positions and blocks, and the block tables the other
ranks rebuilt from the failed plan (`TableSender`) are the ones the sub-plans continue from.
Each failing part of two or more requests costs two sub-steps, so a step of n requests costs
at most 2·(n - 1) sub-steps.

A step where every request fails, alone too, may mean a broken rank rather than n bad
requests: unless every failure is an injected request fault, the leader then runs a probe (one
token of a throwaway request); if that fails as well, the rank is broken and the exception goes
on to fail the group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from safeserve.engine.outcome import SeqResult, StepError
from safeserve.engine.scheduler import ScheduledRequest

logger = logging.getLogger(__name__)

RunScheduled = Callable[[list[ScheduledRequest]], list[SeqResult]]


def bisect_step(
    step: int, scheduled: list[ScheduledRequest], error: StepError, run: RunScheduled
) -> tuple[dict[int, SeqResult], dict[int, str]]:
    """After `scheduled` failed together with `error`: (results of the requests that ran
    without error, error message of each culprit), both keyed by index in `scheduled`. `run`
    runs a sub-step of some of them (raising StepError if it fails)."""
    results: dict[int, SeqResult] = {}
    culprits: dict[int, str] = {}

    def search(part: list[int], err: StepError) -> None:
        if len(part) == 1:
            rid = scheduled[part[0]].req.rid
            logger.warning("step %d: request %s fails alone: %s", step, rid, err)
            culprits[part[0]] = f"step: {err.failures[0].message}"
            return
        half = len(part) // 2
        halves = (part[:half], part[half:])
        logger.warning(
            "step %d: %d request(s) failed together (%s); re-running them in parts of %d and %d",
            step,
            len(part),
            err,
            len(halves[0]),
            len(halves[1]),
        )
        for sub in halves:
            try:
                got = run([scheduled[i] for i in sub])
            except StepError as e:
                search(sub, e)
                continue
            results.update(zip(sub, got, strict=True))

    search(list(range(len(scheduled))), error)
    if culprits:
        logger.warning(
            "step %d: isolated the failure to request(s) %s; %d other(s) continue",
            step,
            ", ".join(scheduled[i].req.rid for i in sorted(culprits)),
            len(results),
        )
    return results, culprits
