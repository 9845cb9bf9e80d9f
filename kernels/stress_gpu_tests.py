"""Runs GPU tests many times in one process, each repetition on inputs of its own seed, and logs
every failure with the seed that reproduces it: the way to chase a test that fails once in a
while (a race, or a check at the edge of its tolerance).

    python kernels/stress_gpu_tests.py --reps 300 \
        tests/kernels/test_moe_align.py::test_gpu_align_matches_torch[500-60-16] ...

A test id names a test function and its parameters as pytest prints them; the parameters are
taken from the function's `pytest.mark.parametrize` marks (ids matched as pytest makes them), so
only the tests' own code runs. Before each repetition the tests' seed offset (`tests/seeds.py`,
what `SAFESERVE_TEST_SEED` sets for a pytest run) becomes the repetition's seed, and
`torch.manual_seed(seed)` seeds the global CPU and CUDA generators, so every repetition draws
inputs of its own. A failure reproduces under pytest with `SAFESERVE_TEST_SEED=<seed>`. One JSON
line per failure and a summary line.
Run several processes at once to add the load of a sharded suite.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import time
import traceback
from pathlib import Path


def _load(path: str):  # type: ignore[no-untyped-def]
    tests_dir = str(Path(path).resolve().parent)
    root = str(Path(tests_dir).parent)
    for d in (tests_dir, root, str(Path(root).parent)):
        if d not in sys.path:
            sys.path.insert(0, d)
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _param_id(value: object) -> str:
    if isinstance(value, (int, float, str, bool)) or value is None:
        return str(value)
    return repr(value)


def _cases(fn):  # type: ignore[no-untyped-def]
    """(pytest-style id, kwargs) of every parametrization of `fn`."""
    marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
    axes = []
    for m in marks:  # the innermost decorator first, as pytest names them
        names = [
            n.strip() for n in (m.args[0].split(",") if isinstance(m.args[0], str) else m.args[0])
        ]
        ids = m.kwargs.get("ids")
        options = []
        for i, value in enumerate(m.args[1]):
            values = value if len(names) > 1 else (value,)
            if callable(ids):
                label = ids(value)
            elif ids is not None:
                label = ids[i]
            else:
                label = "-".join(_param_id(v) for v in values)
            options.append((label, dict(zip(names, values, strict=True))))
        axes.append(options)
    for combo in itertools.product(*axes):
        yield (
            "-".join(label for label, _ in combo),
            {k: v for _, kw in combo for k, v in kw.items()},
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("tests", nargs="+", help="path::function[params] as pytest names them")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: never)")
    ns = p.parse_args()
    import torch

    runs = []
    for test in ns.tests:
        path, _, rest = test.partition("::")
        name, _, params = rest.partition("[")
        fn = getattr(_load(path), name)
        params = params.rstrip("]")
        matched = [kw for label, kw in _cases(fn) if label == params] if params else [{}]
        if not matched:
            raise SystemExit(f"{test}: no parametrization named {params!r}")
        runs.append((test, fn, matched[0]))
    import seeds  # tests/seeds.py, on the path once a test module is loaded

    start = time.monotonic()
    failures: dict[str, list[int]] = {t: [] for t, _, _ in runs}
    done = 0
    for rep in range(ns.reps):
        if ns.seconds and time.monotonic() - start > ns.seconds:
            break
        seed = ns.first_seed + rep
        for test, fn, kwargs in runs:
            seeds.OFFSET = seed
            torch.manual_seed(seed)
            try:
                fn(**kwargs)
            except Exception as e:  # noqa: BLE001 - every failure is logged with its seed
                failures[test].append(seed)
                tb = traceback.format_exc().strip().splitlines()[-6:]
                print(json.dumps({"test": test, "seed": seed, "error": repr(e)[:500], "tb": tb}),
                      flush=True)  # fmt: skip
        done = rep + 1
    print(json.dumps({"summary": True, "reps": done, "seconds": round(time.monotonic() - start, 1),
                      "failures": failures}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
