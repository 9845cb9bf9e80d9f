from __future__ import annotations

import logging

from safeserve.guards.prefill_sizing import PrefillSizer, size_prefill


def test_worst_case_fits_every_group_on_one_rank() -> None:
    s = size_prefill(
        "worst",
        budget=1000,
        attention_groups=4,
        max_num_batched_tokens=2048,
        chunked_prefill_size=None,
    )
    assert s.safe_step_tokens == 250 and s.step_tokens == 250 and s.chunk == 250
    assert s.attention_groups * s.step_tokens <= s.budget


def test_explicit_chunk_above_safe_warns_once_and_is_honoured(caplog) -> None:
    with caplog.at_level(logging.INFO):
        sizer = PrefillSizer("worst", 100, 4, 2048, chunked_prefill_size=512)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    infos = [
        r for r in caplog.records if r.levelno == logging.INFO and "prefill sizing" in r.message
    ]
    assert len(warnings) == 1 and "above the safe size 25" in warnings[0].message
    assert len(infos) == 1 and "safe step 25" in infos[0].message
    assert sizer.sizing.chunk == 512 and sizer.sizing.step_tokens == 512


def test_observed_follows_the_worst_recent_share() -> None:
    sizer = PrefillSizer("observed", 1000, 2, 4096, None)
    assert sizer.sizing.step_tokens == 500  # no observation yet: as the worst case
    changed = sizer.observe(0.5)
    assert changed is not None and changed.step_tokens == 1000
    assert sizer.observe(0.5) is None
    assert sizer.observe(1.0).step_tokens == 500  # worse routing seen: back down
    worst = PrefillSizer("worst", 1000, 2, 4096, None)
    assert worst.observe(0.1) is None


def test_admission_off_keeps_flags() -> None:
    s = size_prefill("worst", None, 2, 2048, 300)
    assert s.step_tokens == 2048 and s.chunk == 300
