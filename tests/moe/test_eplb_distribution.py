"""The expert distribution file: round trip, and clear errors for a file that does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from safeserve.moe.eplb.distribution import (
    FORMAT,
    read_expert_distribution,
    write_expert_distribution,
)


def test_round_trip(tmp_path: Path) -> None:
    counts = torch.tensor([[5, 0, 2], [1, 1, 9]])
    path = tmp_path / "dist.json"
    write_expert_distribution(path, counts)
    doc = json.loads(path.read_text())
    assert doc == {
        "format": FORMAT,
        "num_layers": 2,
        "num_logical_experts": 3,
        "logical_count": [[5, 0, 2], [1, 1, 9]],
    }
    back = read_expert_distribution(path, num_layers=2, num_logical_experts=3)
    assert back.dtype == torch.int64 and torch.equal(back, counts)
    write_expert_distribution(path, torch.zeros(1, 2, dtype=torch.int32))  # replaces the file
    assert read_expert_distribution(path).tolist() == [[0, 0]]
    assert [p.name for p in tmp_path.iterdir()] == ["dist.json"]


def _write(path: Path, **changes: object) -> Path:
    doc: dict[str, object] = {
        "format": FORMAT,
        "num_layers": 2,
        "num_logical_experts": 2,
        "logical_count": [[1, 2], [3, 4]],
    }
    doc.update(changes)
    path.write_text(json.dumps(doc))
    return path


def test_a_file_for_another_model_names_what_differs(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.json")
    with pytest.raises(ValueError, match="num_layers is 2, the model has 61"):
        read_expert_distribution(path, num_layers=61)
    with pytest.raises(ValueError, match="num_logical_experts is 2, the model has 256"):
        read_expert_distribution(path, num_layers=2, num_logical_experts=256)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "other"}, "format must be 'safeserve-expert-distribution'"),
        ({"num_layers": 0}, "num_layers must be a positive integer"),
        ({"num_logical_experts": "2"}, "num_logical_experts must be a positive integer"),
        ({"num_layers": 3}, "must have num_layers=3 rows, got 2"),
        ({"logical_count": [[1, 2], [3]]}, "row 1 must have num_logical_experts=2 counts, got 1"),
        ({"logical_count": [[1, 2], [3, -4]]}, "row 1 must hold non-negative integers"),
        ({"logical_count": [[1, 2.5], [3, 4]]}, "row 0 must hold non-negative integers"),
        ({"logical_count": None}, "must have num_layers=2 rows"),
    ],
)
def test_malformed_files_are_refused(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_expert_distribution(_write(tmp_path / "d.json", **changes))


def test_not_json_or_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        read_expert_distribution(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        read_expert_distribution(path)


def test_only_integer_counts_are_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="integer counts"):
        write_expert_distribution(tmp_path / "d.json", torch.ones(2, 2))
    with pytest.raises(ValueError, match="non-negative"):
        write_expert_distribution(tmp_path / "d.json", torch.tensor([[1, -1]]))
    with pytest.raises(ValueError, match="num_layers, num_logical_experts"):
        write_expert_distribution(tmp_path / "d.json", torch.ones(3, dtype=torch.int64))
    assert not list(tmp_path.iterdir())
