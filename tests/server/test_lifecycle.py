"""Start-up, readiness and failure of the real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from checkpoints import write_qwen3_moe_checkpoint
from serving import api_client, rank_processes


def test_tiny_model_serves_chat_by_default(server_factory) -> None:
    s = server_factory([])
    client = api_client(s)
    assert [m.id for m in client.models.list()] == ["tiny"]
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    assert r.choices[0].message.content
    assert r.usage.completion_tokens >= 1


def test_broken_checkpoint_exits_non_zero_with_reason(tmp_path: Path) -> None:
    ckpt = write_qwen3_moe_checkpoint(tmp_path / "ck", seed=1)
    (ckpt / "model.safetensors").unlink()
    r = subprocess.run(
        [sys.executable, "-m", "safeserve.cli", "serve", "--model", str(ckpt), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "no *.safetensors files" in r.stdout + r.stderr


def test_dead_leader_makes_ready_and_requests_fail_fast(server_factory) -> None:
    s = server_factory(
        ["--max-model-len", "4096", "--max-request-attempts", "1", "--crash-loop-failures", "1"]
    )
    leaders = rank_processes(s.proc.pid)
    assert [" ".join(p.cmdline()).strip() for p in leaders] == ["safeserve: group 0 rank 0"]
    client = api_client(s, timeout=20)
    stream = client.completions.create(
        model="tiny", prompt="go", max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    for p in leaders:
        os.kill(p.pid, signal.SIGKILL)
    t0 = time.monotonic()
    # The stream must end with an error event the client understands, not hang.
    with pytest.raises(openai.APIError, match="failed"):
        list(stream)
    assert time.monotonic() - t0 < 5
    assert httpx.get(s.url + "/ready").status_code == 503
    assert httpx.get(s.url + "/health").status_code == 503
    r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 503 and "Retry-After" in r.headers


def test_a_killed_starter_leaves_no_server_behind(tmp_path: Path) -> None:
    """A server started by tests (or a chaos run) dies with whoever started it, even SIGKILLed."""
    tests = Path(__file__).resolve().parents[1]
    script = (
        f"import sys, time; sys.path.insert(0, {str(tests)!r}); from pathlib import Path\n"
        "from serving import start_server\n"
        f"s = start_server(['--tp-size', '2'], Path({str(tmp_path / 'server.log')!r}))\n"
        "print(s.proc.pid, flush=True); time.sleep(600)\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server = psutil.Process(int(starter.stdout.readline()))  # type: ignore[union-attr]
        ranks = server.children(recursive=True)
        assert len(rank_processes(server.pid)) == 2
        starter.kill()
        starter.wait(timeout=10)
        gone, alive = psutil.wait_procs([server, *ranks], timeout=30)
        assert not alive, [p.cmdline()[:3] for p in alive]
    finally:
        starter.kill()
