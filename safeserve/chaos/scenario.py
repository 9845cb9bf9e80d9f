"""Chaos scenarios: a TOML file (data under the top-level `chaos/` folder) says what server to
run, what load to offer, which faults to inject when, and which goals the run must meet.

```toml
name = "kill-then-stall"
[server]                   # optional: without it, `safeserve chaos run --url` names the server
args = ["--num-groups", "2", "--max-running-requests", "8"]
[load]
concurrency = 16           # streams kept in flight (closed loop)
prompt_tokens = 64
max_tokens = 64
duration_s = 60
warmup_s = 5
[[faults]]
at_s = 20
action = "sigkill"         # see FAULT_ACTIONS
group = 0
rank = 1
[goals]
lost_max = 0
detect_kill_max_s = 2.0
```

`[load].mode` is `"closed"` (the default: `concurrency` clients, each sending its next request
when the last ends) or `"open"`: requests arrive as a Poisson process of `rate` requests/s
(inter-arrival times drawn from `seed`) whatever the server's answers, so a group that lost its
peer gets the whole rate and its goodput shows what it can carry.

`[slo]` sets `ttft_s` (arrival to first token) and `tpot_s` (mean time per output token after
the first); a request *meets the SLO* when it succeeded within both (an unset one always holds).
The report counts them overall, per group (the `X-Safeserve-Group` of its answer) and per fault
window; goals on them: `slo_goodput_min` (share of all requests), `survivor_slo_goodput_min`
(share of the other groups' requests in a fault's window). `rebalance_max_s`: after a signal
fault, the faulted group back READY must get within `share_tolerance` of an even share (1/groups)
of the requests started in some `share_window_s` window that ends within this many seconds.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

LOAD_MODES = ("closed", "open")
SIGNAL_ACTIONS = ("sigkill", "sigstop", "sigcont")
ENGINE_ACTIONS = ("route_skew", "slow_rank", "corrupt", "clear")  # POST /admin/faults
GROUP_ACTIONS = ("drain", "undrain", "restart")  # POST /admin/groups/{id}/{action}
# A completion that carries its own fault (`safeserve_fault`; needs --enable-fault-injection):
# "raise" must fail alone (500 internal_error), "exit" must end quarantined (422
# request_quarantined), and `repeat` identical requests after it must each be refused (422).
REQUEST_ACTIONS = {"request_raise": "raise", "request_exit": "exit"}
# Faults of a whole node (needs [nodes]): its agent's process tree, or its link to the frontend.
NODE_FAULTS = ("node_kill", "node_stop", "partition")
NODE_ACTIONS = NODE_FAULTS + ("heal",)
FAULT_ACTIONS = (
    SIGNAL_ACTIONS + ENGINE_ACTIONS + GROUP_ACTIONS + tuple(REQUEST_ACTIONS) + NODE_ACTIONS
)
# The goal that bounds each node fault's detection (seconds to LOST or a group out of READY).
NODE_DETECT_GOALS = {
    "node_kill": "detect_node_kill_max_s",
    "node_stop": "detect_node_stop_max_s",
    "partition": "detect_partition_max_s",
}
# Faults whose group is fenced and restarts: the report times its failure, READY and recovery.
FENCING_FAULTS = ("sigkill", "sigstop", "corrupt")
# Which watchdog verdict a fault must draw (a fault that draws none had no visible effect).
EXPECTED_VERDICT = {
    "sigkill": "dead",
    "sigstop": "stalled",
    "slow_rank": "slow",
    "corrupt": "corrupt",  # the canary's (needs --canary-interval-s)
}


class ScenarioError(ValueError):
    """The scenario file is wrong; the message names the file and the field."""


@dataclass
class ServerSpec:
    args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 600.0


@dataclass
class LoadSpec:
    mode: str = "closed"  # see LOAD_MODES
    rate: float | None = None  # open: requests per second (Poisson arrivals)
    seed: int = 0  # open: of the arrival times
    concurrency: int = 8  # closed: clients
    prompt_tokens: int = 32
    max_tokens: int = 32
    duration_s: float = 30.0
    warmup_s: float = 3.0
    ramp_s: float = 0.0  # client i starts at i/concurrency x ramp_s: no lock-step waves
    distinct_prompts: int = 8  # prompts cycle, so greedy outputs can be compared for consistency
    # after the load, with every group READY: each prompt sent once alone, its answer the
    # unfaulted reference that every completion of it is compared with (`reference_equal`)
    reference: bool = False
    request_timeout_s: float = 300.0


@dataclass
class SloSpec:
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass
class NodeSpec:
    """One node agent the runner starts (`safeserve node --devices ... --host ...`)."""

    devices: str = "0"  # its --devices: CUDA indices, or on CPU one rank slot each
    host: str = "127.0.0.1"  # its --host: where its ranks rendezvous (127.0.0.x: a "host")


@dataclass
class Fault:
    at_s: float
    action: str
    group: int = 0
    rank: int | None = None
    node: str | None = None  # node faults: the [nodes] id
    expert: int | None = None  # route_skew
    delay_s: float | None = None  # slow_rank
    repeat: int = 0  # request_exit: identical requests sent after it, each to be refused


@dataclass
class Goals:
    lost_max: int | None = 0
    failed_max: int | None = 0
    consistent_min: float | None = None  # share of completions equal to their prompt's usual one
    reference_equal_min: float | None = None  # share equal to their prompt's lone answer
    detect_kill_max_s: float | None = None
    detect_stall_max_s: float | None = None
    detect_corrupt_max_s: float | None = None  # a `corrupt` fault to the canary's verdict
    recover_max_s: float | None = None  # faulted group back at `recover_throughput` of baseline
    recover_throughput: float = 0.95
    survivor_goodput_min: float | None = None  # other groups' tokens/s during a fault ÷ baseline
    survivor_p99_tpot_max_increase: float | None = None  # e.g. 0.2 = at most +20 %
    group_failures_max: int | None = None  # failures the run may cause (0 for a no-crash run)
    dispatch_within_budget: bool = False  # every rank's received rows ≤ its admission budget
    # Within a group, the most any rank's peak memory grew during the run beyond the least any
    # grew: skew must not pile memory onto one rank (the receive side is preallocated).
    rank_memory_spread_max_gib: float | None = None
    slo_goodput_min: float | None = None  # share of all requests that met the [slo]
    survivor_slo_goodput_min: float | None = None  # of the other groups' requests, per fault
    rebalance_max_s: float | None = None  # READY again -> an even share of new requests
    detect_node_kill_max_s: float | None = None  # node_kill -> node LOST or a group not READY
    detect_node_stop_max_s: float | None = None  # node_stop -> likewise
    detect_partition_max_s: float | None = None  # partition -> likewise
    heal_ready_max_s: float | None = None  # heal -> every group READY
    share_window_s: float = 5.0
    share_tolerance: float = 0.1  # absolute, around 1/groups


@dataclass
class Scenario:
    name: str
    path: Path | None = None
    description: str = ""
    server: ServerSpec | None = None
    load: LoadSpec = field(default_factory=LoadSpec)
    faults: list[Fault] = field(default_factory=list)
    goals: Goals = field(default_factory=Goals)
    slo: SloSpec = field(default_factory=SloSpec)
    nodes: dict[str, NodeSpec] = field(default_factory=dict)  # empty: local placement


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ScenarioError(f"{where}: expected a table")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ScenarioError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
    for key, value in raw.items():
        raw[key] = _typed(str(known[key].type), value, f"{where}.{key}")
    try:
        return cls(**raw)
    except TypeError as e:
        raise ScenarioError(f"{where}: {e}") from None


def _typed(want: str, value: Any, where: str) -> Any:
    """Checks a value against its field's annotation (as written: `int | None`, `list[str]`...)."""
    if value is None and "None" in want:
        return value
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "list": isinstance(value, list),
    }
    base = want.split(" | ")[0].split("[")[0]
    if not ok.get(base, True):
        raise ScenarioError(f"{where}: expected {want}, got {value!r}")
    return float(value) if base == "float" else value


