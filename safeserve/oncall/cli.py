"""`safeserve oncall VERB NOUN`: the on-call engineer's view of a running server, through its
admin API (a thin client: every decision and check stays in the server).

    safeserve oncall get groups|ranks|nodes|suspects|quarantine [-o json]
    safeserve oncall describe group N | describe node NAME
    safeserve oncall drain|undrain|restart group N [--dry-run]
    safeserve oncall lift quarantine FINGERPRINT|--all [--dry-run]
    safeserve oncall runbook [NAME]

Exit codes: 0 done; 1 the server refused (e.g. 409: not in a state that allows it; 404: no such
group); 2 bad arguments or an unknown runbook; 3 no admin API answered.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_oncall_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--admin-url", help="the admin API (default: $SAFESERVE_ADMIN_URL or http://127.0.0.1:8001)"
    )
    p.add_argument("--admin-api-key", help="its Bearer key (default: $SAFESERVE_ADMIN_API_KEY)")
    sub = p.add_subparsers(dest="verb", required=True)
    get = sub.add_parser("get", help="one row per group, rank, suspect or quarantined request")
    get.add_argument("noun", choices=("groups", "ranks", "nodes", "suspects", "quarantine"))
    get.add_argument("-o", "--output", choices=("table", "json"), default="table")
    desc = sub.add_parser(
        "describe", help="a group (ranks, verdicts, events, runbooks) or a node agent"
    )
    desc.add_argument("noun", choices=("group", "node"))
    desc.add_argument("id", help="the group's number or the node's name")
    desc.add_argument("-o", "--output", choices=("table", "json"), default="table")
    for verb, text in (
        ("drain", "stop sending new requests to a group; in-flight ones finish"),
        ("undrain", "send new requests to a drained group again"),
        ("restart", "drain a group, then restart it (a FAILED one restarts at once)"),
    ):
        a = sub.add_parser(verb, help=text)
        a.add_argument("noun", choices=("group",))
        a.add_argument("id", type=int)
        a.add_argument(
            "--dry-run", action="store_true", help="ask the server whether it would; change nothing"
        )
        a.add_argument("-o", "--output", choices=("table", "json"), default="table")
    lift = sub.add_parser(
        "lift", help="admit requests identical to a quarantined one again (query of death)"
    )
    lift.add_argument("noun", choices=("quarantine",))
    lift.add_argument("fingerprint", nargs="?")
    lift.add_argument("--all", action="store_true", help="every quarantined fingerprint")
    lift.add_argument(
        "--dry-run", action="store_true", help="ask the server which it would lift; lift none"
    )
    lift.add_argument("-o", "--output", choices=("table", "json"), default="table")
    rb = sub.add_parser("runbook", help="list the runbooks, or print one")
    rb.add_argument("name", nargs="?")
    rb.add_argument(
        "--dir", type=Path, help="runbooks folder (default: $SAFESERVE_RUNBOOKS, ./runbooks)"
    )


def main(ns: argparse.Namespace) -> int:
    from safeserve.oncall import views
    from safeserve.oncall.client import AdminClient, Refused, Unreachable

    if ns.verb == "runbook":
        return _runbook(ns.name, ns.dir)
    if ns.verb == "lift" and (ns.fingerprint is None) == (not ns.all):
        print("safeserve oncall: error: give a FINGERPRINT or --all, not both", file=sys.stderr)
        return 2
    client = AdminClient(ns.admin_url, ns.admin_api_key)
    try:
        if ns.verb == "get" and ns.noun in ("suspects", "quarantine"):
            q = client.quarantine()
            if ns.output == "json":
                print(json.dumps(q, indent=1))
            else:
                table = views.suspects_table if ns.noun == "suspects" else views.quarantine_table
                print(table(q))
        elif ns.verb == "lift":
            r = client.lift(ns.fingerprint, ns.dry_run)
            print(json.dumps(r, indent=1) if ns.output == "json" else views.lift_lines(r))
        elif ns.verb == "get" and ns.noun == "nodes":
            view = client.nodes()
            print(json.dumps(view, indent=1) if ns.output == "json" else views.nodes_table(view))
        elif ns.verb == "describe" and ns.noun == "node":
            view = client.nodes()
            if not any(n["id"] == ns.id for n in view["nodes"]):
                names = sorted(n["id"] for n in view["nodes"])
                raise Refused(404, f"no node {ns.id!r}; nodes are {names}")
            if ns.output == "json":
                print(json.dumps(next(n for n in view["nodes"] if n["id"] == ns.id), indent=1))
            else:
                print(views.describe_node(view, ns.id, client.groups()))
        elif ns.verb == "get":
            groups = client.groups()
            if ns.output == "json":
                print(json.dumps(groups, indent=1))
            else:
                print(
                    views.groups_table(groups) if ns.noun == "groups" else views.ranks_table(groups)
                )
        elif ns.verb == "describe":
            if not ns.id.isdigit():
                print(
                    f"safeserve oncall: error: a group is a number, got {ns.id!r}", file=sys.stderr
                )
                return 2
            gid = int(ns.id)
            groups = client.groups()
            g = next((x for x in groups if x["id"] == gid), None)
            if g is None:
                ids = sorted(x["id"] for x in groups)
                raise Refused(404, f"no group {gid}; groups are {ids}")
            print(
                json.dumps(g, indent=1) if ns.output == "json" else views.describe_group(g, groups)
            )
        else:
            r = client.act(ns.id, ns.verb, ns.dry_run)
            if ns.output == "json":
                print(json.dumps(r, indent=1))
            else:
                print(_act_line(ns.verb, ns.dry_run, r))
    except Refused as e:
        print(f"safeserve oncall: error: {e}", file=sys.stderr)
        return 1
    except Unreachable as e:
        print(f"safeserve oncall: error: {e}", file=sys.stderr)
        return 3
    return 0


# States a group passes through on its way to where an action takes it.
_UNDER_WAY = ("DRAINING", "RESTARTING", "STARTING")
_STARTS = "a new incarnation is starting; it takes requests again once READY"
_NEXT = {
    ("drain", "DRAINING"): "DRAINED once its in-flight requests finish",
    ("restart", "DRAINING"): "it restarts once its in-flight requests finish",
    ("restart", "RESTARTING"): _STARTS,
    ("restart", "STARTING"): _STARTS,
    ("restart", "FAILED"): _STARTS,
}


def _act_line(verb: str, dry_run: bool, r: dict) -> str:
    """One line for a drain/undrain/restart answer: what was asked and where the group stands.
    A group still on its way (draining its in-flight requests, restarting) is said to be so,
    with how to follow it, not "done"."""
    others = ", ".join(map(str, r["other_ready_groups"])) or "none"
    state = f"now {r['state']}, {r['in_flight']} in flight; other READY groups: {others}"
    if dry_run:
        return f"group {r['group']} would {verb} ({state})"
    # A restart of a FAILED group is under way even if a server answered before it moved on.
    if r["state"] in _UNDER_WAY or (verb == "restart" and r["state"] == "FAILED"):
        nxt = _NEXT.get((verb, r["state"]))
        return (
            f"group {r['group']} {verb}: under way ({state}){'; ' + nxt if nxt else ''}; follow "
            f"it with `safeserve oncall get groups` or `safeserve oncall describe group "
            f"{r['group']}`"
        )
    return f"group {r['group']} {verb}: done ({state})"


def _runbook(name: str | None, folder: Path | None) -> int:
    from safeserve.oncall.views import find_runbooks, runbook_title, table

    d = find_runbooks(folder)
    if d is None:
        print("safeserve oncall: error: no runbooks folder found (give --dir)", file=sys.stderr)
        return 2
    books = {p.stem: p for p in sorted(d.glob("*.md")) if p.stem.lower() != "readme"}
    if name is None:
        print(table(["RUNBOOK", "TITLE"], [[k, runbook_title(p)] for k, p in books.items()]))
        return 0
    if name not in books:
        print(
            f"safeserve oncall: error: no runbook {name!r}; runbooks are {', '.join(books)}",
            file=sys.stderr,
        )
        return 2
    print(books[name].read_text().rstrip())
    return 0
