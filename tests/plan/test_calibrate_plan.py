"""kernels/calibrate_plan.py, the calibration docs/plan.md describes: on the recorded H200 runs it
gives the calibration shipped in gpus.toml, and it writes a new GPU's calibration where the GPU
borrowed another's."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tomllib
from dataclasses import asdict
from pathlib import Path

import pytest

from safeserve.plan import gpus

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "kernels" / "results"
BENCH = RESULTS / "plan_bench_qwen3_h200_2026-12-02_run18_call1.json"
SERVE_LOG = RESULTS / "plan_serve_qwen3-30b-a3b_h200_2026-12-02_run18_call3.log"


@pytest.fixture(scope="module")
def calibrate():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "calibrate_plan", ROOT / "kernels" / "calibrate_plan.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_recorded_runs_give_the_shipped_h200_calibration(
    calibrate, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    monkeypatch.chdir(ROOT)  # the runs name their models relative to the repository root
    cal = calibrate.fit(json.loads(BENCH.read_text()), str(SERVE_LOG), str(BENCH))
    shipped = gpus.load_gpu("h200").calibration
    assert cal == shipped
    # runtime_bytes: total - weights - free of the server's KV-sizing line
    assert cal.runtime_bytes == 150_109_880_320 - 61_064_245_248 - 88_192_712_704


def test_write_gives_a_borrowing_gpu_its_own_calibration(
    calibrate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gpus.toml"
    shutil.copy(ROOT / "safeserve" / "plan" / "gpus.toml", path)
    before = tomllib.loads(path.read_text())
    # h200's own calibration written again: the file does not change
    calibrate.write_calibration("h200", gpus.load_gpu("h200").calibration, None, path)
    assert path.read_text() == (ROOT / "safeserve" / "plan" / "gpus.toml").read_text()

    cal = gpus.Calibration(3000.0, 0.95, 30.0, 700_000_000, "h100 bench")
    calibrate.write_calibration("h100", cal, 85_000_000_000, path)
    after = tomllib.loads(path.read_text())
    assert after["h100"]["calibration"] == asdict(cal)
    assert "calibrated_from" not in after["h100"]
    assert after["h100"]["memory_bytes"] == 85_000_000_000
    for name in before:  # every other GPU as it was
        if name != "h100":
            assert after[name] == before[name], name

    monkeypatch.setattr(gpus, "_table", lambda: tomllib.loads(path.read_text()))
    h100 = gpus.load_gpu("h100")
    assert h100.calibrated and h100.calibration == cal
    assert not gpus.load_gpu("a100").calibrated  # still borrowing h200's

    with pytest.raises(SystemExit, match=r"no \[tpu\] table"):
        calibrate.write_calibration("tpu", cal, None, path)
