"""A dumped expert distribution on disk: tokens per logical expert per MoE layer, as JSON.

    {"format": "safeserve-expert-distribution", "num_layers": L, "num_logical_experts": E,
     "logical_count": [[c_0_0, ..., c_0_E-1], ...]}

`--init-expert-location` reads one to compute a starting placement (`algorithm.py`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

FORMAT = "safeserve-expert-distribution"


def write_expert_distribution(path: str | Path, logical_count: torch.Tensor) -> None:
    """Writes `logical_count[L, E]` (integer, >= 0) to `path`, replacing it whole."""
    if logical_count.dim() != 2:
        raise ValueError(
            f"logical_count must be [num_layers, num_logical_experts], "
            f"got {tuple(logical_count.shape)}"
        )
    if logical_count.is_floating_point() or logical_count.is_complex():
        raise ValueError(f"logical_count must hold integer counts, got {logical_count.dtype}")
    if bool((logical_count < 0).any()):
        raise ValueError("logical_count must be non-negative")
    num_layers, num_logical = logical_count.shape
    doc = {
        "format": FORMAT,
        "num_layers": num_layers,
        "num_logical_experts": num_logical,
        "logical_count": logical_count.to("cpu", torch.int64).tolist(),
    }
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc) + "\n")
    os.replace(tmp, path)


def _positive_int(doc: dict[str, object], key: str) -> int:
    value = doc.get(key)
    if type(value) is not int or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def read_expert_distribution(
    path: str | Path, *, num_layers: int | None = None, num_logical_experts: int | None = None
) -> torch.Tensor:
    """The `[L, E]` int64 counts in `path`; checked against the model's sizes where given."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: format must be {FORMAT!r}, got {doc.get('format')!r}")
    layers = _positive_int(doc, "num_layers")
    experts = _positive_int(doc, "num_logical_experts")
    if num_layers is not None and layers != num_layers:
        raise ValueError(f"{path}: num_layers is {layers}, the model has {num_layers}")
    if num_logical_experts is not None and experts != num_logical_experts:
        raise ValueError(
            f"{path}: num_logical_experts is {experts}, the model has {num_logical_experts}"
        )
    rows = doc.get("logical_count")
    if not isinstance(rows, list) or len(rows) != layers:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise ValueError(f"{path}: logical_count must have num_layers={layers} rows, got {got}")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != experts:
            got = len(row) if isinstance(row, list) else type(row).__name__
            raise ValueError(
                f"{path}: logical_count row {i} must have num_logical_experts={experts} "
                f"counts, got {got}"
            )
        if not all(type(c) is int and c >= 0 for c in row):
            raise ValueError(f"{path}: logical_count row {i} must hold non-negative integers")
    return torch.tensor(rows, dtype=torch.int64)
