"""Computations that pause while a collective is in flight, and the two-batch schedule.

A forward pass written as a generator (`Steps`) yields right after it has issued an asynchronous
collective and resumes when it needs the result. Run alone (`drive`) a yield costs nothing; two
micro-batches run by `interleave` take turns at every yield, so one computes (attention, router,
experts) while the other's dispatch or combine moves. The turns are a fixed function of the
code, never of timing: every rank of a group issues its collectives in the same order, which
gloo and NCCL need to pair them.

A computation also yields a layer index as it is about to compute that layer's attention.
`interleave` lets the second micro-batch past layer k only once the first has computed layer
k's attention (a sequence cut across the two finds its first piece's keys and values of layer k
in the cache), even where the first takes more turns in a layer (more admission rounds).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TypeVar

T = TypeVar("T")

# A computation that yields None where it waits on a collective, a layer index where it starts
# that layer, and returns a T.
Steps = Generator[int | None, None, T]


def drive(steps: Steps[T]) -> T:
    """Runs `steps` to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def bound(steps: Steps[T], enter: Callable[[], None]) -> Steps[T]:
    """`steps` with `enter()` called before each of its turns (a micro-batch's context: the
    dispatcher state it uses, set again each time it resumes)."""
    while True:
        enter()
        try:
            mark = next(steps)
        except StopIteration as stop:
            return stop.value
        yield mark


def interleave(first: Steps[T], second: Steps[T]) -> tuple[T, T]:
    """Runs two computations to their ends, taking turns (first, second, first, ...) at every
    yield of None; a layer mark does not end a turn, except that the second stops at a layer
    mark until the first has gone past the same mark. One that has ended leaves its turns to
    the other. Their results, in order.

    So one micro-batch's attention of layer k+1 runs while the other's combine of layer k
    moves, and its dispatch moves while the other computes attention."""
    steps = (first, second)
    live = [True, True]
    results: list[T | None] = [None, None]
    first_started = 0  # layer marks the first has gone past
    parked: int | None = None  # the layer mark the second waits at

    def advance(i: int) -> None:
        nonlocal first_started, parked
        while True:
            if i == 1 and parked is not None:
                if live[0] and first_started <= parked:
                    return
                parked = None
            try:
                mark = next(steps[i])
            except StopIteration as stop:
                results[i] = stop.value
                live[i] = False
                return
            if mark is None:
                return
            if i == 0:
                first_started = mark + 1  # resumed at once: it computes layer `mark` now
            else:
                parked = mark

    while live[0] or live[1]:
        if live[0]:
            advance(0)
        if live[1]:
            advance(1)
    return results[0], results[1]  # type: ignore[return-value]
