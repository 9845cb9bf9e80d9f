"""What the multi-GPU benchmark scripts (bench_dispatch.py, bench_admission.py,
bench_tp_decode.py) share: the flags each takes, one process per rank (safeserve.spawn: a
failing rank ends the run with its traceback, no process left behind), the rank's device, the
timing loop and the JSON file. `--device cpu` runs a script on gloo ranks with the host clock:
a smoke run (tests/test_bench.py), its numbers no measurement."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safeserve.spawn import RankFailed, run_ranks  # noqa: E402


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The script's flags: its docstring as the help, and `--device`, `--json`."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (gloo, the host clock)")
    p.add_argument("--json", type=Path, help="write the results here")
    return p


def need_gpus(device: str, world: int) -> None:
    """Exits with one line when a CUDA run wants more GPUs than there are."""
    if device == "cuda" and torch.cuda.device_count() < world:
        sys.exit(f"needs {world} GPUs, found {torch.cuda.device_count()}")


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "CPU"


def rank_device(rank: int, device: str) -> torch.device:
    """A rank's device: its own GPU (made current), or the CPU."""
    if device != "cuda":
        return torch.device("cpu")
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    return dev


def run(worker: Callable[..., object], world: int, args: Sequence[object], timeout: float) -> list:
    """worker(rank, world, init, *args) on `world` ranks: what each returns, by rank. A rank
    that fails (or none reporting for `timeout` s) ends the script with why."""
    try:
        return run_ranks(worker, world, args, timeout=timeout, stop_s=30.0)
    except (RankFailed, TimeoutError) as e:
        sys.exit(str(e))


def times(
    fn: Callable[[], object],
    iters: int,
    device: torch.device,
    warmup: int = 0,
    barrier: bool = False,
) -> list[float]:
    """Seconds of each of `iters` calls of fn, after `warmup` untimed ones: CUDA events around
    each call on a GPU (its device time), the host clock on the CPU. With `barrier` the ranks
    enter every timed call together."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        if barrier:
            dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def write_json(path: Path | None, results: object, indent: int = 1) -> None:
    """The results as JSON at `path` (nothing without one)."""
    if path is not None:
        path.write_text(json.dumps(results, indent=indent))
