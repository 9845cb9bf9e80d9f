"""safeserve.spawn on real processes: a gloo group's all_reduce, a rank that raises or dies
named with its traceback or exit code, and no process left behind either way."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import psutil
import pytest

from safeserve.spawn import RankFailed, rendezvous_dir, run_ranks, spawn_ranks


def _all_reduce(rank: int, world: int, init: str, base: int) -> tuple[int, list[int], int]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    x = torch.tensor([base + rank, 1])
    dist.all_reduce(x)
    dist.destroy_process_group()
    return rank, x.tolist(), os.getpid()


def _raise_on(rank: int, world: int, init: str, culprit: int) -> None:
    if rank == culprit:
        raise ValueError(f"boom on rank {rank}")
    time.sleep(120)  # the others wait, as ranks in a collective with a dead peer do


def _die_on(rank: int, world: int, init: str, culprit: int, how: str) -> None:
    if rank == culprit:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


def _report_then(rank: int, queue: mp.Queue, fail: bool) -> None:
    queue.put(("pid", rank, os.getpid()))
    if fail and rank == 1:
        time.sleep(0.5)
        raise RuntimeError("rank one gave up")
    queue.put(("done", rank, None))
    time.sleep(120 if fail else 0)


def _say(rank: int, world: int, init: str) -> None:
    print(f"rank {rank} of {world} says hello")  # no flush: the launcher's exit must do it


def _gone(pids: list[int]) -> bool:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return not alive and not mp.active_children()


def test_run_ranks_returns_every_ranks_all_reduce_in_rank_order() -> None:
    out = run_ranks(_all_reduce, 3, (10,), timeout=120)
    assert [r for r, _, _ in out] == [0, 1, 2]
    assert all(x == [10 + 11 + 12, 3] for _, x, _ in out)
    pids = [pid for *_, pid in out]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert _gone(pids)


def test_a_rank_that_raises_is_named_with_its_traceback_and_the_rest_are_stopped() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as err:
        run_ranks(_raise_on, 3, (2,), timeout=120)
    assert err.value.rank == 2
    assert str(err.value).startswith("rank 2 failed:\nTraceback")
    assert "ValueError: boom on rank 2" in str(err.value)
    assert time.monotonic() - t0 < 60  # the sleeping ranks were killed, not waited for
    assert not mp.active_children()


@pytest.mark.parametrize(
    "how,said", [("exit", "exited with code 3"), ("kill", "was killed by SIGKILL")]
)
def test_a_rank_that_dies_without_a_word_is_named_with_how_it_ended(how: str, said: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as err:
        run_ranks(_die_on, 2, (1, how), timeout=120)
    assert err.value.rank == 1 and said in str(err.value)
    assert time.monotonic() - t0 < 60
    assert not mp.active_children()


def test_spawn_ranks_streams_messages_and_stops_every_process() -> None:
    pids = []
    with spawn_ranks(2, _report_then, lambda r, init, q: (r, q, False)) as ranks:
        assert ranks.world == 2 and ranks.init.startswith("file:///")  # a store of its own
        store_dir = rendezvous_dir(ranks.init)
        got = [ranks.get(timeout=60) for _ in range(4)]
    pids = [c for kind, _, c in got if kind == "pid"]
    assert sorted((k, r) for k, r, _ in got) == [("done", 0), ("done", 1), ("pid", 0), ("pid", 1)]
    assert _gone(pids)
    assert store_dir is not None and not os.path.exists(store_dir)  # removed on the way out


def test_spawn_ranks_raises_a_ranks_failure_and_kills_the_others() -> None:
    pids = []
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="RuntimeError: rank one gave up") as err:
        with spawn_ranks(2, _report_then, lambda r, init, q: (r, q, True)) as ranks:
            while True:
                kind, _, value = ranks.get(timeout=60)
                if kind == "pid":
                    pids.append(value)
    assert err.value.rank == 1 and len(pids) == 2
    assert time.monotonic() - t0 < 60
    assert _gone(pids)


def test_a_silent_group_times_out_and_is_stopped() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no word from the ranks in 1.5 s"):
        run_ranks(_raise_on, 2, (-1,), timeout=1.5)
    assert time.monotonic() - t0 < 60
    assert not mp.active_children()


def test_what_a_rank_prints_is_not_lost(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # the ranks' stdout block-buffered
    assert run_ranks(_say, 2, timeout=60) == [None, None]
    out = capfd.readouterr().out
    assert "rank 0 of 2 says hello" in out and "rank 1 of 2 says hello" in out
