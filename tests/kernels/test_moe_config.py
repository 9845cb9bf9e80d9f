"""Fused MoE tile configs (`safeserve.kernels.moe_config`): the table lookup, the shipped
tables, refusal of bad tables and overrides, and the float32 fit. Pure python, on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from safeserve.kernels import moe_config as mc
from safeserve.kernels.fused_moe_fp8 import FP8_TABLE_PREFIX as FP8_PREFIX
from safeserve.kernels.fused_moe_fp8 import load_fp8_table


def test_config_lookup_nearest(tmp_path: Path) -> None:
    table = {
        "1": mc.default_config(1, 128, 8),
        "64": mc.default_config(64, 128, 8),
        "4096": mc.default_config(4096, 128, 8),
    }
    table["64"]["tuned_us"] = 64.0  # marks the entry
    name = mc.config_file_name(128, 2048, 768, "NVIDIA H200")
    assert name == "E128_H2048_I768_NVIDIA_H200.json"
    (tmp_path / name).write_text(json.dumps({"meta": {}, "configs": table}))
    cfg = mc.get_config(50, 128, 2048, 768, 8, device_name="NVIDIA H200", config_dir=tmp_path)
    assert cfg["tuned_us"] == 64.0
    assert mc.get_config(3000, 128, 2048, 768, 8, "NVIDIA H200", tmp_path)["BLOCK_M"] == 128
    # no file for this shape -> heuristic default
    other = mc.get_config(50, 60, 2048, 768, 8, device_name="NVIDIA H200", config_dir=tmp_path)
    assert other == mc.default_config(50, 60, 8)


def _bf16_tables() -> list[Path]:
    """The shipped fused-MoE tables (the block-FP8 ones, named with their scheme first, hold
    the FP8 kernel's entries)."""
    return [p for p in sorted(mc.CONFIG_DIR.glob("*.json")) if not p.name.startswith(FP8_PREFIX)]


def test_shipped_config_files_are_valid() -> None:
    files = _bf16_tables()
    assert files
    for path in files:
        table = mc.load_config_table(str(path))  # validates every entry
        assert table, path
    fp8 = sorted(mc.CONFIG_DIR.glob(f"{FP8_PREFIX}*.json"))
    assert fp8
    for path in fp8:
        assert load_fp8_table(str(path)), path  # validates every entry
    sweeps = Path(__file__).resolve().parents[2] / "kernels" / "configs"
    for path in sorted(sweeps.glob("sweep_*.json")):
        for i, cfg in enumerate(json.loads(path.read_text())):
            mc.check_config(cfg, f"{path.name}[{i}]")


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c["gemm2"].update(splt=4), r"gemm2: unknown keys \['splt'\]"),
        (lambda c: c.update(pdl="yes"), "pdl 'yes'"),
        (lambda c: c["gemm1"].update(BLOCK_N=48), "gemm1.BLOCK_N 48"),
        (lambda c: c.update(mode="gemv"), "mode 'gemv'"),
        (lambda c: c["gemm1"].update(num_warps=3), "gemm1.num_warps 3"),
        (lambda c: c.pop("gemm2"), "gemm2 is missing"),
        (lambda c: c["gemm1"].update(slice=0), "gemm1.slice 0 is not a positive integer"),
    ],
)
def test_bad_config_table_is_refused_naming_the_entry(tmp_path: Path, edit, message) -> None:
    table = {"1": mc.default_config(1, 128, 8), "64": mc.default_config(64, 128, 8)}
    edit(table["64"])
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"configs": table}))
    with pytest.raises(mc.ConfigTableError, match=f"table.json, 64 tokens: {message}"):
        mc.load_config_table(str(path))


