"""`safeserve chaos run SCENARIO` and `safeserve chaos list [DIR]`.

Exit codes: 0 every goal met; 1 a goal missed; 2 a bad scenario or bad arguments; 3 the server
could not be started or reached.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from safeserve.chaos.scenario import Scenario
    from safeserve.config import ServerArgs

DEFAULT_DIR = Path("chaos")


def add_chaos_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="chaos_command", required=True)
    run = sub.add_parser("run", help="run one scenario and report what held")
    run.add_argument("scenario", help="a scenario file (TOML), e.g. chaos/kill-then-stall.toml")
    run.add_argument(
        "--url",
        help="an already running server (same host: signals go to its ranks' pids); "
        "default: start one with the scenario's [server].args",
    )
    run.add_argument("--admin-url", help="its admin API (default: --url's port + 1)")
    run.add_argument("--api-key", help="Bearer key of the public API")
    run.add_argument("--admin-api-key", help="Bearer key of the admin API")
    run.add_argument(
        "--server-args",
        default="",
        help="extra `safeserve serve` arguments appended to the scenario's (one shell string)",
    )
    run.add_argument("--server-log", type=Path, help="where the started server logs")
    run.add_argument("--json", type=Path, help="write the whole report (timeline included) here")
    run.add_argument("-o", "--output", choices=("table", "json"), default="table")
    ls = sub.add_parser("list", help="list the scenarios of a folder")
    ls.add_argument("dir", nargs="?", type=Path, default=DEFAULT_DIR)
    ls.add_argument("-o", "--output", choices=("table", "json"), default="table")


def _admin_url(url: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.port is None:
        raise ValueError(f"--url {url} has no port: give --admin-url")
    netloc = f"{parts.hostname}:{parts.port + 1}"
    return urlunsplit((parts.scheme, netloc, "", "", ""))


def check_server_args(args: list[str], what: str = "[server].args") -> ServerArgs:
    """The settings `safeserve serve` would run with `args`; ValueError (naming them `what`)
    where it would refuse them. A scenario's `[server].args` are checked before any run."""
    from safeserve.config import ConfigError
    from safeserve.config_cli import add_server_args, server_args_from

    parser = argparse.ArgumentParser(prog="safeserve serve", add_help=False)
    add_server_args(parser)
    try:
        ns, unknown = parser.parse_known_args(args)
    except SystemExit:
        raise ValueError(f"{what} are not valid `safeserve serve` arguments: {args}") from None
    if unknown:
        raise ValueError(f"{what}: unknown `safeserve serve` argument {unknown[0]!r}")
    try:
        return server_args_from(ns)
    except ConfigError as e:
        raise ValueError(f"{what}: {e}") from None


def _remote_args(sc: Scenario) -> list[str]:
    """What the runner adds to a [nodes] scenario's server arguments, as the checks see them
    (the key directory and port are made at run time; these stand for them)."""
    if not sc.nodes:
        return []
    return ["--placement", "remote", "--curve-keys-dir", "keys", "--node-port", "8002"]


def main(ns: argparse.Namespace) -> int:
    from safeserve.chaos.scenario import ScenarioError, load_scenario
    from safeserve.config_cli import check_output_file

    if ns.chaos_command == "list":
        return _list(ns.dir, ns.output)
    try:
        sc = load_scenario(ns.scenario)
        if ns.url is None and sc.server is None:
            raise ScenarioError(f"{ns.scenario}: no [server] table: give --url of a running server")
        if ns.url is not None and sc.nodes:
            raise ScenarioError(
                f"{ns.scenario}: a scenario with [nodes] starts its own server and agents; "
                "drop --url"
            )
        admin_url = ns.admin_url or (_admin_url(ns.url) if ns.url else None)
        if ns.url is None:
            check_server_args(
                [*sc.server.args, *shlex.split(ns.server_args), *_remote_args(sc)]  # type: ignore[union-attr]
            )
        check_output_file(ns.json, "--json")
    except (ScenarioError, ValueError) as e:
        print(f"safeserve chaos: error: {e}", file=sys.stderr)
        return 2
    import httpx

    from safeserve.chaos.report import as_json, dump, render
    from safeserve.chaos.runner import ServerStartError, run_scenario

    try:
        report = run_scenario(
            sc,
            ns.url,
            admin_url,
            ns.api_key,
            ns.admin_api_key,
            ns.server_log,
            shlex.split(ns.server_args),
        )
    except (ServerStartError, httpx.HTTPError) as e:
        print(f"safeserve chaos: error: {e}", file=sys.stderr)
        return 3
    if ns.json:
        dump(report, ns.json)
    print(as_json(report) if ns.output == "json" else render(report))
    return 0 if report["ok"] else 1


def _list(folder: Path, output: str) -> int:
    from safeserve.chaos.scenario import ScenarioError, load_scenario

    rows, bad = [], 0
    for path in sorted(folder.glob("*.toml")):
        try:
            sc = load_scenario(path)
            if sc.server is not None:
                check_server_args([*sc.server.args, *_remote_args(sc)])
        except (ScenarioError, ValueError) as e:
            msg = str(e) if str(path) in str(e) else f"{path}: {e}"
            print(f"safeserve chaos: error: {msg}", file=sys.stderr)
            bad += 1
            continue
        faults = ", ".join(f"{f.action}@{f.at_s:g}s" for f in sc.faults) or "-"
        rows.append(
            {"name": sc.name, "path": str(path), "faults": faults, "description": sc.description}
        )
    if output == "json":
        print(json.dumps(rows, indent=1))
    else:
        width = max([4, *(len(r["name"]) for r in rows)])
        print(f"{'NAME':<{width}}  FAULTS")
        for r in rows:
            print(f"{r['name']:<{width}}  {r['faults']}")
    return 2 if bad else 0
