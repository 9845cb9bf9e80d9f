"""A whole multi-rank group in spawned processes (gloo): rank 0 runs the Engine on scripted
requests, the others `follower_loop`, as rank_worker does; rank 0 reports every output."""

from __future__ import annotations

from pathlib import Path

from layouts import LAYOUTS, layout_server_args

from safeserve.spawn import run_ranks


def _rank_main(
    rank: int,
    world: int,
    init: str,
    model: str,
    layout: tuple,
    requests: list[tuple[str, list[int], object]],
    engine_kw: dict,
) -> list | None:
    """One rank: rank 0's outputs, None from a follower (once the leader let it go)."""
    from safeserve.engine.engine import Engine, follower_loop
    from safeserve.engine.model_runner import ModelRunner

    args = layout_server_args(model, layout, **engine_kw)
    runner = ModelRunner(args, rank, init)
    if rank != 0:
        follower_loop(runner, lambda step, idle: None)
        return None
    engine = Engine(args, runner)
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)  # type: ignore[arg-type]
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    engine.broadcast_idle()  # the followers are still alive and in step
    engine.shutdown()
    return outputs


def run_engine_group(
    model: Path,
    name: str,
    requests: list[tuple[str, list[int], object]],
    port: int,
    **engine_kw: object,
) -> list:
    """Rank 0's RequestOutputs, in order, from a real group of layout `name` (tests/layouts.py)
    serving `requests` ((rid, prompt ids, SamplingParams)) until done; every rank must end in
    order (a follower that died would fail the shutdown)."""
    layout = LAYOUTS[name]
    args = (str(model), layout, requests, engine_kw)
    outputs = run_ranks(_rank_main, layout[0], args, port=port, timeout=240)[0]
    assert outputs is not None
    return outputs
