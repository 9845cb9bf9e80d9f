"""Node agents (`safeserve node`) as real processes for tests, each its own process tree (as on
its own host), and what tests of `--placement remote` read and compare."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import torch
from serving import Server, die_with_parent


def start_agent(
    node_id: str,
    frontend_port: int,
    key_dir: Path,
    log: Path,
    host: str,
    devices: str,
    *extra: str,
) -> subprocess.Popen:
    """`safeserve node` named `node_id`, reaching the frontend at 127.0.0.1:`frontend_port`,
    its ranks' rendezvous on `host`, offering `devices` (CPU rank slots), plus `extra` flags."""
    cmd = [sys.executable, "-m", "safeserve.cli", "node"]
    cmd += ["--frontend", f"127.0.0.1:{frontend_port}", "--node-id", node_id]
    cmd += ["--host", host, "--devices", devices, "--curve-keys-dir", str(key_dir), *extra]
    return subprocess.Popen(
        cmd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process tree, as on its own host
        preexec_fn=die_with_parent,
    )


def kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL an agent and every process under it (its ranks)."""
    try:
        tree = [p.pid] + [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(10)


def nodes_view(s: Server) -> dict:
    """GET /admin/nodes."""
    return httpx.get(s.admin_url + "/admin/nodes", timeout=10).json()


def prompt(i: int) -> list[int]:
    """The i-th test prompt: 4 + i token ids."""
    return [(29 * i + 7 * j) % 250 + 3 for j in range(4 + i)]


def greedy(hf, ids: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' greedy continuation of `ids`: `n` token ids."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def completion_ids(s: Server, model: str, ids: list[int], n: int) -> tuple[int, list[int]]:
    """A greedy completion of `ids` through HTTP: (the group that answered, its `n` ids)."""
    r = httpx.post(
        s.url + "/v1/completions",
        json={
            "model": model,
            "prompt": ids,
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return int(r.headers["x-safeserve-group"]), r.json()["choices"][0]["token_ids"]