def parse(raw: dict[str, Any], path: Path | None = None) -> Scenario:
    where = str(path) if path else "scenario"
    raw = dict(raw)
    allowed = {"name", "description", "server", "load", "faults", "goals", "slo", "nodes"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ScenarioError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(allowed)})")
    name = raw.get("name") or (path.stem if path else "")
    if not isinstance(name, str) or not name:
        raise ScenarioError(f"{where}: name must be a non-empty string")
    server = None
    if "server" in raw:
        server = _build(ServerSpec, raw["server"], f"{where}: [server]")
        if not all(isinstance(a, str) for a in server.args):
            raise ScenarioError(f"{where}: [server].args must be a list of strings")
    load = _build(LoadSpec, raw.get("load", {}), f"{where}: [load]")
    goals = _build(Goals, raw.get("goals", {}), f"{where}: [goals]")
    slo = _build(SloSpec, raw.get("slo", {}), f"{where}: [slo]")
    faults = [
        _build(Fault, f, f"{where}: [[faults]] #{i + 1}")
        for i, f in enumerate(raw.get("faults", []))
    ]
    raw_nodes = raw.get("nodes", {})
    if not isinstance(raw_nodes, dict):
        raise ScenarioError(f"{where}: [nodes] must be a table of node id -> {{devices, host}}")
    nodes = {
        str(n): _build(
            NodeSpec, dict(spec) if isinstance(spec, dict) else spec, f"{where}: [nodes].{n}"
        )
        for n, spec in raw_nodes.items()
    }
    sc = Scenario(name, path, str(raw.get("description", "")), server, load, faults, goals, slo)
    sc.nodes = nodes
    validate(sc, where)
    return sc


