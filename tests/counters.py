"""A check the kernel tests share: arrival counters left as they were found."""

from __future__ import annotations

from safeserve.kernels import common


def assert_counters_zero() -> None:
    """Every kernel that counts arrivals (`common.zeroed_counters`) leaves its counters zero."""
    for key, buf in common.ZEROED_COUNTERS.items():
        assert int(buf.count_nonzero()) == 0, f"counters {key} left non-zero"
