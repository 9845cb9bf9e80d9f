from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from safeserve.config import ConfigError, ServerArgs


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "safeserve.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_help_lists_grouped_flags() -> None:
    r = _cli("serve", "--help")
    assert r.returncode == 0
    for title in ("model:", "HTTP server:", "scheduling and KV cache:", "parallelism:"):
        assert title in r.stdout
    for flag in (
        "--model",
        "--host",
        "--port",
        "--seed",
        "--dtype",
        "--device",
        "--load-format",
        "--chunked-prefill-size",
        "--max-running-requests",
        "--api-key",
    ):
        assert flag in r.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-running-requests", "0"], "--max-running-requests must be at least 1"),
        (["--dtype", "int3"], "invalid choice"),
        (["--model", "/nonexistent/dir"], "neither 'tiny' nor a local checkpoint"),
        (["--admin-host", "0.0.0.0"], "--admin-host off loopback needs --admin-api-key"),
        (["--num-groups", "0"], "must be >= 1"),
        (["--port", "99999"], "--port must be in 0..65535"),
        (["--port", "65535"], "--admin-port must be in 0..65535, got 65536"),
        (["--port", "9000", "--admin-port", "9000"], "--admin-port must differ from --port"),
    ],
)
def test_bad_flags_exit_non_zero_with_one_line(args: list[str], message: str) -> None:
    r = _cli("serve", *args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_server_args_checks() -> None:
    with pytest.raises(ConfigError):
        ServerArgs(block_size=0)
    assert ServerArgs(chunked_prefill_size=4096, max_num_batched_tokens=512).prefill_chunk == 512
    assert ServerArgs(model="tiny", served_model_name="x").model_name == "x"


def test_bad_checkpoint_fails_start_with_clear_error(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    r = _cli("serve", "--model", str(tmp_path), "--port", "0")
    assert r.returncode == 2
    assert "model_type 'llama' is not supported" in r.stderr


def test_bad_fused_moe_table_is_refused_before_start(tmp_path) -> None:
    """SAFESERVE_FUSED_MOE_CONFIG naming a missing or broken table: exit 2 at start-up, not a
    silent fallback or a rank failing at its first MoE layer."""
    table = tmp_path / "table.json"
    table.write_text('{"configs": {"1": {"mode": "pair", "BLOCK_M": 16}}}')
    for path, message in ((tmp_path / "missing.json", "no such file"), (table, "gemm1 is missing")):
        r = subprocess.run(
            [sys.executable, "-m", "safeserve.cli", "serve", "--model", "tiny", "--port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "SAFESERVE_FUSED_MOE_CONFIG": str(path)},
        )
        assert r.returncode == 2, r.stderr[-2000:]
        assert message in r.stderr and str(path) in r.stderr


@pytest.mark.parametrize(
    "args", [["oncall", "runbook", "rank-dead"], ["chaos", "list", "chaos"], ["--help"]]
)
def test_a_reader_that_goes_away_ends_the_output_quietly(args: list[str]) -> None:
    """`safeserve … | head -1`: the reader closes the pipe; the command stops writing, exits as
    it would have (0) and prints no traceback."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "safeserve.cli", *args],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[1],
        )
    finally:
        os.close(w)
    assert done.returncode == 0 and done.stderr == ""


@pytest.mark.parametrize("flag", ["--port", "--admin-port"])
def test_a_port_in_use_is_refused_before_any_group_starts(flag: str) -> None:
    """Another process listens on the port: one line naming it, exit 2, and no rank process was
    started (the refusal comes before the groups load their models)."""
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        other = port + 2 if port < 65000 else port - 2
        ports = [flag, str(port)] + (["--port", str(other)] if flag == "--admin-port" else [])
        t0 = time.monotonic()
        r = _cli("serve", "--model", "tiny", *ports)
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"cannot listen on 127.0.0.1:{port} ({flag})" in r.stderr
        assert "Traceback" not in r.stderr and "group 0" not in r.stderr
        assert time.monotonic() - t0 < 30
