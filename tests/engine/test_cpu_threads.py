"""A CPU rank's torch threads split the machine's cores among the ranks that run on it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from safeserve.config import ServerArgs
from safeserve.engine.rank_worker import cpu_threads


@pytest.mark.parametrize(
    "cores,flags,want",
    [
        (2, {}, 2),  # one one-rank group: every core
        (2, {"num_groups": 2}, 1),  # two groups share two cores
        (16, {"num_groups": 2, "tp_size": 2}, 4),
        (2, {"num_groups": 4}, 1),  # never below one
    ],
)
def test_cpu_threads_split_the_cores_among_the_ranks_here(cores, flags, want) -> None:  # type: ignore[no-untyped-def]
    assert cpu_threads(ServerArgs(**flags), cores) == want


def test_a_node_agents_rank_counts_its_groups_ranks_only() -> None:
    # remote placement (a node agent's host): the fields cpu_threads reads, as ServerArgs has
    # them; a full remote ServerArgs needs node flags unrelated to this
    args = SimpleNamespace(num_groups=4, tp_size=2, placement="remote")
    assert cpu_threads(args, 16) == 8  # type: ignore[arg-type]
