"""Run `safeserve plan` as a user does, in the repository root (tests/plan)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "safeserve.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
