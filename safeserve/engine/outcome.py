"""What a rank's step gives back to the leader, and how a step that raised is told apart from a
rank that is broken.

Every rank sends one object through the step's gather: a `RankResult` (its sampled tokens, or
per-row errors, and the log-probabilities asked for) or a `StepFailed` when its part of the
step raised an exception it could catch. The leader treats any rank's `StepFailed` as the step
failing (`StepError`) and finds the request(s) it comes from by re-running the step in parts
(engine/isolation.py).

What can be survived: an exception raised where every rank of the group agrees on what comes
next, i.e. before the step's first collective (a `RequestFault`, raised on every rank from the
plan every rank holds) or after its last (sampling, log-probabilities). An exception on one
rank in the middle of the forward's collectives leaves its peers blocked in a collective it
will not join (its gather pairs with their all-reduce): the group hangs there and the watchdog
fences it, as for a hung rank. A rank that cannot go on (a CUDA error poisons its context;
os._exit) fails its group as before.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from safeserve.engine.plan import EplbRankReport, StepPlan
from safeserve.messages import TokenLogprob

logger = logging.getLogger(__name__)


class RequestFault(RuntimeError):
    """Fault injection: a step holding a request with `SamplingParams.fault == "raise"`."""


@dataclass
class RankResult:
    """One attention rank's part of a step's results, in the order of its plan's sequences."""

    # One per sampling sequence: the token, or that row's error (one line).
    tokens: list[int | str] = field(default_factory=list)
    # One per sampling sequence: the sampled token's log-probability, where asked.
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # Index of a sequence in this rank's list -> the prompt log-probabilities of its rows.
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    eplb: EplbRankReport | None = None  # an EPLB step's report (its plan has no sequences)


@dataclass
class SeqResult:
    """One scheduled request's results of a step, on the leader."""

    token: int | str | None = None  # the sampled token (or its row's error); None: no sample
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


def per_request(
    dp_ranks: list[int], samples: list[bool], ranks: list[RankResult]
) -> list[SeqResult]:
    """Each scheduled request's results (request i on attention rank `dp_ranks[i]`, sampling
    or not), from the ranks' results in plan order (Engine.build_plan appends a rank's
    sequences in scheduling order)."""
    seq_index = [0] * len(ranks)
    sample_index = [0] * len(ranks)
    out = []
    for r, samples_now in zip(dp_ranks, samples, strict=True):
        res = ranks[r]
        got = SeqResult(prompt_logprobs=res.prompt_logprobs.get(seq_index[r]))
        seq_index[r] += 1
        if samples_now:
            j = sample_index[r]
            sample_index[r] += 1
            got.token = res.tokens[j]
            got.logprob = res.logprobs[j] if j < len(res.logprobs) else None
        out.append(got)
    return out


@dataclass
class StepFailed:
    """A rank's part of the step raised `message` ("<ExcType>: <msg>")."""

    rank: int
    message: str


class StepError(RuntimeError):
    """The step failed on at least one rank of the group; every rank is past it and waits for
    the next plan."""

    def __init__(self, failures: list[StepFailed]) -> None:
        self.failures = failures
        ranks: dict[str, list[int]] = {}  # every rank usually fails alike: say it once
        for f in failures:
            ranks.setdefault(f.message, []).append(f.rank)
        super().__init__(
            "; ".join(
                f"{msg} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                for msg, rs in ranks.items()
            )
        )

    @property
    def request_fault(self) -> bool:
        """Every failure is an injected request fault (certainly the request's, not the rank's)."""
        return all(f.message.startswith(f"{RequestFault.__name__}:") for f in self.failures)


def describe(e: BaseException) -> str:
    """One line: "<ExcType>: <msg>"."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def is_fatal(e: BaseException) -> bool:
    """Whether an exception means the rank cannot serve on (not one step's problem): a CUDA
    error leaves the device context unusable, and every later launch fails too."""
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    return "CUDA error" in str(e) or "NCCL" in str(e)


def apply_request_faults(plan: StepPlan, rank: int, dp_attention: bool) -> None:
    """Fault injection borne by requests (`SamplingParams.fault`, carried in `SeqPlan.fault`),
    checked on every rank from the whole plan before the step's first collective: "exit" ends
    the rank that computes the request (rank 0 with tensor-parallel attention, the request's
    attention rank with attention data-parallel) at once, silently, as a crash would; "raise"
    makes every rank raise `RequestFault` in lock step, so the group survives it."""
    raising = False
    for r, seqs in enumerate(plan.per_rank):
        for s in seqs:
            if s.fault == "exit" and rank == (r if dp_attention else 0):
                logger.warning(
                    "fault injection: request fault 'exit' in step %s: rank %d exits",
                    plan.step,
                    rank,
                )
                logging.shutdown()
                os._exit(1)
            raising = raising or s.fault == "raise"
    if raising:
        logger.warning(
            "fault injection: request fault 'raise' in step %s",
            plan.step,
        )
        raise RequestFault(f"injected request fault 'raise' in step {plan.step}")