def test_override_table_must_exist_and_be_a_table(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SAFESERVE_FUSED_MOE_CONFIG", str(tmp_path / "missing.json"))
    with pytest.raises(mc.ConfigTableError, match="no such file"):
        mc.check_override_table()
    (tmp_path / "empty.json").write_text("{}")
    monkeypatch.setenv("SAFESERVE_FUSED_MOE_CONFIG", str(tmp_path / "empty.json"))
    with pytest.raises(mc.ConfigTableError, match="empty"):
        mc.check_override_table()
    (tmp_path / "junk.json").write_text("[1, 2]")
    monkeypatch.setenv("SAFESERVE_FUSED_MOE_CONFIG", str(tmp_path / "junk.json"))
    with pytest.raises(mc.ConfigTableError, match="not a token-count"):
        mc.check_override_table()


def test_a_device_without_a_table_takes_one_of_its_compute_capability(tmp_path: Path) -> None:
    """An H100 (no table of its own) takes the tiles tuned on an H200 (same SMs, compute
    capability 9.0); an A100 (8.0) and a device of unknown capability get the heuristic; the
    device's own table, then SAFESERVE_FUSED_MOE_CONFIG, still come first."""
    entry = {**mc.default_config(4096, 64, 4), "tuned_us": 1.0}
    (tmp_path / mc.config_file_name(64, 512, 256, "NVIDIA H200")).write_text(
        json.dumps(
            {"meta": {"device": "NVIDIA H200", "capability": "9.0"}, "configs": {"8": entry}}
        )
    )
    other = {**mc.default_config(8, 64, 4), "tuned_us": 2.0}  # another shape: never taken
    (tmp_path / mc.config_file_name(64, 512, 128, "NVIDIA H200")).write_text(
        json.dumps({"meta": {"capability": "9.0"}, "configs": {"8": other}})
    )
    args = (8, 64, 512, 256, 4)
    h100 = mc.get_config(*args, "NVIDIA H100 80GB HBM3", tmp_path, capability="9.0")
    assert h100 == entry
    assert mc.get_config(*args, "NVIDIA A100-SXM4-80GB", tmp_path, "8.0") == mc.default_config(
        8, 64, 4
    )
    assert mc.get_config(*args, "NVIDIA H100 PCIe", tmp_path) == mc.default_config(8, 64, 4)
    assert mc.get_config(8, 64, 512, 512, 4, "NVIDIA H100", tmp_path, "9.0") == mc.default_config(
        8, 64, 4
    )
    own = {**entry, "tuned_us": 3.0}
    (tmp_path / mc.config_file_name(64, 512, 256, "NVIDIA H100 PCIe")).write_text(
        json.dumps({"configs": {"8": own}})
    )
    mc.load_config_table.cache_clear()  # lookups are cached per path, the missing file's too
    assert mc.get_config(*args, "NVIDIA H100 PCIe", tmp_path, "9.0") == own


def test_shipped_tables_say_their_compute_capability() -> None:
    for path in sorted(mc.CONFIG_DIR.glob("*.json")):
        meta = json.loads(path.read_text())["meta"]
        major, minor = meta["capability"].split(".")
        assert major.isdigit() and minor.isdigit(), path


def test_fit_config_fits_every_device_class() -> None:
    """Every shipped entry and every heuristic config, in 2- and 4-byte types, fits the shared
    memory of an H100/H200 (227 KiB), an A100 (163 KiB) and an L40S/RTX 4090/RTX 5090 (99 KiB)
    once fitted; where it already fit, it is unchanged. (tests/kernels/gpu_compile.py compiles
    them for those targets and checks what Triton allocates.)"""
    configs = [mc.default_config(t, e, 8) for t in (1, 4, 8, 64, 512, 2048, 4096) for e in (8, 128)]
    for path in _bf16_tables():
        configs += list(mc.load_config_table(str(path)).values())
    for shared in (227 * 1024, 163 * 1024, 99 * 1024):
        budget = mc.smem_budget(shared)
        for cfg in configs:
            for elem in (2, 4):
                fitted = mc.fit_config(cfg, elem, 8, budget)
                assert mc.tiles_bytes(fitted, elem) <= budget, (shared, elem, cfg, fitted)
                if mc.tiles_bytes({**cfg, "BLOCK_M": fitted["BLOCK_M"]}, elem) <= budget:
                    assert fitted["gemm1"] == cfg["gemm1"] and fitted["gemm2"] == cfg["gemm2"]
    assert mc.smem_budget(227 * 1024) == mc.SMEM_BUDGET  # the H100/H200 budget as tuned


def test_fit_config_shrinks_for_fp32() -> None:
    cfg = {
        "mode": "sorted",
        "BLOCK_M": 128,
        "gemm1": mc.kcfg(128, 128, 8, 8, 5),
        "gemm2": mc.kcfg(256, 128, 8, 8, 5),
    }
    small = mc.fit_config(cfg, 4, 8)
    for name, n_b in (("gemm1", 2), ("gemm2", 1)):
        k = small[name]
        per_stage = (128 * k["BLOCK_K"] + n_b * k["BLOCK_K"] * k["BLOCK_N"]) * 4
        assert per_stage * k["num_stages"] <= mc.SMEM_BUDGET
    assert cfg["gemm1"]["num_stages"] == 5  # the input is not modified


def test_invariant_config_is_one_sorted_plan_for_every_shape() -> None:
    """--enable-deterministic-inference: the sorted plan (the only one whose token sums do not
    change with the count) for every shipped table and for an untuned shape."""
    for path in sorted(mc.CONFIG_DIR.glob("*_NVIDIA_H200.json")):
        shape = json.loads(path.read_text())["meta"]["shape"]
        cfg = mc.invariant_config(shape["E"], shape["H"], shape["I"], shape.get("top_k", 8))
        assert cfg["mode"] == "sorted", path.name
    assert mc.invariant_config(6, 40, 24, 2)["mode"] == "sorted"
