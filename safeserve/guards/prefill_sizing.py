"""Chunked-prefill sizing per attention group, from the dispatch budget.

`worst`: even if every attention group's tokens of a step were routed to one rank, that rank
receives at most the step's tokens (a token sends one row to a rank, whatever the number of its
choices there), so a step budget of `budget // attention_groups` tokens per group never needs a
second admission round. `observed`: the step budget follows the measured concentration (the
share of a step's tokens the busiest rank received, worst over a recent window), with the
admission rounds as the safety net when routing turns worse than seen.
"""

from __future__ import annotations

import logging
from collections import deque

from safeserve.messages import PrefillSizing

logger = logging.getLogger(__name__)

OBSERVED_WINDOW_STEPS = 200
MIN_OBSERVED_SHARE = 0.05  # never size as if the hottest rank got less than this share


def size_prefill(
    mode: str,
    budget: int | None,
    attention_groups: int,
    max_num_batched_tokens: int,
    chunked_prefill_size: int | None,
    share: float = 1.0,
) -> PrefillSizing:
    explicit = chunked_prefill_size
    if budget is None:
        step = max_num_batched_tokens
        chunk = min(explicit or step, step)
        return PrefillSizing(
            mode, None, attention_groups, max_num_batched_tokens, step, chunk, None, share, explicit
        )
    share = min(1.0, max(share, MIN_OBSERVED_SHARE))
    safe = max(1, int(budget / (attention_groups * share)))
    step = min(max_num_batched_tokens, safe)
    chunk = min(explicit or step, step)
    if explicit is not None and explicit > safe:
        # The operator asked for more: honour it; admission rounds keep the ranks safe.
        chunk = min(explicit, max_num_batched_tokens)
        step = max(step, chunk)
    return PrefillSizing(
        mode, budget, attention_groups, max_num_batched_tokens, step, chunk, safe, share, explicit
    )


class PrefillSizer:
    """Owns the sizing of one group's scheduler; in `observed` mode it adapts after each step."""

    def __init__(
        self,
        mode: str,
        budget: int | None,
        attention_groups: int,
        max_num_batched_tokens: int,
        chunked_prefill_size: int | None,
    ) -> None:
        self.args = (mode, budget, attention_groups, max_num_batched_tokens, chunked_prefill_size)
        self.sizing = size_prefill(*self.args)
        self._shares: deque[float] = deque(maxlen=OBSERVED_WINDOW_STEPS)
        logger.info(self.sizing.describe())
        if chunked_prefill_size is not None and self.sizing.safe_step_tokens is not None:
            if chunked_prefill_size > self.sizing.safe_step_tokens:
                logger.warning(
                    "--chunked-prefill-size %d is above the safe size %d per attention group "
                    "(dispatch budget %d rows/rank, %d group(s)): dispatches may run in several "
                    "admission rounds",
                    chunked_prefill_size,
                    self.sizing.safe_step_tokens,
                    self.sizing.budget,
                    self.sizing.attention_groups,
                )

    def observe(self, share: float | None) -> PrefillSizing | None:
        """Feeds one step's busiest-rank share; returns the new sizing when it changed."""
        mode = self.args[0]
        if mode != "observed" or share is None or self.sizing.budget is None:
            return None
        self._shares.append(share)
        worst = max(self._shares)
        new = size_prefill(*self.args, share=worst)
        if (new.step_tokens, new.chunk) == (self.sizing.step_tokens, self.sizing.chunk):
            self.sizing = new
            return None
        self.sizing = new
        logger.info(new.describe())
        return new
