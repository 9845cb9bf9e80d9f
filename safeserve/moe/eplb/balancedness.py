"""How evenly a group's expert-parallel ranks share the routed work.

Per forward pass and MoE layer l, `load[l][g]` = routed (token, expert) pairs that rank g's
experts compute. A layer's balancedness is `(mean_g load + 1e-5) / (max_g load + 1e-5)`, in
(0, 1], 1 when every rank gets the same work and 1/G when one of G ranks gets it all; a pass's
balancedness is the mean over its MoE layers (the peer EPLB's definition).
Exported as `safeserve:eplb_balancedness`, the mean over the last 10, 100 and 1000 passes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from safeserve.messages import RankStats

WINDOWS = (10, 100, 1000)
_EPS = 1e-5


def layer_balancedness(loads: Sequence[float]) -> float:
    """(mean + 1e-5) / (max + 1e-5) of one layer's per-rank loads."""
    if not loads:
        raise ValueError("no ranks")
    return (sum(loads) / len(loads) + _EPS) / (max(loads) + _EPS)


class BalancednessRecorder:
    """Collects one pass's per-layer loads; keeps the balancedness of the last 1000 passes."""

    def __init__(self) -> None:
        self._layers: list[float] = []
        self._passes: deque[float] = deque(maxlen=max(WINDOWS))
        self.total = 0  # passes recorded since the last clear (not capped)

    def record_layer(self, loads: Sequence[float]) -> None:
        self._layers.append(layer_balancedness(loads))

    def end_pass(self) -> float | None:
        """Closes the pass; its balancedness, or None when it ran no MoE layer (not counted)."""
        if not self._layers:
            return None
        value = sum(self._layers) / len(self._layers)
        self._layers = []
        self._passes.append(value)
        self.total += 1
        return value

    def clear(self) -> None:
        """Forgets every pass (start-up's warm-up passes are not traffic)."""
        self._layers = []
        self._passes.clear()
        self.total = 0

    @property
    def passes(self) -> int:
        return len(self._passes)

    def mean_of_last(self, n: int) -> float | None:
        """Mean balancedness of the last `n` passes (of the last 1000 at most); None: none."""
        recent = list(self._passes)[-n:] if n > 0 else []
        return sum(recent) / len(recent) if recent else None

    def window_means(self) -> dict[int, float]:
        """Mean balancedness over the last w passes (fewer while fewer have run), per window."""
        if not self._passes:
            return {}
        recent = list(self._passes)
        return {w: sum(recent[-w:]) / len(recent[-w:]) for w in WINDOWS}


def group_balancedness(rank_stats: Sequence[RankStats]) -> dict[int, float]:
    """A group's balancedness per window, from its ranks' heartbeat stats (lowest rank first).

    Every rank of a group records the same values; the first rank that has them speaks.
    """
    for stats in rank_stats:
        found = {w: stats.balancedness[w] for w in WINDOWS if w in stats.balancedness}
        if found:
            return found
    return {}
