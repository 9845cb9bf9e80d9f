"""A rank process's runner freezes what start-up built out of the garbage collector when serving
begins (a full collection while serving then scans only what serving allocates); a runner built
in a longer-lived process (a test, a benchmark) does not, or its cycles would never be freed."""

from __future__ import annotations

import gc

from safeserve.config import ServerArgs
from safeserve.engine.model_runner import ModelRunner


def test_only_a_rank_processs_runner_freezes_start_up_objects() -> None:
    args = ServerArgs(model="tiny", num_kv_blocks=64)
    before = gc.get_freeze_count()
    plain = ModelRunner(args, 0, None)
    plain.begin_serving()
    assert gc.get_freeze_count() == before
    rank = ModelRunner(args, 0, None)
    rank.freeze_gc_on_serving = True  # as safeserve.engine.rank_worker sets it
    try:
        rank.begin_serving()
        assert gc.get_freeze_count() > before
        assert rank.serving
    finally:
        gc.unfreeze()
