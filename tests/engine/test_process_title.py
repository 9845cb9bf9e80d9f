"""Rank processes carry their group and rank in `ps`."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_rank_process_title() -> None:
    pytest.importorskip("setproctitle")
    code = (
        "from safeserve.engine.rank_worker import set_process_title\n"
        "set_process_title(3, 1)\n"
        "print(open('/proc/self/cmdline', 'rb').read().split(b'\\0')[0].decode())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "safeserve: group 3 rank 1"


def test_rank_process_title_without_setproctitle() -> None:
    code = (
        "import sys\n"
        "sys.modules['setproctitle'] = None  # an import of it fails\n"
        "from safeserve.engine.rank_worker import set_process_title\n"
        "set_process_title(0, 0)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
