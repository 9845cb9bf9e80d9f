"""The canary: a short fixed greedy prompt that a group answers through the serving path, so a
device that stays up but computes wrong results (a bad memory page, an error the process
survives) is caught: heartbeats, utilization and exit codes all look healthy there.

A group's first answer after it became READY is its reference. Each later answer is compared
with it: the same tokens, each with about the same log-probability. Where a token differs, it
counts as healthy only if it is the reference's runner-up there, within a near tie of its best
(GPU kernels in bfloat16 may flip a near tie with the batch the canary shares), and the comparison
stops there (what follows a different token legitimately differs). With
`--enable-deterministic-inference` on CUDA the answer carries a digest of each position's whole
logits row, and those must equal the reference's exactly: a request's logits are then the same to
the bit whatever shares its steps. A mismatch is checked once more at once;
two in a row are a `corrupt` verdict that fences the group (`server/group_client.py` runs the
canary every `--canary-interval-s`; `GET /health/generate` runs one on demand).
"""

from __future__ import annotations

from dataclasses import dataclass

from safeserve.messages import SamplingParams, TokenLogprob

PROMPT_LEN = 8
MAX_TOKENS = 4
# A healthy device moves a token's log-probability by far less than this (bfloat16 batch effects
# are around 1e-2 nats); corrupted weights move it by whole nats.
LOGPROB_TOLERANCE_NATS = 0.5
# Below this margin between the reference's best two tokens a different token is a near-tie
# flip, not a fault.
NEAR_TIE_NATS = 0.25


def canary_prompt(vocab_size: int) -> list[int]:
    """The fixed prompt: spread-out ids, the same on every group and every start."""
    return [(97 * i + 13) % vocab_size for i in range(PROMPT_LEN)]


def canary_params() -> SamplingParams:
    """Greedy, a fixed length, with the sampled token's and the best two tokens' logprobs."""
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)


@dataclass
class CanaryAnswer:
    tokens: list[int]
    logprobs: list[TokenLogprob]


def compare(reference: CanaryAnswer, got: CanaryAnswer) -> str | None:
    """None when `got` is what a healthy device answers, given its `reference`; else why not
    (one line)."""
    if len(got.tokens) != len(reference.tokens) or len(got.logprobs) != len(got.tokens):
        return f"{len(got.tokens)} tokens, the reference has {len(reference.tokens)}"
    for i, (ref, now) in enumerate(zip(reference.logprobs, got.logprobs, strict=True)):
        if ref.digest is not None and now.digest is not None:
            if now.digest != ref.digest or now.token_id != ref.token_id:
                return (
                    f"token {i} ({now.token_id}) has logits digest {now.digest}, the "
                    f"reference's ({ref.token_id}) {ref.digest}: deterministic mode computes "
                    "the same logits to the bit"
                )
            continue
        if now.token_id != ref.token_id:
            if _near_tie_flip(ref, now):
                return None  # what follows a flipped near tie may differ
            return (
                f"token {i} is {now.token_id}, the reference's is {ref.token_id}, and not as "
                "its runner-up in a near tie"
            )
        if abs(now.logprob - ref.logprob) > LOGPROB_TOLERANCE_NATS:
            return (
                f"token {i} ({now.token_id}) has logprob {now.logprob:.3f}, the reference "
                f"{ref.logprob:.3f} (tolerance {LOGPROB_TOLERANCE_NATS} nats)"
            )
    return None


def _near_tie_flip(ref: TokenLogprob, now: TokenLogprob) -> bool:
    """`now` took the reference's runner-up, which was within NEAR_TIE_NATS of its best, with
    about the runner-up's logprob."""
    if len(ref.top) < 2:
        return False
    (_, best), (second_id, second) = ref.top[:2]
    return (
        now.token_id == second_id
        and best - second < NEAR_TIE_NATS
        and abs(now.logprob - second) <= LOGPROB_TOLERANCE_NATS
    )


# Results of one canary run (the `result` label of `safeserve:canary_runs_total`).
RESULTS = ("reference", "ok", "corrupt", "timeout", "error", "unavailable")


@dataclass
class CanaryRun:
    """One canary run on a group: `result` (RESULTS), the answer's tokens, why it was not
    `ok`, and how long it took."""

    group: int
    result: str
    tokens: list[int]
    reason: str | None = None
    latency_s: float = 0.0
