"""The GPUs the planner knows (`gpus.toml`, data shipped with the package), and the CPU."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources

CPU = "cpu"


class PlanError(ValueError):
    """Input the planner cannot plan for; the message is one line for the operator."""


@dataclass(frozen=True)
class Calibration:
    read_ceiling_gbs: float
    efficiency: float
    layer_us: float
    runtime_bytes: int
    source: str


@dataclass(frozen=True)
class Gpu:
    name: str
    description: str
    memory_bytes: int
    hbm_gbs: float
    nvlink_gbs: float
    scaleout_gbs: float
    bf16_tflops: float
    calibration: Calibration | None  # None: the CPU (no speed data)
    calibrated: bool  # False: the factors are another GPU's (`calibrated_from`)

    @property
    def is_cpu(self) -> bool:
        return self.name == CPU

    @property
    def ceiling_gbs(self) -> float:
        """The read ceiling a decode step is measured against."""
        return 0.0 if self.calibration is None else self.calibration.read_ceiling_gbs


def _table() -> dict:
    return tomllib.loads(resources.files("safeserve.plan").joinpath("gpus.toml").read_text())


def gpu_names() -> list[str]:
    return [*_table(), CPU]


def load_gpu(name: str) -> Gpu:
    """The GPU model `name` (case-insensitive), its calibration its own or scaled from the GPU
    it names; PlanError listing the known ones otherwise."""
    key = name.lower()
    if key == CPU:
        return Gpu(CPU, "CPU ranks (sizes only)", 0, 0.0, 0.0, 0.0, 0.0, None, False)
    table = _table()
    if key not in table:
        raise PlanError(f"--gpu {name!r} is not known; known: {', '.join(gpu_names())}")
    d = table[key]
    calibrated = "calibration" in d
    if calibrated:
        cal = Calibration(**d["calibration"])
    else:
        base_name = d["calibrated_from"]
        base = table[base_name]
        c = Calibration(**base["calibration"])
        scale = d["hbm_gbs"] / base["hbm_gbs"]
        cal = Calibration(
            c.read_ceiling_gbs * scale,
            c.efficiency,
            c.layer_us,
            c.runtime_bytes,
            f"uncalibrated: {base_name}'s factors, read ceiling scaled by datasheet bandwidth "
            f"({c.source})",
        )
    return Gpu(
        key,
        d["description"],
        int(d["memory_bytes"]),
        float(d["hbm_gbs"]),
        float(d["nvlink_gbs"]),
        float(d["scaleout_gbs"]),
        float(d["bf16_tflops"]),
        cal,
        calibrated,
    )