def validate(sc: Scenario, where: str) -> None:
    ld = sc.load
    if ld.mode not in LOAD_MODES:
        raise ScenarioError(f"{where}: [load].mode must be one of {', '.join(LOAD_MODES)}")
    if ld.mode == "open" and (ld.rate is None or ld.rate <= 0):
        raise ScenarioError(f"{where}: [load].rate (requests/s) must be > 0 with mode = open")
    if ld.mode == "closed" and ld.rate is not None:
        raise ScenarioError(f"{where}: [load].rate is for mode = open (closed uses concurrency)")
    for name in ("ttft_s", "tpot_s"):
        v = getattr(sc.slo, name)
        if v is not None and v <= 0:
            raise ScenarioError(f"{where}: [slo].{name} must be > 0")
    gl = sc.goals
    if gl.share_window_s <= 0 or not 0 < gl.share_tolerance < 1:
        raise ScenarioError(
            f"{where}: [goals].share_window_s must be > 0 and share_tolerance in (0, 1)"
        )
    for key in ("concurrency", "prompt_tokens", "max_tokens", "distinct_prompts"):
        if getattr(ld, key) < 1:
            raise ScenarioError(f"{where}: [load].{key} must be at least 1")
    if sc.goals.reference_equal_min is not None and not ld.reference:
        raise ScenarioError(f"{where}: [goals].reference_equal_min needs [load].reference = true")
    if not 0 <= ld.warmup_s < ld.duration_s:
        raise ScenarioError(f"{where}: [load].warmup_s must be in [0, duration_s)")
    if not 0 <= ld.ramp_s <= ld.warmup_s:
        raise ScenarioError(f"{where}: [load].ramp_s must be in [0, warmup_s]")
    last = -1.0
    for i, f in enumerate(sc.faults):
        at = f"{where}: [[faults]] #{i + 1}"
        if f.action not in FAULT_ACTIONS:
            raise ScenarioError(f"{at}: action must be one of {', '.join(FAULT_ACTIONS)}")
        if not ld.warmup_s <= f.at_s < ld.duration_s:
            raise ScenarioError(f"{at}: at_s must be in [warmup_s, duration_s)")
        if f.at_s < last:
            raise ScenarioError(f"{at}: faults must be listed in time order")
        last = f.at_s
        if f.action in SIGNAL_ACTIONS + ("slow_rank", "corrupt") and f.rank is None:
            raise ScenarioError(f"{at}: {f.action} needs rank")
        if f.action == "route_skew" and f.expert is None:
            raise ScenarioError(f"{at}: route_skew needs expert")
        if f.action == "slow_rank" and f.delay_s is None:
            raise ScenarioError(f"{at}: slow_rank needs delay_s")
        if f.repeat < 0 or (f.repeat and f.action != "request_exit"):
            raise ScenarioError(f"{at}: repeat is a count >= 0, for request_exit only")
    _validate_nodes(sc, where)
    if not 0 < sc.goals.recover_throughput <= 1:
        raise ScenarioError(f"{where}: [goals].recover_throughput must be in (0, 1]")


_DEVICES = re.compile(r"^\s*\d+(-\d+)?(\s*,\s*\d+(-\d+)?)*\s*$")


def _validate_nodes(sc: Scenario, where: str) -> None:
    """[nodes] entries are well formed, and node faults name a node of it in a sensible order:
    a node is faulted once until it is healed, and `heal` follows a fault of its node."""
    for n, spec in sc.nodes.items():
        if not n or not _DEVICES.match(spec.devices):
            raise ScenarioError(
                f"{where}: [nodes].{n}: devices must look like 0-7 or 0,2,5, got {spec.devices!r}"
            )
        if not spec.host:
            raise ScenarioError(f"{where}: [nodes].{n}: host must be an address")
    if sc.nodes and sc.server is None:
        raise ScenarioError(f"{where}: [nodes] needs [server]: the run starts the agents")
    down: dict[str, str] = {}  # node -> its fault not healed yet
    for i, f in enumerate(sc.faults):
        at = f"{where}: [[faults]] #{i + 1}"
        if f.action not in NODE_ACTIONS:
            if f.node is not None:
                raise ScenarioError(
                    f"{at}: node is for the node faults ({', '.join(NODE_ACTIONS)})"
                )
            continue
        if f.node is None:
            raise ScenarioError(f"{at}: {f.action} needs node")
        if not sc.nodes:
            raise ScenarioError(f"{at}: {f.action} needs a [nodes] table (groups on node agents)")
        if f.node not in sc.nodes:
            raise ScenarioError(
                f"{at}: unknown node {f.node!r} (the [nodes] are {', '.join(sorted(sc.nodes))})"
            )
        if f.action == "heal":
            if f.node not in down:
                raise ScenarioError(
                    f"{at}: heal of node {f.node!r}, which no earlier node fault took down"
                )
            del down[f.node]
        elif f.node in down:
            raise ScenarioError(
                f"{at}: node {f.node!r} is already down ({down[f.node]}); heal it first"
            )
        else:
            down[f.node] = f.action


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except OSError as e:
        raise ScenarioError(f"{p}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{p}: not valid TOML: {e}") from None
    return parse(raw, p)
