"""Guard policy presets (`safeserve.policy`, `safeserve serve --guard-policy FILE`): the round
trip, the precedence of flags given, every refusal, and a real server serving with one."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from safeserve.config import ConfigError, ServerArgs
from safeserve.config_cli import add_server_args, server_args_from
from safeserve.policy import (
    POLICY_FIELDS,
    PolicyError,
    format_policy,
    policy_tables,
    read_policy,
    write_policy,
)

# Every policy key at a value other than its default (a valid set together).
NON_DEFAULT = {
    "max_running_requests": 5,
    "max_num_batched_tokens": 192,
    "chunked_prefill_size": 48,
    "num_kv_blocks": 40,
    "kv_cache_memory_gb": 0.125,
    "mem_fraction_static": 0.7,
    "dispatch_budget_tokens": 384,
    "dispatch_memory_gb": 0.5,
    "prefill_sizing": "observed",
    "heartbeat_interval_s": 0.2,
    "watchdog_stall_timeout": 12.5,
    "watchdog_slow_factor": 3.0,
    "watchdog_slow_window_s": 2.5,
    "canary_interval_s": 45.0,
}


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser.parse_args(list(argv))


def test_the_keys_are_server_args_fields_in_their_groups() -> None:
    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    assert set(NON_DEFAULT) == set(POLICY_FIELDS)
    assert len(set(POLICY_FIELDS)) == len(POLICY_FIELDS)
    for table, names in policy_tables().items():
        for name in names:
            assert fields[name].metadata["group"] == table
    defaults = ServerArgs()
    assert all(getattr(defaults, k) != v for k, v in NON_DEFAULT.items())


def test_write_then_read_gives_the_same_values(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    write_policy(path, NON_DEFAULT, ["written by a test", "two lines\nand a third"])
    text = path.read_text()
    assert text.startswith("# written by a test\n# two lines\n# and a third\n")
    assert read_policy(path) == NON_DEFAULT
    assert tomllib.loads(text)["guards"]["prefill_sizing"] == "observed"
    # None is written as absence; an integer for a float flag is read back as a float
    write_policy(path, {"num_kv_blocks": None, "watchdog_stall_timeout": 7}, [])
    assert "num_kv_blocks" not in path.read_text()
    assert read_policy(path) == {"watchdog_stall_timeout": 7.0}
    assert isinstance(read_policy(path)["watchdog_stall_timeout"], float)
    write_policy(path, {}, ["nothing set"])
    assert read_policy(path) == {}


def test_the_writer_refuses_what_the_reader_would(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    for values, message in (
        ({"block_size": 8}, "'block_size' is not a guard policy key; allowed: max_running"),
        ({"max_running_requests": 2.5}, "max_running_requests must be an integer"),
        ({"prefill_sizing": "best"}, "prefill_sizing must be one of worst, observed"),
        ({"mem_fraction_static": 1.5}, "--mem-fraction-static must be in (0, 1]"),
        ({"watchdog_slow_factor": float("nan")}, "must be a finite number"),
    ):
        with pytest.raises(PolicyError) as e:
            write_policy(path, values, [])
        assert message in str(e.value)
        assert not path.exists()
    assert issubclass(PolicyError, ConfigError)
    # strings are escaped as TOML wants (no policy key is a free string today)
    from safeserve.policy import _toml_string

    odd = 'a "quoted" \\ back\tslash\n\x01\x7fé'
    assert tomllib.loads(f"x = {_toml_string(odd)}")["x"] == odd
    assert format_policy({"max_running_requests": 3}) == "[scheduler]\nmax_running_requests = 3\n"


def test_flags_given_win_and_the_preset_fills_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "p.toml"
    write_policy(path, NON_DEFAULT, ["test"])
    monkeypatch.setenv("SAFESERVE_API_KEY", "from-env")
    # --max-running-requests given at its default value still wins
    ns = _parse(
        "--guard-policy", str(path), "--max-running-requests", "64", "--prefill-sizing=worst"
    )
    with caplog.at_level("INFO", logger="safeserve.config_cli"):
        args = server_args_from(ns)
    assert args.max_running_requests == 64 and args.prefill_sizing == "worst"
    for name, value in NON_DEFAULT.items():
        if name not in ("max_running_requests", "prefill_sizing"):
            assert getattr(args, name) == value, name
    assert args.api_key == "from-env" and args.guard_policy == str(path)
    (line,) = [r.getMessage() for r in caplog.records if "guard policy" in r.getMessage()]
    assert line.startswith(f"guard policy {path} set max_num_batched_tokens=192, ")
    assert "watchdog_stall_timeout=12.5" in line
    assert "overrode max_running_requests (preset 5, flag 64), prefill_sizing" in line
    # without the preset nothing changes
    assert server_args_from(_parse()) == ServerArgs(api_key="from-env")


def test_a_preset_and_flags_that_disagree_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    write_policy(path, {"watchdog_stall_timeout": 1.0}, [])
    with pytest.raises(ConfigError, match=r"must exceed .* \(with --guard-policy "):
        server_args_from(_parse("--guard-policy", str(path), "--heartbeat-interval-s", "2"))


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "safeserve.cli", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


BAD = [
    pytest.param(None, "no such file", id="missing"),
    pytest.param(
        "[scheduler]\nmax_running_requests = \n",
        "invalid TOML: Invalid value (at line 2, column 24)",
        id="syntax",
    ),
    pytest.param(
        "[scheduler]\nmax_running_requests = 4\n[model]\ndtype = 'float16'\n",
        "unknown table [model]; the tables are scheduler, guards, health",
        id="unknown-table",
    ),
    pytest.param(
        "[guards]\ndispatch_budget = 4\n",
        "unknown key 'dispatch_budget' in [guards]; [guards] takes dispatch_budget_tokens, "
        "dispatch_memory_gb, prefill_sizing",
        id="unknown-key",
    ),
    pytest.param(
        "[scheduler]\nblock_size = 32\n",
        "unknown key 'block_size' in [scheduler]",
        id="not-a-policy-flag",
    ),
    pytest.param(
        "[guards]\nwatchdog_stall_timeout = 5.0\n",
        "watchdog_stall_timeout belongs in [health], not [guards]",
        id="wrong-table",
    ),
    pytest.param(
        "max_running_requests = 4\n",
        "max_running_requests is outside a table; put it under [scheduler]",
        id="no-table",
    ),
    pytest.param(
        "[scheduler]\nmax_running_requests = 4.0\n",
        "[scheduler]: max_running_requests must be an integer (--max-running-requests), got 4.0",
        id="float-for-int",
    ),
    pytest.param(
        "[health]\nwatchdog_stall_timeout = '10'\n",
        "watchdog_stall_timeout must be a number (--watchdog-stall-timeout), got '10'",
        id="str-for-float",
    ),
    pytest.param(
        "[guards]\nprefill_sizing = 1\n", "prefill_sizing must be a string", id="int-for-str"
    ),
    pytest.param(
        "[scheduler]\nmax_running_requests = true\n",
        "max_running_requests must be an integer",
        id="bool-for-int",
    ),
    pytest.param(
        "[scheduler]\nmax_running_requests = 0\n",
        "[scheduler] max_running_requests = 0: --max-running-requests must be at least 1",
        id="refused-value",
    ),
    pytest.param(
        "[health]\nwatchdog_stall_timeout = 0.1\n",
        "[health] watchdog_stall_timeout = 0.1: --watchdog-stall-timeout must exceed",
        id="refused-timeout",
    ),
    pytest.param(
        "[guards]\nprefill_sizing = 'best'\n",
        "prefill_sizing must be one of worst, observed, got 'best'",
        id="refused-choice",
    ),
]


@pytest.mark.parametrize("text,message", BAD)
def test_a_bad_preset_exits_2_with_one_line(tmp_path: Path, text: str | None, message: str) -> None:
    path = tmp_path / "bad.toml"
    if text is not None:
        path.write_text(text)
    r = _serve("--guard-policy", str(path))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"safeserve: error: guard policy {path}: ")
    assert message in lines[0]


def test_a_real_server_serves_with_the_preset(server_factory, tmp_path: Path) -> None:
    """`serve --guard-policy`: /admin/config shows the preset's values, a flag given on the same
    command line beats the preset, and one INFO line says so."""
    preset = {
        "max_running_requests": 5,
        "chunked_prefill_size": 48,
        "dispatch_budget_tokens": 384,
        "prefill_sizing": "observed",
        "watchdog_stall_timeout": 12.5,
        "num_kv_blocks": 64,
    }
    path = tmp_path / "guards" / "tiny.toml"
    path.parent.mkdir()
    write_policy(path, preset, ["a test preset"])
    s = server_factory(
        ["--model", "tiny", "--guard-policy", str(path), "--num-kv-blocks", "48"], timeout=180
    )
    config = httpx.get(s.admin_url + "/admin/config", timeout=10).json()
    args = config["args"]
    assert args["guard_policy"] == str(path)
    for name, value in preset.items():
        if name != "num_kv_blocks":
            assert args[name] == value, name
    assert args["num_kv_blocks"] == 48  # the flag given wins
    guards = config["guards"]["0"]  # what the group's ranks sized from them
    assert guards["dispatch_budget_tokens"] == 384
    assert guards["prefill"]["mode"] == "observed" and guards["prefill"]["explicit_chunk"] == 48
    r = httpx.post(
        s.url + "/v1/completions",
        json={"model": "tiny", "prompt": [5] * 100, "max_tokens": 3, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    lines = [ln for ln in s.output().splitlines() if "guard policy" in ln]
    assert len(lines) == 1, s.output()[-3000:]
    assert " INFO " in lines[0]
    assert (
        "set max_running_requests=5, chunked_prefill_size=48, dispatch_budget_tokens=384"
        in (lines[0])
    )
    assert "overrode num_kv_blocks (preset 64, flag 48)" in lines[0]


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("doc", ["guards/README.md"])
def test_the_docs_name_every_key_and_their_example_reads(doc: str, tmp_path: Path) -> None:
    import re

    text = (ROOT / doc).read_text()
    missing = [k for k in POLICY_FIELDS if f"`{k}`" not in text]
    assert not missing, f"{doc} does not name {missing}"
    (example,) = re.findall(r"```toml\n(.*?)```", text, re.S)
    (tmp_path / "example.toml").write_text(example)
    assert read_policy(tmp_path / "example.toml")


def test_every_preset_in_guards_reads() -> None:
    for path in sorted((ROOT / "guards").glob("*.toml")):
        read_policy(path)
