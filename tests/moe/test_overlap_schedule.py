"""The two-batch schedule (`parallel/schedule.py`) and the receive-buffer halves it dispatches
into: turns alternate at every wait, the second micro-batch never starts a layer's attention
before the first has computed it (however many waits each takes in a layer), results come
back in order; the halves are disjoint views with half the budget each."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from safeserve.guards.admission import DispatchBuffers
from safeserve.parallel.schedule import bound, drive, interleave


def _micro_batch(name: str, waits: list[int], log: list[tuple[str, str, int]]):  # type: ignore[no-untyped-def]
    """A fake forward pass: per layer, a layer mark, its attention, then `waits[layer]` waits
    (admission rounds differ between micro-batches); logs what it computes."""
    for layer, n in enumerate(waits):
        yield layer
        log.append((name, "attention", layer))
        for _ in range(n):
            log.append((name, "issue", layer))
            yield None
    return name


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=6),
)
def test_second_never_overtakes_the_first_at_a_layer(waits: list[tuple[int, int]]) -> None:
    log: list[tuple[str, str, int]] = []
    a = _micro_batch("a", [w for w, _ in waits], log)
    b = _micro_batch("b", [w for _, w in waits], log)
    assert interleave(a, b) == ("a", "b")
    order = [(who, layer) for who, what, layer in log if what == "attention"]
    assert sorted(order) == sorted(
        [("a", i) for i in range(len(waits))] + [("b", i) for i in range(len(waits))]
    )
    for layer in range(len(waits)):
        assert order.index(("a", layer)) < order.index(("b", layer))


def test_turns_alternate_at_every_wait() -> None:
    log: list[tuple[str, str, int]] = []
    interleave(_micro_batch("a", [2, 2], log), _micro_batch("b", [2, 2], log))
    # a's attention, its first transfer in flight while b computes its attention, and so on:
    # each wait hands the turn over
    assert [(w, what) for w, what, _ in log] == [
        ("a", "attention"),
        ("a", "issue"),
        ("b", "attention"),
        ("b", "issue"),
        ("a", "issue"),
        ("b", "issue"),
        ("a", "attention"),
        ("a", "issue"),
        ("b", "attention"),
        ("b", "issue"),
        ("a", "issue"),
        ("b", "issue"),
    ]


def test_drive_and_bound() -> None:
    log: list[tuple[str, str, int]] = []
    entered: list[str] = []
    steps = bound(_micro_batch("a", [1, 3], log), lambda: entered.append("a"))
    assert drive(steps) == "a"
    # entered before each of its turns: the start, then after each of its 1 + 3 waits (layer
    # marks do not end a turn when driven alone either: drive resumes at once)
    assert len(entered) == 1 + 2 + 4


def test_buffer_halves_are_disjoint_views_with_half_the_budget() -> None:
    full = DispatchBuffers.allocate(9, 8, 6, 2, torch.float32, torch.device("cpu"))
    a, b = full.halves()
    assert a.max_recv_tokens == b.max_recv_tokens == 4
    assert a.hidden.data_ptr() == full.hidden.data_ptr()
    assert b.hidden.data_ptr() == full.hidden[4:].data_ptr()
    assert a.stats is b.stats is full.stats
    a.hidden.fill_(1.0)
    b.hidden.fill_(2.0)
    assert full.hidden[:4].eq(1).all() and full.hidden[4:8].eq(2).all()
    b.record_round(4)
    with pytest.raises(RuntimeError, match="admission violated"):
        a.record_round(5)
    assert full.stats.rounds_total == 1
    with pytest.raises(ValueError):
        DispatchBuffers.allocate(1, 8, 6, 2, torch.float32, torch.device("cpu")).halves()
