"""Where a group's experts start (`--init-expert-location`), and the map files.

The starting placement is `trivial` (slot p holds expert p % E: contiguous blocks per EP rank,
the redundant slots replicating experts 0, 1, ...), or read from a file, either

- a dumped expert distribution (`distribution.py`, `POST /admin/expert_distribution/dump`):
  tokens per logical expert per MoE layer, placed by the EPLB algorithm (`algorithm.py`), so a
  server restarted from its own dump starts balanced; or
- a physical-to-logical map (`GET /admin/eplb/map`, or written by hand):

      {"format": "safeserve-expert-map", "num_layers": L, "num_logical_experts": E,
       "phy2log": [[logical expert of slot 0, ..., of slot P-1], ...]}

A file for another model (other layer or expert counts) or for another slot count (P = E +
--ep-num-redundant-experts) is refused with one line naming what differs. Every rank builds the
same map from the same file: the algorithm is deterministic.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safeserve.moe.expert_map import ExpertMap

MAP_FORMAT = "safeserve-expert-map"
TRIVIAL = "trivial"


class LocationError(ValueError):
    """An --init-expert-location that cannot place this model's experts (one line)."""


def initial_expert_map(
    location: str,
    num_logical: int,
    num_layers: int,
    ep_size: int,
    redundant: int = 0,
    num_groups: int = 1,
    seed: int = 0,
) -> ExpertMap:
    """The starting map of a model of `num_logical` experts in `num_layers` MoE layers over
    `ep_size` ranks with `redundant` extra slots per layer. `num_groups`: the model's expert
    groups (the hierarchical policy keeps a group's experts together where it can)."""
    physical = num_logical + redundant
    if physical % ep_size:
        raise LocationError(
            f"{num_logical} experts + {redundant} redundant = {physical} slots cannot be split "
            f"evenly over {ep_size} EP ranks"
        )
    if location == TRIVIAL:
        return ExpertMap.trivial(num_logical, ep_size, num_layers, redundant, seed)
    doc = _read(location)
    fmt = doc.get("format")
    if fmt == MAP_FORMAT:
        rows = _sized(doc, location, num_layers, num_logical, "phy2log")
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != physical:
                got = len(row) if isinstance(row, list) else type(row).__name__
                raise LocationError(
                    f"{location}: phy2log row {i} has {got} slots, this server has {physical} "
                    f"({num_logical} experts + {redundant} redundant)"
                )
            if not all(type(x) is int for x in row):
                raise LocationError(f"{location}: phy2log row {i} must hold integers")
        try:
            return ExpertMap.from_phy2log(rows, num_logical, ep_size, seed)
        except ValueError as e:
            raise LocationError(f"{location}: {e}") from e
    from safeserve.moe.eplb.distribution import FORMAT, read_expert_distribution

    if fmt != FORMAT:
        raise LocationError(
            f"{location}: format must be {FORMAT!r} (a dumped distribution) or {MAP_FORMAT!r}, "
            f"got {fmt!r}"
        )
    try:
        counts = read_expert_distribution(
            location, num_layers=num_layers, num_logical_experts=num_logical
        )
    except ValueError as e:
        raise LocationError(str(e)) from e
    return placement_of_counts(counts, physical, ep_size, num_groups, seed)


def check_redundant(num_logical: int, ep_size: int, redundant: int) -> None:
    """A server's redundant slots fit: no EP rank holds more slots than the model has experts
    (a rank would hold some expert twice)."""
    per_rank = (num_logical + redundant) // ep_size
    if per_rank > num_logical:
        raise LocationError(
            f"--ep-num-redundant-experts {redundant}: {per_rank} slots per EP rank, more than "
            f"the model's {num_logical} experts"
        )


def placement_of_counts(
    counts: object, num_physical: int, ep_size: int, num_groups: int = 1, seed: int = 0
) -> ExpertMap:
    """The EPLB placement of `counts[L, E]` (tokens per logical expert; a tensor) in
    `num_physical` slots over `ep_size` ranks, on one node."""
    import torch

    from safeserve.moe.eplb.algorithm import rebalance_experts

    weight = torch.as_tensor(counts).to(torch.float64)
    num_logical = weight.shape[1]
    groups = num_groups if num_groups >= 1 and num_logical % num_groups == 0 else 1
    phy2log, _, _ = rebalance_experts(weight, num_physical, groups, 1, ep_size)
    return ExpertMap.from_phy2log(phy2log, num_logical, ep_size, seed)


def write_map_file(path: str | Path, expert_map: ExpertMap) -> None:
    """Writes `expert_map`'s phy2log as a file `--init-expert-location` reads, replacing it
    whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(map_document(expert_map) + "\n")
    os.replace(tmp, path)


def map_document(expert_map: ExpertMap) -> str:
    """The map file's JSON text of `expert_map`."""
    return json.dumps(
        {
            "format": MAP_FORMAT,
            "num_layers": expert_map.num_layers,
            "num_logical_experts": expert_map.num_logical,
            "phy2log": [list(r) for r in expert_map.phy2log],
        }
    )


def _read(location: str) -> dict:
    try:
        text = Path(location).read_text()
    except OSError as e:
        raise LocationError(
            f"--init-expert-location {location}: cannot read it ({e.strerror or e}); "
            "give 'trivial' or a file"
        ) from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise LocationError(f"{location}: not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise LocationError(f"{location}: expected a JSON object")
    return doc


def _sized(doc: dict, location: str, num_layers: int, num_logical: int, key: str) -> list:
    layers, experts = doc.get("num_layers"), doc.get("num_logical_experts")
    if layers != num_layers:
        raise LocationError(f"{location}: num_layers is {layers!r}, the model has {num_layers}")
    if experts != num_logical:
        raise LocationError(
            f"{location}: num_logical_experts is {experts!r}, the model has {num_logical}"
        )
    rows = doc.get(key)
    if not isinstance(rows, list) or len(rows) != num_layers:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise LocationError(f"{location}: {key} must have {num_layers} rows, got {got}")
    return rows
