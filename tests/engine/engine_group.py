"""A whole multi-rank group in spawned processes (gloo): rank 0 runs the Engine on scripted
requests, the others `follower_loop`, as rank_worker does; rank 0 reports every output."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path

from layouts import LAYOUTS, _group


def _rank_main(
    model: str,
    layout: tuple,
    rank: int,
    init: str,
    requests: list[tuple[str, list[int], object]],
    engine_kw: dict,
    queue: mp.Queue,
) -> None:
    try:
        from safeserve.config import ServerArgs
        from safeserve.engine.engine import Engine, follower_loop
        from safeserve.engine.model_runner import ModelRunner

        tp, ep, backend, dp = layout
        args = ServerArgs(
            model=model,
            tp_size=tp,
            ep_size=ep,
            moe_a2a_backend=backend,
            enable_dp_attention=dp,
            **engine_kw,
        )
        runner = ModelRunner(args, rank, init)
        if rank != 0:
            follower_loop(runner, lambda step, idle: None)
            queue.put(("done", rank, None))
            return
        engine = Engine(args, runner)
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)  # type: ignore[arg-type]
        outputs = []
        while engine.has_work():
            outputs.extend(engine.step())
        engine.broadcast_idle()  # the followers are still alive and in step
        engine.shutdown()
        queue.put(("outputs", rank, outputs))
        queue.put(("done", rank, None))
    except Exception:
        queue.put(("error", rank, traceback.format_exc()))


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
    outputs, done = None, 0
    with _group(
        layout[0],
        port,
        _rank_main,
        lambda r, init, q: (str(model), layout, r, init, requests, engine_kw, q),
    ) as queue:
        while done < layout[0]:
            kind, rank, payload = queue.get(timeout=240)
            if kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            if kind == "outputs":
                outputs = payload
            else:
                done += 1
    assert outputs is not None
    return outputs
