"""The package's dependencies point one way: a unit (a subpackage or top-level module of
`safeserve`) imports only units of lower tiers, and no modules import each other in a cycle.
Every import statement counts, also those inside functions and under `if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "safeserve"

# Lowest first; a unit may import units of lower tiers only (and itself).
TIERS: list[set[str]] = [
    {"config", "messages", "ports"},  # flags, cross-process messages, plain helpers
    {"policy", "wire"},  # guard policy presets; the typed encoding and keys of what crosses hosts
    # Triton kernels; rank layout and comms; rank processes (spawn)
    {"kernels", "parallel", "guards", "config_cli", "spawn"},
    {"layers", "moe"},  # the model families' building blocks; the MoE stages
    {"model"},  # families, registry, loader
    {"engine"},  # scheduler, runner, ranks
    {
        "server",
        "bench",
        "chaos",
        "oncall",
        "plan",
        "node",
    },  # the frontends over an engine; the planner
    {"cli", "__main__"},
]
TIER = {unit: i for i, units in enumerate(TIERS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> set[str]:
    return imports_of(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_of(source: str, this: str, is_package: bool = False) -> set[str]:
    """Every `safeserve` module the source of module `this` imports (a `from x import y` names
    x, and x.y where that is a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                pkg = this.split(".")
                up = node.level - 1 if is_package else node.level
                pkg = pkg[: len(pkg) - up]
                base = ".".join(pkg + ([base] if base else []))
            out.add(base)
            for a in node.names:
                candidate = f"{base}.{a.name}"
                if _exists(candidate):
                    out.add(candidate)
    return {m for m in out if m == "safeserve" or m.startswith("safeserve.")}


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


def test_every_unit_has_a_tier() -> None:
    units = {unit_of(m) for m in graph()} - {"__init__"}
    assert units <= set(TIER), f"units without a tier in TIERS: {sorted(units - set(TIER))}"


def test_imports_point_down() -> None:
    wrong = []
    for module, targets in sorted(graph().items()):
        src = unit_of(module)
        for target in sorted(targets):
            dst = unit_of(target)
            if dst in (src, "__init__"):
                continue
            if TIER[dst] >= TIER[src]:
                wrong.append(
                    f"{module} imports {target} ({src} tier {TIER[src]}, {dst} tier {TIER[dst]})"
                )
    assert not wrong, "imports against the tiers:\n" + "\n".join(wrong)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    g = graph()
    # A module importing its own package (loaded before it in any case) makes no cycle.
    for module in g:
        g[module] = {t for t in g[module] if not module.startswith(t + ".")}
    found = cycles(g)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_check_sees_every_kind_of_import() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from safeserve.server.app import build_app\n"
        "def f():\n    import safeserve.engine.engine\n"
        "from ..moe import layer\n"
    )
    found = imports_of(source, "safeserve.model.loader")
    assert {"safeserve.server.app", "safeserve.engine.engine", "safeserve.moe.layer"} <= found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
