"""`safeserve node` (the agent of one machine) and `safeserve keys` (a CurveZMQ key directory)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from safeserve.wire import keys


def add_node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--frontend",
        required=True,
        help="HOST:PORT of the frontend's node port (its --node-host/--node-port)",
    )
    p.add_argument(
        "--devices",
        default="0",
        help="devices this node offers: 0-7, 0,2,5 (CUDA indices; on a CPU-only deployment "
        "each entry is one rank's slot) (default: 0)",
    )
    p.add_argument("--node-id", default=None, help="this node's name (default: the host name)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address of this node that other nodes reach its ranks at (the rendezvous of "
        "a group whose rank 0 runs here) (default: 127.0.0.1)",
    )
    p.add_argument(
        "--curve-keys-dir",
        default=os.environ.get("SAFESERVE_CURVE_KEYS_DIR"),
        help="directory with node.key_secret and frontend.key (`safeserve keys DIR`); also "
        "read from $SAFESERVE_CURVE_KEYS_DIR",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="connect without CurveZMQ keys (the frontend must run with --insecure-nodes)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run_node(ns: argparse.Namespace) -> int:
    from safeserve.node.agent import Agent, NodeOptions, parse_devices

    logging.basicConfig(
        level=ns.log_level.upper(),
        format="%(asctime)s [node] %(levelname)s %(message)s",
    )
    try:
        devices = parse_devices(ns.devices)
    except ValueError as e:
        print(f"safeserve node: error: {e}", file=sys.stderr)
        return 2
    if not ns.curve_keys_dir and not ns.insecure:
        print(
            "safeserve node: error: --curve-keys-dir (or $SAFESERVE_CURVE_KEYS_DIR) is needed, "
            "or --insecure to connect without authentication",
            file=sys.stderr,
        )
        return 2
    if ns.curve_keys_dir:
        try:
            keys.load(Path(ns.curve_keys_dir), keys.NODE)
        except keys.KeyError_ as e:
            print(f"safeserve node: error: {e}", file=sys.stderr)
            return 2
    else:
        logging.getLogger("safeserve").warning(
            "--insecure: talking to %s without authentication or encryption", ns.frontend
        )
    host, _, port = ns.frontend.rpartition(":")
    if not host or not port.isdigit():
        print(f"safeserve node: error: --frontend must be HOST:PORT, got {ns.frontend!r}")
        return 2
    agent = Agent(
        NodeOptions(
            ns.frontend,
            ns.node_id or socket.gethostname(),
            ns.host,
            devices,
            ns.curve_keys_dir,
            ns.insecure,
        )
    )

    def stop(signum: int, frame: object) -> None:
        agent.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    agent.run()
    return 0


def add_keys_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="directory to write the keys into (made if missing)")


def run_keys(ns: argparse.Namespace) -> int:
    d = Path(ns.dir)
    if (d / "frontend.key_secret").exists():
        print(f"safeserve keys: error: {d} already holds keys; not overwritten", file=sys.stderr)
        return 2
    keys.generate(d)
    print(
        f"wrote {d}/frontend.key(_secret), {d}/node.key(_secret) and {d}/authorized/node.key:\n"
        f"  frontend: --curve-keys-dir {d} (needs frontend.key_secret and authorized/)\n"
        f"  nodes:    --curve-keys-dir {d} (needs node.key_secret and frontend.key)"
    )
    return 0
