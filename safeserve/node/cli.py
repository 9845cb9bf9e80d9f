"""`safeserve node` (the agent of one machine) and `safeserve keys` (a CurveZMQ key directory)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from safeserve.wire import keys

if TYPE_CHECKING:
    from safeserve.node.agent import NodeOptions


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
    span = p.add_argument_group(
        "groups that span agents (the frontend's --nnodes)",
        "A frontend started with --nnodes N places each group on N agents of one set, its k-th "
        "block of ranks on the agent with --node-rank k: rank 0 (the leader) on node-rank 0, "
        "whose --dist-init-addr is the group's rendezvous. On a LeaderWorkerSet: --nnodes "
        "$(LWS_GROUP_SIZE) --node-rank $(LWS_WORKER_INDEX) --dist-init-addr "
        "$(LWS_LEADER_ADDRESS):PORT.",
    )
    span.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this agent's place in its set, 0..N-1 (default: none; such an agent takes no "
        "group of a frontend with --nnodes above 1)",
    )
    span.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="how many agents its set holds, checked against --node-rank here and against "
        "the frontend's --nnodes there (default: not checked)",
    )
    span.add_argument(
        "--dist-init-addr",
        default=None,
        help="HOST:PORT where the ranks of a group whose rank 0 runs here meet (torch."
        "distributed's TCP store, listening on PORT here; PORT+1, ... for further groups led "
        "here at once); give every agent of a set the same one, as peers' nodes are (default: "
        "--host and a free port)",
    )
    span.add_argument(
        "--node-set",
        default=None,
        help="the set's name: agents with the same one form a set (default: --dist-init-addr, "
        "else one unnamed set)",
    )


def node_options(ns: argparse.Namespace) -> NodeOptions:
    """The agent's options from its flags; ValueError (one line) for a bad one."""
    from safeserve.node.agent import NodeOptions, parse_addr, parse_devices

    devices = parse_devices(ns.devices)
    parse_addr(ns.frontend, "--frontend")
    if ns.node_rank is not None and ns.node_rank < 0:
        raise ValueError(f"--node-rank must be 0 or more, got {ns.node_rank}")
    if ns.nnodes is not None:
        if ns.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {ns.nnodes}")
        if ns.node_rank is None:
            raise ValueError("--nnodes needs --node-rank (this agent's place among them)")
        if ns.node_rank >= ns.nnodes:
            raise ValueError(
                f"--node-rank {ns.node_rank} is not below --nnodes {ns.nnodes} (ranks 0..N-1)"
            )
    dist = None if ns.dist_init_addr is None else parse_addr(ns.dist_init_addr, "--dist-init-addr")
    if ns.node_set is not None and not ns.node_set.strip():
        raise ValueError("--node-set must not be empty")
    return NodeOptions(
        ns.frontend,
        ns.node_id or socket.gethostname(),
        ns.host,
        devices,
        ns.curve_keys_dir,
        ns.insecure,
        node_set=ns.node_set if ns.node_set is not None else ns.dist_init_addr,
        node_rank=ns.node_rank,
        nnodes=ns.nnodes,
        dist_init_addr=dist,
    )


def run_node(ns: argparse.Namespace) -> int:
    from safeserve.node.agent import Agent

    logging.basicConfig(
        level=ns.log_level.upper(),
        format="%(asctime)s [node] %(levelname)s %(message)s",
    )
    try:
        opts = node_options(ns)
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
    agent = Agent(opts)

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
