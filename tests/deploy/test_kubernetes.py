"""deploy/kubernetes: the manifests against the code they run. Every manifest parses (and
`kubectl kustomize` renders them where kubectl is installed); the frontend's `safeserve serve`
and the agents' `safeserve node` argument lists parse with their own parsers, flag for flag
(no abbreviations: a renamed flag fails here), and the serve flags pass `ServerArgs`' checks and
the layout checks of the model they name; every probe path is a route of the app; the container,
Service and probe ports are the flags' ports; the key Secrets, made as README.md says from
`safeserve keys DIR` and projected as the volumes' items say, are what each end loads at
--curve-keys-dir; nvidia.com/gpu equals the --devices an agent offers, and the agents offer
the devices the groups need; an LWS replica is one set of agents a group spans (the agents'
--nnodes, --node-rank and --dist-init-addr from the variables LWS sets, its size the frontend's
--nnodes); the agents' liveness probe fails without an agent process.

PyYAML is no dependency of safeserve (transformers, huggingface_hub and schemathesis, test
extras, require it): the tests skip without it."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from safeserve.config import LOOPBACK_HOSTS, ServerArgs
from safeserve.config_cli import add_server_args, server_args_from

yaml = pytest.importorskip("yaml", reason="PyYAML not installed (transformers' dependency)")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
README = K8S / "README.md"
GPU = "nvidia.com/gpu"
# What the downward API gives an agent pod, as example values: $(VAR) in args expands to these.
FIELD_EXAMPLES = {"metadata.name": "safeserve-agents-0-1", "status.podIP": "10.0.3.7"}
LWS_API = "leaderworkerset.x-k8s.io/v1"
# What the LWS controller adds to the env of every container of an LWS pod (LWS_GROUP_SIZE is
# the LWS's `size`), as example values of the pod above.
LWS_ENV_EXAMPLES = {
    "LWS_LEADER_ADDRESS": "safeserve-agents-0.safeserve-agents.default",
    "LWS_WORKER_INDEX": "1",
}


# -- loading ------------------------------------------------------------------------------------
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def load_docs() -> list[dict]:
    docs = []
    for name in kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    return docs


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def frontend_pod(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]


def agent_pods(docs: list[dict]) -> list[dict]:
    """The pod templates of the agents: the worker template, and the leader's if given."""
    lwt = one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    return [lwt["workerTemplate"], *([lwt["leaderTemplate"]] if "leaderTemplate" in lwt else [])]


def container(pod: dict) -> dict:
    (c,) = pod["spec"]["containers"]
    return c


def expanded(c: dict, injected: dict[str, str] | None = None) -> list[str]:
    """The container's args with $(VAR) expanded as Kubernetes does, from its env (downward
    API fields as FIELD_EXAMPLES) and the variables a controller adds to it (`injected`); a
    $(VAR) with neither fails."""
    env = dict(injected or {})
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = FIELD_EXAMPLES[e["valueFrom"]["fieldRef"]["fieldPath"]]

    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) in args but not in env of {c['name']}"
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, str(a)) for a in c["args"]]


def env_source(c: dict, flag: str) -> str | None:
    """The downward-API field a flag's value comes from ($(VAR) with VAR a fieldRef)."""
    args = [str(a) for a in c["args"]]
    value = args[args.index(flag) + 1]
    m = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value)
    if m is None:
        return None
    for e in c.get("env", []):
        if e["name"] == m.group(1):
            return e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    return None


def strict_parse(
    add_args: Callable[[argparse.ArgumentParser], None], argv: list[str], what: str
) -> argparse.Namespace:
    """`argv` through a parser of exactly these flags, no abbreviations (a renamed flag must not
    pass as the prefix of its new name)."""
    p = argparse.ArgumentParser(prog=what, allow_abbrev=False, exit_on_error=False)
    add_args(p)
    known = set(p._option_string_actions)  # argparse keeps no public accessor for these
    for token in argv:
        if token.startswith("--"):
            assert token.split("=", 1)[0] in known, f"{what}: {token} is no flag of {what}"
    try:
        return p.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise AssertionError(f"{what} {shlex.join(argv)}: {e}") from None


def serve_args(docs: list[dict]) -> ServerArgs:
    c = container(frontend_pod(docs))
    assert c["command"] == ["safeserve", "serve"], c["command"]
    return server_args_from(strict_parse(add_server_args, expanded(c), "safeserve serve"))


def lws_env(docs: list[dict]) -> dict[str, str]:
    """The variables LWS adds to its pods' containers, as examples."""
    size = one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["size"]
    return {**LWS_ENV_EXAMPLES, "LWS_GROUP_SIZE": str(size)}


