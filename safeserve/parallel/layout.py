"""Who a rank is in its group: tensor-, expert- and attention-data-parallel positions.

No torch here: the frontend checks layouts before any rank starts (and without importing torch).
`safeserve.parallel.comm` holds the collectives.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Who this rank is in its group; the same numbers on every rank but `rank`."""

    rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    dp_attention: bool = False

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    @property
    def attn_tp_size(self) -> int:
        """Ranks that split one attention computation (1 with attention data-parallel)."""
        return 1 if self.dp_attention else self.tp_size

    @property
    def attn_tp_rank(self) -> int:
        return 0 if self.dp_attention else self.rank

    @property
    def dp_size(self) -> int:
        """Independent attention groups: each holds its own requests and KV cache."""
        return self.tp_size if self.dp_attention else 1
