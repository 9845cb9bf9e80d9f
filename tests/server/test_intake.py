"""Intake's sampling seed: --enable-deterministic-inference gives a request without a seed one
at the frontend (its continuation after a migration then samples as the first group would
have); a request's own seed, and the default mode, are left as they are."""

from __future__ import annotations

from types import SimpleNamespace

from safeserve.config import ServerArgs
from safeserve.server.intake import _seed


def test_deterministic_mode_seeds_unseeded_requests() -> None:
    on = SimpleNamespace(args=ServerArgs(enable_deterministic_inference=True))
    off = SimpleNamespace(args=ServerArgs())
    drawn = {_seed(on, None) for _ in range(50)}  # type: ignore[arg-type]
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in drawn)
    assert len(drawn) == 50  # one per request, not one for all
    assert _seed(on, -7) == -7  # type: ignore[arg-type]
    assert _seed(off, None) is None  # type: ignore[arg-type]
    assert _seed(off, 3) == 3  # type: ignore[arg-type]