def node_args(pod: dict, docs: list[dict]) -> argparse.Namespace:
    from safeserve.node.cli import add_node_args

    c = container(pod)
    assert c["command"] == ["safeserve", "node"], c["command"]
    return strict_parse(add_node_args, expanded(c, lws_env(docs)), "safeserve node")


def container_port(c: dict, port: int | str) -> int:
    """A probe's or Service's target port (a number, or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    (p,) = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    return p


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def volume_at(pod: dict, path: str) -> tuple[dict, dict]:
    """(volume mount, volume) of the container mounting exactly `path`."""
    mounts = [m for m in container(pod)["volumeMounts"] if m["mountPath"] == path]
    assert len(mounts) == 1, f"{container(pod)['name']}: no one volume mounted at {path}"
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == mounts[0]["name"]]
    return mounts[0], vol


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return load_docs()


# -- the files ----------------------------------------------------------------------------------
def test_kustomization_names_every_manifest_and_they_parse(docs: list[dict]) -> None:
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization()["resources"]) == files
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), d
        assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "safeserve", d["kind"]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "Deployment",
            "LeaderWorkerSet",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "Service",
            "Service",
        ]
    )
    assert one(docs, "LeaderWorkerSet")["apiVersion"] == LWS_API
    # one image name for every container, which kustomization.yaml's `images` sets
    images = {container(p)["image"] for p in [frontend_pod(docs), *agent_pods(docs)]}
    assert images == {i["name"] for i in kustomization()["images"]}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_kustomize_renders_with_the_image_set() -> None:
    r = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    rendered = list(yaml.safe_load_all(r.stdout))
    (image,) = kustomization()["images"]
    want = f"{image['newName']}:{image['newTag']}"
    pods = [frontend_pod(rendered), *agent_pods(rendered)]
    assert {container(p)["image"] for p in pods} == {want}


# -- the flags ----------------------------------------------------------------------------------
def test_serve_flags_are_real_and_valid(docs: list[dict]) -> None:
    from safeserve.cli import build_parser

    args = serve_args(docs)  # flag for flag first: its failure names the flag
    args.validate()
    c = container(frontend_pod(docs))
    assert build_parser(["serve"]).parse_args(["serve", *expanded(c)]).command == "serve"
    assert args.placement == "remote" and not args.insecure_nodes
    assert args.curve_keys_dir and args.host == "0.0.0.0" and args.node_host == "0.0.0.0"
    assert args.admin_host in LOOPBACK_HOSTS or args.admin_api_key


def test_serve_layout_fits_the_model_it_names(docs: list[dict]) -> None:
    """Where kernels/configs holds the config of the model the frontend serves (its
    directory's name, lower case), every rank's layout passes the checks `safeserve serve`
    runs before starting (heads, experts and intermediate sizes divide)."""
    from safeserve.model.checkpoint import load_model_config
    from safeserve.model.registry import check_layout
    from safeserve.parallel.layout import Layout

    args = serve_args(docs)
    config = ROOT / "kernels" / "configs" / Path(args.model).name.lower()
    if not (config / "config.json").is_file():
        pytest.skip(f"no config of {args.model} in kernels/configs")
    cfg = load_model_config(str(config), args.quantization)
    for rank in range(args.tp_size):
        check_layout(cfg, Layout(rank, args.tp_size, args.ep_size, args.enable_dp_attention))


def test_node_flags_are_real_and_valid(docs: list[dict]) -> None:
    from safeserve.cli import build_parser
    from safeserve.node.agent import parse_devices
    from safeserve.node.cli import node_options

    services = [d for d in docs if d["kind"] == "Service"]
    front = container(frontend_pod(docs))
    node_port = serve_args(docs).node_port
    for pod in agent_pods(docs):
        c = container(pod)
        ns = node_args(pod, docs)  # flag for flag first: its failure names the flag
        argv = ["node", *expanded(c, lws_env(docs))]
        assert build_parser(["node"]).parse_args(argv).command == "node"
        assert parse_devices(ns.devices) and not ns.insecure and ns.curve_keys_dir
        opts = node_options(ns)  # the agent's own checks (it exits 2 on a bad value)
        # the node id is the pod's name, the address its ranks are reached at the pod's IP
        assert env_source(c, "--node-id") == "metadata.name"
        assert env_source(c, "--host") == "status.podIP"
        # its place in its LWS replica (the set of agents a group spans), from LWS's
        # variables: the set's size, the pod's index, the rendezvous on the leader pod (which
        # also names the set, one per replica)
        args = [str(a) for a in c["args"]]
        assert args[args.index("--nnodes") + 1] == "$(LWS_GROUP_SIZE)"
        assert args[args.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
        assert args[args.index("--dist-init-addr") + 1].startswith("$(LWS_LEADER_ADDRESS):")
        assert "--node-set" not in args
        assert opts.node_set == ns.dist_init_addr and opts.dist_init_addr is not None
        assert opts.dist_init_addr[0] == LWS_ENV_EXAMPLES["LWS_LEADER_ADDRESS"]
        # --frontend: a Service of the frontend, at the port that leads to --node-port
        host, _, port = ns.frontend.rpartition(":")
        (svc,) = [s for s in services if host.split(".")[0] == s["metadata"]["name"]]
        (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
        assert container_port(front, sp["targetPort"]) == node_port, (ns.frontend, sp)


# -- ports and probes ---------------------------------------------------------------------------
def test_ports_are_the_flags_ports(docs: list[dict]) -> None:
    args = serve_args(docs)
    pod = frontend_pod(docs)
    c = container(pod)
    ports = {p["containerPort"] for p in c["ports"]}
    admin = args.admin_port_effective
    if args.admin_host in LOOPBACK_HOSTS:
        # loopback: the admin API is reached with kubectl exec / port-forward, not a port
        assert ports == {args.port, args.node_port}
    else:
        assert ports == {args.port, args.node_port, admin}
        env = {e["name"]: e for e in c.get("env", [])}
        assert "secretKeyRef" in env["SAFESERVE_ADMIN_API_KEY"]["valueFrom"]
    targets = {}
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert labels_match(svc["spec"]["selector"], pod["metadata"]["labels"])
        for p in svc["spec"]["ports"]:
            target = container_port(c, p.get("targetPort", p["port"]))
            assert target in ports, (svc["metadata"]["name"], p)
            targets[target] = svc
    assert set(targets) == ports - {admin}, "every port but the admin API's has a Service"
    nodes = targets[args.node_port]["spec"]
    # agents must reach a frontend that is not ready yet (it turns ready through them), and a
    # address that stays when the frontend's pod is replaced (no headless Service)
    assert nodes.get("publishNotReadyAddresses") is True
    assert nodes.get("clusterIP") != "None"
    assert targets[args.port] is not targets[args.node_port]
    notes = pod["metadata"].get("annotations", {})
    if "prometheus.io/port" in notes:
        assert int(notes["prometheus.io/port"]) == args.port


def test_probe_paths_are_routes_of_the_app(docs: list[dict]) -> None:
    """Startup: the process answers (/health); readiness: a group is READY (/ready); liveness:
    /health, never /health/generate (a forward pass). Each a route of the app on --port."""
    from safeserve.server.app import build_app

    routes = {getattr(r, "path", None) for r in build_app(ServerArgs()).routes}
    args = serve_args(docs)
    c = container(frontend_pod(docs))
    want = {"startupProbe": "/health", "readinessProbe": "/ready", "livenessProbe": "/health"}
    for probe, path in want.items():
        get = c[probe]["httpGet"]
        assert get["path"] == path and path in routes, (probe, get, sorted(routes))
        assert container_port(c, get["port"]) == args.port, (probe, get)
    notes = frontend_pod(docs)["metadata"].get("annotations", {})
    if "prometheus.io/path" in notes:
        assert notes["prometheus.io/path"] in routes
    for pod in agent_pods(docs):
        agent = container(pod)
        assert "livenessProbe" in agent and "exec" in agent["livenessProbe"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "httpGet" not in agent.get(probe, {}), "the agent has no HTTP port"


def _probe_code(docs: list[dict]) -> str:
    (pod, *_) = agent_pods(docs)
    cmd = container(pod)["livenessProbe"]["exec"]["command"]
    assert cmd[:2] == ["python3", "-c"] and len(cmd) == 3, cmd
    return cmd[2]


def test_agent_liveness_probe_fails_without_an_agent_process(docs: list[dict]) -> None:
    code = _probe_code(docs)

    def probe() -> int:
        return subprocess.run([sys.executable, "-c", code], timeout=30).returncode

    assert probe() == 1  # no `safeserve node` here (nor does the probe match itself)
    # a process whose argv is the console script's: python .../bin/safeserve node ...
    argv = [sys.executable, "-c", "import time; time.sleep(60)", "/usr/local/bin/safeserve"]
    agent = subprocess.Popen([*argv, "node", "--frontend", "safeserve-nodes:8002"])
    try:
        deadline = time.monotonic() + 10
        while probe() != 0:
            assert time.monotonic() < deadline, "the probe never saw the agent"
            time.sleep(0.1)
    finally:
        agent.kill()
        agent.wait()
    assert probe() == 1


# -- keys, devices, the model -------------------------------------------------------------------
def readme_secrets() -> dict[str, dict[str, str]]:
    """{Secret: {key: file in the key directory}} of README.md's `kubectl create secret
    generic NAME --from-file=...` commands (a file's key is its base name)."""
    text = README.read_text().replace("\\\n", " ")
    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        words = line.split()
        if words[:4] != ["kubectl", "create", "secret", "generic"]:
            continue
        files = {}
        for w in words[5:]:
            if w.startswith("--from-file="):
                key, _, path = w.removeprefix("--from-file=").rpartition("=")
                rel = Path(*Path(path).parts[1:])  # under the key directory `safeserve keys` made
                files[key or rel.name] = str(rel)
        out[words[4]] = files
    return out


def test_key_secrets_give_each_end_what_it_loads(docs: list[dict], tmp_path: Path) -> None:
    """A key directory from `safeserve keys`, made into the Secrets as README.md says and
    projected as each pod's volume says, at --curve-keys-dir: the frontend loads its keys, an
    agent its; neither gets the other's secret key."""
    from safeserve.wire import keys

    made = tmp_path / "keys"
    keys.generate(made)
    secrets = readme_secrets()
    ends = [(frontend_pod(docs), serve_args(docs).curve_keys_dir, keys.FRONTEND, keys.NODE)]
    ends += [
        (p, node_args(p, docs).curve_keys_dir, keys.NODE, keys.FRONTEND) for p in agent_pods(docs)
    ]
    names = set()
    for i, (pod, keys_dir, role, other) in enumerate(ends):
        mount, vol = volume_at(pod, keys_dir)
        assert mount.get("readOnly") is True
        name = vol["secret"]["secretName"]
        names.add((role, name))
        assert name in secrets, f"README.md makes no Secret {name}"
        view = tmp_path / f"pod{i}"
        for item in vol["secret"]["items"]:
            target = view / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(made / secrets[name][item["key"]], target)
        keys.load(view, role)
        assert not (view / f"{other}.key_secret").exists(), (role, name)
    roles = {role: {n for r, n in names if r == role} for role, _ in names}
    assert not roles[keys.FRONTEND] & roles[keys.NODE], "one Secret for both ends"


def test_gpus_match_devices_and_groups(docs: list[dict]) -> None:
    from safeserve.node.agent import parse_devices

    args = serve_args(docs)
    lws = one(docs, "LeaderWorkerSet")["spec"]
    offered = 0
    for pod in agent_pods(docs):
        res = container(pod)["resources"]
        n = len(parse_devices(node_args(pod, docs).devices))
        assert int(res["requests"][GPU]) == int(res["limits"][GPU]) == n, res
        offered = n
    pods = lws["replicas"] * lws["leaderWorkerTemplate"]["size"]
    # every group placed; more would be spare devices for a failed group
    assert pods * offered >= args.num_groups * args.tp_size
    size = lws["leaderWorkerTemplate"]["size"]
    assert size * offered == args.tp_size, "an LWS replica is sized as one EP group"
    assert args.nnodes == size, "a group spans the pods of one LWS replica"
    res = container(frontend_pod(docs)).get("resources", {})
    assert GPU not in {**res.get("requests", {}), **res.get("limits", {})}, (
        "the frontend needs none"
    )


def test_model_path_is_mounted_alike_on_the_frontend_and_the_agents(docs: list[dict]) -> None:
    """The ranks load the frontend's --model path on the agents."""
    model = Path(serve_args(docs).model)
    claims = set()
    for pod in [frontend_pod(docs), *agent_pods(docs)]:
        mounts = [m for m in container(pod)["volumeMounts"] if model.is_relative_to(m["mountPath"])]
        assert mounts, f"{model} is on no volume of {container(pod)['name']}"
        _, vol = volume_at(pod, mounts[0]["mountPath"])
        claims.add((mounts[0]["mountPath"], vol["persistentVolumeClaim"]["claimName"]))
    assert len(claims) == 1, claims
    (_, claim), pvc = claims.pop(), one(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == claim


# -- disruptions and restarts -------------------------------------------------------------------
def test_agents_restart_alone_and_are_evicted_one_at_a_time(docs: list[dict]) -> None:
    lwt = one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    assert lwt["restartPolicy"] == "None"
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    sel = pdb["spec"]["selector"]["matchLabels"]
    for pod in agent_pods(docs):
        assert labels_match(sel, pod["metadata"]["labels"])
    assert not labels_match(sel, frontend_pod(docs)["metadata"]["labels"])
    assert pdb["spec"]["maxUnavailable"] == 1
    deploy = one(docs, "Deployment")["spec"]
    assert deploy["replicas"] == 1 and deploy["strategy"]["type"] == "Recreate"


def test_readme_explains_the_timeouts_set(docs: list[dict]) -> None:
    text = README.read_text()
    for flag in ("--node-lease-s", "--node-wait-s", "--watchdog-stall-timeout"):
        assert flag in text, flag
    args = [str(a) for a in container(frontend_pod(docs))["args"]]
    for flag in (a for a in args if a.startswith("--") and a.endswith(("-s", "-timeout"))):
        assert flag in text, f"{flag} is set in frontend.yaml but README.md does not say why"
