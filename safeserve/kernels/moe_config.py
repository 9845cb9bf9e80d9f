"""Tile configs of the fused MoE kernels: the tuned tables (data in configs/), the heuristic for
untuned shapes, and the fitting of a config to shared memory and element size.

A table ``configs/E{E}_H{H}_I{I}_{device}.json`` maps a token count to a config (the launch plan,
``"mode"``, and the tiles of each GEMM); the entry of the nearest token count is used.
``SAFESERVE_FUSED_MOE_CONFIG`` names a table to use instead.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

from safeserve.kernels.common import HAS_TRITON

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

Config = dict[str, Any]

# Shared memory the pipelined tiles may take: H100/H200 allow 227 KiB per program, and Triton
# keeps up to num_stages tiles of A and B there (num_stages - 1 on the mma.sync path).
SMEM_BUDGET = 220 * 1024


def default_config(num_tokens: int, num_experts: int, top_k: int) -> Config:
    """Heuristic config for shapes nobody tuned: by mean rows per expert."""
    pairs = max(1, num_tokens * top_k)
    per_expert = pairs / max(1, num_experts)
    if num_tokens <= 4:
        return {
            "mode": "pair",
            "BLOCK_M": 16,
            "gemm1": kcfg(32, 256, 1, 4, 4),
            "gemm2": kcfg(32, 256, 1, 4, 4),
        }
    if per_expert <= 16:
        bm, g1, g2 = 16, kcfg(64, 128, 1, 4, 4), kcfg(64, 128, 1, 4, 4)
    elif per_expert <= 48:
        bm, g1, g2 = 32, kcfg(64, 128, 8, 4, 4), kcfg(64, 128, 8, 4, 4)
    elif per_expert <= 160:
        bm, g1, g2 = 64, kcfg(64, 64, 8, 4, 4), kcfg(128, 64, 8, 4, 4)
    else:
        bm, g1, g2 = 128, kcfg(128, 64, 8, 8, 3), kcfg(128, 64, 8, 8, 3)
    return {"mode": "sorted", "BLOCK_M": bm, "gemm1": g1, "gemm2": g2}


def kcfg(block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int) -> Config:
    return {
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "GROUP_M": group_m,
        "num_warps": num_warps,
        "num_stages": num_stages,
    }


def config_file_name(num_experts: int, hidden: int, inter: int, device_name: str) -> str:
    """Name of the tuned-config file for one layer shape on one device."""
    dev = "".join(c if c.isalnum() else "_" for c in device_name)
    return f"E{num_experts}_H{hidden}_I{inter}_{dev}.json"


@functools.lru_cache(maxsize=64)
def load_config_table(path: str) -> dict[int, Config] | None:
    """Token count -> config, from one JSON file (None when the file does not exist)."""
    p = Path(path)
    if not p.is_file():
        return None
    data = json.loads(p.read_text())
    table = data.get("configs", data)
    return {int(k): v for k, v in table.items()}


def nearest_config(table: dict[int, Config], num_tokens: int) -> Config:
    """The entry whose token count is nearest (ties go to the smaller count)."""
    best = min(table, key=lambda k: (abs(k - num_tokens), k))
    return table[best]


def get_config(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    device_name: str | None = None,
    config_dir: Path | str | None = None,
) -> Config:
    """Tuned config for this shape/device, nearest by token count; else `default_config`."""
    if device_name is None:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    directory = Path(config_dir) if config_dir is not None else CONFIG_DIR
    env_file = os.environ.get("SAFESERVE_FUSED_MOE_CONFIG")
    path = (
        Path(env_file)
        if env_file
        else directory / config_file_name(num_experts, hidden, inter, device_name)
    )
    table = load_config_table(str(path))
    if not table:
        return default_config(num_tokens, num_experts, top_k)
    return nearest_config(table, num_tokens)


# Plans with one row per (token, slot) pair and no sort; valid for top_k <= 64.
PAIR_MODES = ("pair",)


def fit_config(cfg: Config, elem_size: int, top_k: int) -> Config:
    """Shrink a config so its pipelined tiles fit in shared memory for this element size.

    Configs are tuned for 2-byte types; float32 inputs double every tile. The pair plan is only
    valid for top_k <= 64 (the down kernel holds the k ids of a token in registers).
    """
    out = {**cfg, "gemm1": dict(cfg["gemm1"]), "gemm2": dict(cfg["gemm2"])}
    if out["mode"] in PAIR_MODES and top_k > 64:
        out["mode"] = "sorted"
    bm = 16 if out["mode"] in PAIR_MODES else int(out["BLOCK_M"])
    out["BLOCK_M"] = bm
    # "pdl": "wait" (dependent launch only) or true (also an L2 prefetch); pair plan, Hopper+
    pdl = cfg.get("pdl", False)
    out["pdl"] = pdl in (True, "wait") and out["mode"] == "pair" and pdl_supported()
    out["pdl_prefetch"] = out["pdl"] and pdl is True
    for name, n_b in (("gemm1", 2), ("gemm2", 1)):
        k = out[name]
        while True:
            per_stage = (bm * k["BLOCK_K"] + n_b * k["BLOCK_K"] * k["BLOCK_N"]) * elem_size
            if per_stage * k["num_stages"] <= SMEM_BUDGET:
                break
            if k["num_stages"] > 2:
                k["num_stages"] -= 1
            elif k["BLOCK_K"] > 32:
                k["BLOCK_K"] //= 2
            else:
                break
    return out


@functools.lru_cache(maxsize=1)
def pdl_supported() -> bool:
    """Programmatic dependent launch: Hopper or newer, and not under the interpreter."""
    if not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
