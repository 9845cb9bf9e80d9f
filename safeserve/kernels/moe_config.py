"""Tile configs of the fused MoE kernels: the tuned tables (data in configs/), the heuristic for
untuned shapes, and the fitting of a config to shared memory and element size.

A table ``configs/E{E}_H{H}_I{I}_{device}.json`` maps a token count to a config (the launch plan,
``"mode"``, and the tiles of each GEMM); the entry of the nearest token count is used. A device
without a table of its own uses one of the same shape tuned on a device of its compute capability
(``meta.capability``), else the heuristic.
``SAFESERVE_FUSED_MOE_CONFIG`` names a table to use instead.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_log = logging.getLogger(__name__)

Config = dict[str, Any]

# Shared memory the pipelined tiles may take: what a program may opt into on the device less
# SMEM_RESERVE (Triton keeps up to num_stages tiles of A and B there, num_stages - 1 on the
# mma.sync path, and reuses them for the epilogue). SMEM_BUDGET: an H100/H200's (227 KiB).
SMEM_RESERVE = 7 * 1024
SMEM_BUDGET = 227 * 1024 - SMEM_RESERVE


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


# The token count whose tuned tiles batch-invariant mode uses for every batch: row tiles of 64 in
# the H200 tables, between a decode batch's (16: more weight reads per prefill token) and a long
# prefill's (128: more padding per decode step).
INVARIANT_TOKENS = 512


def invariant_config(num_experts: int, hidden: int, inter: int, top_k: int) -> Config:
    """One config for every token count (--enable-deterministic-inference): the sorted plan
    (the pair and chunk plans sum a token's slots differently, and the plan follows the count)
    with the tiles tuned for `INVARIANT_TOKENS` tokens where those are a sorted plan's, else
    the heuristic's. Every row of a tile is then computed alike whatever else is in it."""
    cfg = get_config(INVARIANT_TOKENS, num_experts, hidden, inter, top_k)
    if cfg.get("mode") != "sorted":
        cfg = default_config(INVARIANT_TOKENS, num_experts, top_k)  # sorted: over 4 tokens
    return cfg


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


class ConfigTableError(ValueError):
    """A tile table that the kernels cannot use; the message names the file, entry and key."""


_POW2_TILES = (16, 32, 64, 128, 256, 512)
_ENTRY_KEYS = {"mode", "BLOCK_M", "gemm1", "gemm2", "pdl", "tuned_us"}
_GEMM_KEYS = {"BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}
_GEMM_OPTIONS = {"interleave", "split", "evict_first", "slice"}


def check_config(cfg: Config, where: str) -> None:
    """Raise ConfigTableError for an entry the launcher would misread or Triton reject: unknown
    keys (a misspelt option would be silently ignored), a plan that does not exist, tiles that
    are not powers of two, warp counts or stages out of range."""

    def bad(msg: str) -> ConfigTableError:
        return ConfigTableError(f"{where}: {msg}")

    if not isinstance(cfg, dict):
        raise bad("an entry must be an object")
    unknown = set(cfg) - _ENTRY_KEYS
    if unknown:
        raise bad(f"unknown keys {sorted(unknown)} (known: {sorted(_ENTRY_KEYS)})")
    if cfg.get("mode") not in PLANS:
        raise bad(f"mode {cfg.get('mode')!r} is not one of {list(PLANS)}")
    if cfg.get("BLOCK_M") not in _POW2_TILES:
        raise bad(f"BLOCK_M {cfg.get('BLOCK_M')!r} is not one of {_POW2_TILES}")
    if cfg.get("pdl", False) not in (False, True, "wait"):
        raise bad(f'pdl {cfg["pdl"]!r} is not false, true or "wait"')
    for name in ("gemm1", "gemm2"):
        k = cfg.get(name)
        if not isinstance(k, dict):
            raise bad(f"{name} is missing")
        unknown = set(k) - _GEMM_KEYS - _GEMM_OPTIONS
        if unknown:
            raise bad(f"{name}: unknown keys {sorted(unknown)}")
        for key in ("BLOCK_N", "BLOCK_K"):
            if k.get(key) not in _POW2_TILES:
                raise bad(f"{name}.{key} {k.get(key)!r} is not one of {_POW2_TILES}")
        if k.get("num_warps") not in (1, 2, 4, 8, 16):
            raise bad(f"{name}.num_warps {k.get('num_warps')!r} is not 1, 2, 4, 8 or 16")
        if not isinstance(k.get("num_stages"), int) or not 1 <= k["num_stages"] <= 8:
            raise bad(f"{name}.num_stages {k.get('num_stages')!r} is not 1..8")
        if not isinstance(k.get("GROUP_M", 1), int) or k.get("GROUP_M", 1) < 1:
            raise bad(f"{name}.GROUP_M {k.get('GROUP_M')!r} is not a positive integer")
        for opt in ("split", "slice"):
            v = k.get(opt, 1)
            if not isinstance(v, int) or v < 1:
                raise bad(f"{name}.{opt} {v!r} is not a positive integer")


@functools.lru_cache(maxsize=64)
def load_config_table(path: str) -> dict[int, Config] | None:
    """Token count -> config, from one JSON file (None when the file does not exist).

    Raises ConfigTableError when the file is not a valid table (see `check_config`)."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
        table = data.get("configs", data)
        out = {int(k): v for k, v in table.items()}
    except (ValueError, AttributeError) as e:
        raise ConfigTableError(f"{path}: not a token-count -> config table ({e})") from e
    if not out:
        raise ConfigTableError(f"{path}: the table is empty")
    for tokens, cfg in out.items():
        if tokens < 1:
            raise ConfigTableError(f"{path}: token count {tokens} is not positive")
        check_config(cfg, f"{path}, {tokens} tokens")
    return out


def nearest_config(table: dict[int, Config], num_tokens: int) -> Config:
    """The entry whose token count is nearest (ties go to the smaller count)."""
    best = min(table, key=lambda k: (abs(k - num_tokens), k))
    return table[best]


def check_override_table() -> None:
    """At start-up: the table `SAFESERVE_FUSED_MOE_CONFIG` names, if set, exists and is valid
    (the lookup would otherwise fall back to the heuristic without a word, or a rank would fail
    at its first MoE layer)."""
    path = os.environ.get("SAFESERVE_FUSED_MOE_CONFIG")
    if path and load_config_table(path) is None:
        raise ConfigTableError(f"SAFESERVE_FUSED_MOE_CONFIG={path}: no such file")


def get_config(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    device_name: str | None = None,
    config_dir: Path | str | None = None,
    capability: str | None = None,
) -> Config:
    """Tuned config for this shape/device, nearest by token count; else the table of this shape
    tuned on another device of the same compute capability (`capability`, "9.0": an H100 takes
    the H200's tiles); else `default_config`. Without `device_name`, the current CUDA device."""
    if device_name is None:
        import torch  # here only: `serve` checks a table in its frontend, which has no torch

        if torch.cuda.is_available():
            device_name, own = _cuda_identity(torch.cuda.current_device())
            capability = capability or own
        else:
            device_name = "cpu"
    directory = Path(config_dir) if config_dir is not None else CONFIG_DIR
    env_file = os.environ.get("SAFESERVE_FUSED_MOE_CONFIG")
    path = (
        Path(env_file)
        if env_file
        else directory / config_file_name(num_experts, hidden, inter, device_name)
    )
    table = load_config_table(str(path))
    if table is None and not env_file and capability:
        table = same_capability_table(str(directory), num_experts, hidden, inter, capability)
    if not table:
        return default_config(num_tokens, num_experts, top_k)
    return nearest_config(table, num_tokens)


@functools.cache
def _cuda_identity(index: int) -> tuple[str, str]:
    """(name, "major.minor") of a CUDA device, asked once: `get_config` runs at every eager
    MoE call."""
    import torch

    return torch.cuda.get_device_name(index), "{}.{}".format(
        *torch.cuda.get_device_capability(index)
    )


@functools.lru_cache(maxsize=64)
def same_capability_table(
    directory: str, num_experts: int, hidden: int, inter: int, capability: str
) -> dict[int, Config] | None:
    """The table of this layer shape tuned on a device of this compute capability (its
    ``meta.capability``), for a device that has none of its own: the tiles suit the same SMs
    and shared memory (an H100 and an H200 differ in memory bandwidth only). The first such
    file by name; None if there is none."""
    prefix = config_file_name(num_experts, hidden, inter, "")
    for path in sorted(Path(directory).glob(f"{prefix.removesuffix('.json')}*.json")):
        try:
            meta = json.loads(path.read_text()).get("meta", {})
        except (ValueError, AttributeError):
            continue
        if isinstance(meta, dict) and str(meta.get("capability")) == capability:
            table = load_config_table(str(path))
            _log.info(
                "fused MoE: no tile table for this device; using %s (tuned on %s, compute "
                "capability %s, as this device)",
                path.name,
                meta.get("device", "?"),
                capability,
            )
            return table
    return None


# Plans with one row per (token, slot) pair and no sort; valid for top_k <= 64.
PAIR_MODES = ("pair",)
# Every plan (safeserve.kernels.fused_moe says what each does). In "chunk" gemm1's BLOCK_N is the
# tile of intermediate rows per program ("slice": n uses only the first n of them, so there are
# more programs), its warps and stages are the launch's; gemm2's BLOCK_N is the down tile's
# output width and its num_warps the partial sum's.
PLANS = (*PAIR_MODES, "chunk", "sorted")


def fit_config(cfg: Config, elem_size: int, top_k: int, budget: int = SMEM_BUDGET) -> Config:
    """Shrink a config so its pipelined tiles fit in `budget` bytes of shared memory for this
    element size: fewer stages, then shallower, then narrower tiles.

    Configs are tuned for 2-byte types on an H100/H200; float32 inputs double every tile, and an
    A100 (163 KiB) or an L40S (99 KiB) has less room (`budget`: see `smem_budget`). The pair plan
    is only valid for top_k <= 64 (the down kernel holds the k ids of a token in registers).
    """
    out = {**cfg, "gemm1": dict(cfg["gemm1"]), "gemm2": dict(cfg["gemm2"])}
    if out["mode"] in PAIR_MODES and top_k > 64:
        out["mode"] = "sorted"
    bm = 16 if out["mode"] in PAIR_MODES else int(out["BLOCK_M"])
    out["BLOCK_M"] = bm
    # Where kernels launch as programmatic dependents (kernels/common.py: Hopper and newer, unless
    # --disable-pdl) the down kernel is one, whatever "pdl" says; "pdl": true (pair plan) also
    # has its programs prefetch their weights into L2 before they wait. "wait" and false: no
    # prefetch (the keys of tables tuned when only the down kernel could be a dependent launch).
    out["pdl_prefetch"] = cfg.get("pdl", False) is True and out["mode"] == "pair"
    if out["mode"] == "chunk":
        _fit_chunk(out, elem_size, budget)
        return out
    for name, n_b in (("gemm1", 2), ("gemm2", 1)):
        k = out[name]
        while True:
            if gemm_tiles_bytes(bm, k, n_b, elem_size) <= budget:
                break
            if k["num_stages"] > 2:
                k["num_stages"] -= 1
            elif k["BLOCK_K"] > 32:
                k["BLOCK_K"] //= 2
            elif k["BLOCK_N"] > 16:
                k["BLOCK_N"] //= 2
            else:
                break
    return out


def smem_budget(shared_bytes: int) -> int:
    """The `fit_config` budget of a device whose programs may opt into `shared_bytes`."""
    return shared_bytes - SMEM_RESERVE


def gemm_tiles_bytes(block_m: int, gemm: Config, n_b: int, elem_size: int) -> int:
    """Shared memory counted for one GEMM's pipelined tiles: num_stages x (BLOCK_M x BLOCK_K of
    A + n_b x BLOCK_K x BLOCK_N of B; n_b = 2 for gate/up, whose B tile holds both)."""
    per_stage = block_m * gemm["BLOCK_K"] + n_b * gemm["BLOCK_K"] * gemm["BLOCK_N"]
    return per_stage * elem_size * gemm["num_stages"]


def _chunk_tiles_bytes(cfg: Config, elem_size: int) -> int:
    g1, g2 = cfg["gemm1"], cfg["gemm2"]
    up = (16 + 2 * g1["BLOCK_N"]) * g1["BLOCK_K"]
    down = (16 + g2["BLOCK_N"]) * g1["BLOCK_N"]
    return max(up, down) * elem_size * g1["num_stages"]


def tiles_bytes(cfg: Config, elem_size: int) -> int:
    """Shared memory counted for a config (as `fit_config` returns it): its largest tile set."""
    if cfg["mode"] == "chunk":
        return _chunk_tiles_bytes(cfg, elem_size)
    bm = cfg["BLOCK_M"]
    return max(
        gemm_tiles_bytes(bm, cfg["gemm1"], 2, elem_size),
        gemm_tiles_bytes(bm, cfg["gemm2"], 1, elem_size),
    )


def _fit_chunk(cfg: Config, elem_size: int, budget: int) -> None:
    """The chunk plan's one launch pipelines both its loops with gemm1's stages: the gate/up
    tiles (16 x BLOCK_K of x, BLOCK_K x 2 BLOCK_N of w13), then the down tiles (BLOCK_N x
    gemm2.BLOCK_N of w2). The loops run one after the other, so Triton gives both the same
    shared memory: the larger must fit."""
    g1, g2 = cfg["gemm1"], cfg["gemm2"]
    while True:
        if _chunk_tiles_bytes(cfg, elem_size) <= budget:
            return
        if g1["num_stages"] > 2:
            g1["num_stages"] -= 1
        elif g1["BLOCK_K"] > 32:
            g1["BLOCK_K"] //= 2
        elif g2["BLOCK_N"] > 32:
            g2["BLOCK_N"] //= 2
        else:
            return
